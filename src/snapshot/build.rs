//! Building a [`Snapshot`] from what a tracker knows: the reserved ranges, the live blocks and
//! the events. Blocks are placed in the segment that holds them, and the gaps become free
//! blocks, so every segment is tiled exactly as PyTorch's viewer expects.

use super::{malformed, Block, BlockState, Frame, Segment, Snapshot, TraceEntry};
use crate::error::Result;

/// Device ordinals a snapshot accepts (its trace list has one entry per ordinal up to the one
/// used, as PyTorch's does).
pub const MAX_DEVICES: u64 = 1024;

/// A reserved range (one upstream allocation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentSpan {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Raw stream handle it was allocated on.
    pub stream: u64,
}

/// A live block.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockSpan {
    /// Start address.
    pub address: u64,
    /// Bytes asked for.
    pub size: u64,
    /// Raw stream handle it was allocated on.
    pub stream: u64,
    /// Where it was allocated, when known.
    pub frames: Vec<Frame>,
}

impl Snapshot {
    /// A snapshot of device `device`: `segments` tiled by `blocks` (a block inside no segment, or
    /// straddling one's end, gets a segment of its own; a block overlapping an earlier one is
    /// dropped), and `trace` as that device's events. A device ordinal of [`MAX_DEVICES`] or more
    /// is an error.
    pub fn from_spans(
        device: u64,
        segments: &[SegmentSpan],
        blocks: &[BlockSpan],
        trace: Vec<TraceEntry>,
    ) -> Result<Snapshot> {
        if device >= MAX_DEVICES {
            return Err(malformed(format!(
                "device ordinal {device} (at most {})",
                MAX_DEVICES - 1
            )));
        }
        let mut segs: Vec<SegmentSpan> = segments.iter().filter(|s| s.size > 0).cloned().collect();
        segs.sort_by_key(|s| s.address);
        // Drop segments overlapping an earlier one: a tracker never reports such, but a
        // snapshot must stay well-formed whatever it is given.
        let mut end = 0u64;
        segs.retain(|s| {
            let keep = s.address >= end && s.address.checked_add(s.size).is_some();
            if keep {
                end = s.address + s.size;
            }
            keep
        });
        let mut inside: Vec<Vec<&BlockSpan>> = vec![Vec::new(); segs.len()];
        let mut loose: Vec<&BlockSpan> = Vec::new();
        let mut sorted: Vec<&BlockSpan> = blocks.iter().filter(|b| b.size > 0).collect();
        sorted.sort_by_key(|b| b.address);
        for b in sorted {
            let Some(b_end) = b.address.checked_add(b.size) else {
                continue;
            };
            let i = segs.partition_point(|s| s.address <= b.address);
            match i.checked_sub(1) {
                Some(i) if b_end <= segs[i].address + segs[i].size => inside[i].push(b),
                _ => loose.push(b),
            }
        }
        let mut out: Vec<Segment> = segs
            .iter()
            .zip(&inside)
            .map(|(s, bs)| tile(device, s, bs))
            .collect();
        let mut end = 0u64;
        for b in loose {
            if b.address < end {
                continue;
            }
            end = b.address + b.size;
            let span = SegmentSpan {
                address: b.address,
                size: b.size,
                stream: b.stream,
            };
            out.push(tile(device, &span, &[b]));
        }
        out.sort_by_key(|s| s.address);
        let mut device_traces = vec![Vec::new(); device as usize + 1];
        device_traces[device as usize] = trace;
        Ok(Snapshot {
            segments: out,
            device_traces,
        })
    }
}

fn tile(device: u64, s: &SegmentSpan, blocks: &[&BlockSpan]) -> Segment {
    let free = |address, size| Block {
        address,
        size,
        requested_size: 0,
        state: BlockState::Inactive,
        frames: Vec::new(),
    };
    let mut out = Vec::with_capacity(2 * blocks.len() + 1);
    let mut at = s.address;
    for b in blocks {
        if b.address < at {
            continue; // overlaps the previous block
        }
        if b.address > at {
            out.push(free(at, b.address - at));
        }
        out.push(Block {
            address: b.address,
            size: b.size,
            requested_size: b.size,
            state: BlockState::ActiveAllocated,
            frames: b.frames.clone(),
        });
        at = b.address + b.size;
    }
    let end = s.address + s.size;
    if at < end {
        out.push(free(at, end - at));
    }
    Segment {
        device,
        address: s.address,
        total_size: s.size,
        stream: s.stream,
        blocks: out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(address: u64, size: u64) -> BlockSpan {
        BlockSpan {
            address,
            size,
            stream: 0,
            frames: Vec::new(),
        }
    }

    #[test]
    fn blocks_tile_their_segments_and_loose_blocks_get_their_own() {
        let segs = [
            SegmentSpan {
                address: 0x1000,
                size: 0x1000,
                stream: 0,
            },
            SegmentSpan {
                address: 0x4000,
                size: 0x100,
                stream: 7,
            },
        ];
        let blocks = [
            block(0x1100, 0x100),
            block(0x1000, 0x80),
            block(0x9000, 0x10),
            block(0x40f0, 0x20), // straddles the second segment's end
        ];
        let s = Snapshot::from_spans(1, &segs, &blocks, Vec::new()).unwrap();
        assert!(Snapshot::from_spans(u64::MAX, &segs, &blocks, Vec::new()).is_err());
        s.check().unwrap();
        assert_eq!(s.device_traces.len(), 2);
        let addrs: Vec<u64> = s.segments.iter().map(|s| s.address).collect();
        assert_eq!(addrs, vec![0x1000, 0x4000, 0x40f0, 0x9000]);
        assert_eq!(s.segments[0].allocated_size(), 0x180);
        assert_eq!(s.segments[0].blocks.len(), 4, "alloc, gap, alloc, tail");
        assert_eq!(s.segments[1].allocated_size(), 0);
        assert!(s.segments.iter().all(|g| g.device == 1));
    }
}
