//! PyTorch's memory-snapshot format: what `torch.cuda.memory._snapshot()` returns and
//! `torch.cuda._memory_viz` (and pytorch.org/memory_viz) render, so carve's memory can be looked
//! at with the viewer PyTorch users already know.
//!
//! A [`Snapshot`] holds the reserved **segments**, each tiled by its **blocks** (allocated or
//! free), and per device a **trace** of events (`alloc`, `free_requested`, `free_completed`,
//! `segment_alloc`, `segment_free`, `oom`). [`Snapshot::to_pickle`] writes it as a pickled dict
//! with PyTorch's field names; the lab (`carve-lab`) reads PyTorch's own snapshots back.
//!
//! [`TrackingResourceAdaptor`](crate::adaptor::TrackingResourceAdaptor) records the trace
//! (`record_history`) and builds snapshots; `carve replay --snapshot` writes one per replay.

mod build;
mod frames;
mod pickle;

pub use build::{BlockSpan, SegmentSpan, MAX_DEVICES};
pub use frames::frames_of;

use std::path::Path;

use crate::error::{Error, Result};

/// One stack frame, as PyTorch records them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Frame {
    /// Source file.
    pub filename: String,
    /// Line in it.
    pub line: u64,
    /// Function.
    pub name: String,
}

/// A block's state (PyTorch's strings).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out (`active_allocated`).
    ActiveAllocated,
    /// Freed by its user, waiting for streams (`active_pending_free`).
    ActivePendingFree,
    /// Free (`inactive`).
    Inactive,
}

impl BlockState {
    /// PyTorch's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            BlockState::ActiveAllocated => "active_allocated",
            BlockState::ActivePendingFree => "active_pending_free",
            BlockState::Inactive => "inactive",
        }
    }

    /// The state PyTorch's name stands for, or `None` for a name it does not use.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "active_allocated" => BlockState::ActiveAllocated,
            "active_pending_free" => BlockState::ActivePendingFree,
            "inactive" => BlockState::Inactive,
            _ => return None,
        })
    }
}

/// A block of a segment; a segment's blocks tile it, in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Block {
    /// Start address.
    pub address: u64,
    /// Bytes the block spans.
    pub size: u64,
    /// Bytes the user asked for (at most `size`; 0 for free blocks).
    pub requested_size: u64,
    /// Allocated or free.
    pub state: BlockState,
    /// Where it was allocated, when known.
    pub frames: Vec<Frame>,
}

/// Memory reserved from the upstream (PyTorch: one `cudaMalloc`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Device ordinal.
    pub device: u64,
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// The stream it was allocated on (a raw handle; 0 is the default stream).
    pub stream: u64,
    /// Its blocks, tiling `address .. address + total_size`.
    pub blocks: Vec<Block>,
}

impl Segment {
    /// Bytes in allocated blocks.
    pub fn allocated_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum()
    }

    /// Bytes in blocks not free (allocated or pending free).
    pub fn active_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| b.size)
            .sum()
    }

    /// Bytes users asked for in the active blocks.
    pub fn requested_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state != BlockState::Inactive)
            .map(|b| b.requested_size)
            .sum()
    }
}

/// What a trace event records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// A block handed out.
    Alloc,
    /// A block freed by its user.
    FreeRequested,
    /// A block's free took effect (reusable).
    FreeCompleted,
    /// Memory reserved from the upstream.
    SegmentAlloc,
    /// Memory returned to the upstream.
    SegmentFree,
    /// A request that failed for want of memory.
    Oom,
    /// Any other action PyTorch records (`segment_map`, `snapshot`, ...), kept as read.
    Other(String),
}

impl Action {
    /// PyTorch's name for it.
    pub fn as_str(&self) -> &str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
            Action::Other(s) => s,
        }
    }

    /// The action PyTorch's name stands for ([`Action::Other`] for a name carve does not model).
    pub fn parse(s: &str) -> Self {
        match s {
            "alloc" => Action::Alloc,
            "free_requested" => Action::FreeRequested,
            "free_completed" => Action::FreeCompleted,
            "segment_alloc" => Action::SegmentAlloc,
            "segment_free" => Action::SegmentFree,
            "oom" => Action::Oom,
            other => Action::Other(other.to_owned()),
        }
    }
}

/// One event of a device's trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceEntry {
    /// What happened.
    pub action: Action,
    /// The block's or segment's address (0 for `oom`).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// The stream (raw handle; 0 is the default stream).
    pub stream: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: i64,
    /// Where it happened, when known.
    pub frames: Vec<Frame>,
    /// For `oom`: bytes the device had free, when known.
    pub device_free: Option<u64>,
}

/// A memory snapshot in PyTorch's shape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Reserved memory, each segment tiled by its blocks.
    pub segments: Vec<Segment>,
    /// Per device ordinal, the events in order.
    pub device_traces: Vec<Vec<TraceEntry>>,
}

impl Snapshot {
    /// The pickle `torch.cuda.memory._snapshot()` would give (protocol 3).
    pub fn to_pickle(&self) -> Result<Vec<u8>> {
        pickle::to_pickle(self)
    }

    /// Writes [`to_pickle`](Self::to_pickle) to `path`.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        std::fs::write(path, self.to_pickle()?)?;
        Ok(())
    }

    /// Checks what `torch.cuda._memory_viz` relies on: blocks tile their segment exactly, in
    /// address order; requested sizes fit their blocks.
    pub fn check(&self) -> Result<()> {
        for (i, seg) in self.segments.iter().enumerate() {
            let mut at = seg.address;
            for b in &seg.blocks {
                if b.address != at {
                    return Err(malformed(format!(
                        "segment {i} at {:#x}: block at {:#x}, expected {at:#x}",
                        seg.address, b.address
                    )));
                }
                if b.size == 0 || b.requested_size > b.size {
                    return Err(malformed(format!(
                        "segment {i}: block at {at:#x} of {} bytes requests {}",
                        b.size, b.requested_size
                    )));
                }
                at = at
                    .checked_add(b.size)
                    .ok_or_else(|| malformed(format!("segment {i} overflows")))?;
            }
            if at - seg.address != seg.total_size {
                return Err(malformed(format!(
                    "segment {i} at {:#x}: blocks cover {} of {} bytes",
                    seg.address,
                    at - seg.address,
                    seg.total_size
                )));
            }
        }
        Ok(())
    }
}

pub(crate) fn malformed(reason: String) -> Error {
    Error::InvalidArgument(format!("memory snapshot: {reason}"))
}

/// Microseconds since the Unix epoch, now.
pub(crate) fn now_us() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64)
}
