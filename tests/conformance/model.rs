//! Bookkeeping the checks share: live blocks (disjoint, tagged), ranges freed on a stream, and
//! the rule a cross-stream reuse must follow in a [`RecordingOrder`] log.

use std::collections::BTreeMap;
use std::ptr::NonNull;

use carve::resource::OrderEvent;
use carve::{StreamId, StreamRef};

/// One live block.
#[derive(Clone, Copy, Debug)]
pub struct Block {
    pub ptr: NonNull<u8>,
    pub bytes: usize,
    pub align: usize,
    tag: u8,
}

// SAFETY: a `Block` is an address and sizes; the checks move them between threads only to free
// them, which the resource contract allows from any thread.
unsafe impl Send for Block {}

/// Live blocks of one resource, by address: each new block must be aligned and overlap none
/// of the others, and (in host-accessible memory) keeps a tag byte that must survive until it
/// is freed.
#[derive(Default)]
pub struct Live {
    blocks: BTreeMap<usize, Block>,
    fill: bool,
    next_tag: u8,
}

impl Live {
    /// Tracks blocks; `fill` writes and checks tags (host-accessible memory only).
    pub fn new(fill: bool) -> Self {
        Live {
            fill,
            ..Self::default()
        }
    }

    /// Records a fresh block, checking alignment and overlap, and tags it.
    pub fn add(&mut self, name: &str, ptr: NonNull<u8>, bytes: usize, align: usize) {
        let a = ptr.as_ptr() as usize;
        assert_eq!(a % align, 0, "{name}: {a:#x} is not aligned to {align}");
        if let Some((&b, blk)) = self.blocks.range(..=a).next_back() {
            assert!(
                b + blk.bytes <= a,
                "{name}: new block {a:#x}+{bytes} overlaps live block {b:#x}+{}",
                blk.bytes
            );
        }
        if let Some((&b, _)) = self.blocks.range(a..).next() {
            assert!(
                a + bytes <= b,
                "{name}: new block {a:#x}+{bytes} overlaps live block {b:#x}"
            );
        }
        self.next_tag = self.next_tag.wrapping_add(1).max(1);
        if self.fill {
            // SAFETY: the resource just handed out `bytes` host-accessible bytes at `ptr`.
            unsafe { ptr.as_ptr().write_bytes(self.next_tag, bytes) };
        }
        let tag = self.next_tag;
        self.blocks.insert(
            a,
            Block {
                ptr,
                bytes,
                align,
                tag,
            },
        );
    }

    /// Takes out the `pick`-th live block (mod count), checking its tag survived.
    pub fn take(&mut self, name: &str, pick: usize) -> Option<Block> {
        if self.blocks.is_empty() {
            return None;
        }
        let &a = self.blocks.keys().nth(pick % self.blocks.len())?;
        let blk = self.blocks.remove(&a)?;
        if self.fill {
            // SAFETY: the block is live and `bytes` long.
            let s = unsafe { std::slice::from_raw_parts(blk.ptr.as_ptr(), blk.bytes) };
            if let Some(i) = s.iter().position(|&b| b != blk.tag) {
                panic!(
                    "{name}: byte {i} of live block {a:#x}+{} was overwritten ({:#x}, tag {:#x})",
                    blk.bytes, s[i], blk.tag
                );
            }
        }
        Some(blk)
    }

    /// Number of live blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when nothing is live.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }
}

/// Address ranges freed on some stream and not handed out since: start -> (end, the stream's
/// [`StreamRef::id`], length of the order log when the free began).
#[derive(Default)]
pub struct FreedRanges {
    ranges: BTreeMap<usize, (usize, StreamId, usize)>,
}

impl FreedRanges {
    /// Records `[start, start + len)` freed on the stream with id `stream` when the log had
    /// `log_len` events.
    pub fn freed(&mut self, start: usize, len: usize, stream: StreamId, log_len: usize) {
        self.carve(start, start + len);
        self.ranges.insert(start, (start + len, stream, log_len));
    }

    /// `[start, start + len)` was just handed out: returns the (stream id, log length) of every
    /// freed range it overlaps, and forgets the overlapped parts.
    pub fn reused(&mut self, start: usize, len: usize) -> Vec<(StreamId, usize)> {
        self.carve(start, start + len)
    }

    fn carve(&mut self, start: usize, end: usize) -> Vec<(StreamId, usize)> {
        let first = self
            .ranges
            .range(..start)
            .next_back()
            .filter(|(_, &(e, _, _))| e > start)
            .map(|(&s, _)| s)
            .unwrap_or(start);
        let hits: Vec<_> = self
            .ranges
            .range(first..end)
            .map(|(&s, &v)| (s, v))
            .collect();
        let mut out = Vec::new();
        for (s, (e, stream, log)) in hits {
            self.ranges.remove(&s);
            out.push((stream, log));
            if s < start {
                self.ranges.insert(s, (start, stream, log));
            }
            if e > end {
                self.ranges.insert(end, (e, stream, log));
            }
        }
        out
    }
}

/// True when `events` (the log from just before a block was freed on stream `freer`) show
/// stream `user` ordered after the free: a device-wide synchronisation, a synchronisation of
/// `freer`, or a mark of `freer` followed by `user` waiting on it. Streams by
/// [`StreamRef::id`].
pub fn ordered_after_free(events: &[OrderEvent], freer: StreamId, user: StreamId) -> bool {
    let mut marked = false;
    for e in events {
        match e {
            OrderEvent::SyncAll => return true,
            OrderEvent::Sync(s) if *s == freer => return true,
            OrderEvent::Mark(s) if *s == freer => marked = true,
            OrderEvent::Wait { waiter, signaller }
                if marked && *waiter == user && *signaller == freer =>
            {
                return true
            }
            _ => {}
        }
    }
    false
}

#[test]
fn freed_ranges_split_and_forget_what_is_reused() {
    let (a, b) = (StreamRef::simulated(1).id(), StreamRef::simulated(2).id());
    let mut f = FreedRanges::default();
    f.freed(1000, 1000, a, 3);
    f.freed(3000, 100, b, 5);
    assert_eq!(f.reused(1500, 100), vec![(a, 3)]);
    assert_eq!(f.reused(2000, 500), vec![]);
    assert_eq!(f.reused(1400, 300), vec![(a, 3), (a, 3)]);
    assert_eq!(f.reused(1900, 2000), vec![(a, 3), (b, 5)]);
    assert_eq!(f.reused(0, 10_000), vec![(a, 3), (a, 3)]);
    assert_eq!(f.reused(0, 10_000), vec![]);
}

#[test]
fn a_reuse_is_ordered_only_by_a_sync_or_a_mark_then_a_wait() {
    let (a, b) = (StreamRef::simulated(1).id(), StreamRef::simulated(2).id());
    let wait = OrderEvent::Wait {
        waiter: b,
        signaller: a,
    };
    let (ia, ib) = (a, b);
    let ordered = |events: &[OrderEvent]| ordered_after_free(events, ia, ib);
    assert!(!ordered(&[]));
    assert!(!ordered(&[wait]), "a wait on an old mark");
    assert!(ordered(&[OrderEvent::Mark(a), wait]));
    assert!(!ordered(&[wait, OrderEvent::Mark(a)]));
    assert!(!ordered(&[OrderEvent::Mark(b), wait]));
    assert!(ordered(&[OrderEvent::SyncAll]));
    assert!(ordered(&[OrderEvent::Sync(a)]));
    assert!(!ordered(&[OrderEvent::Sync(b)]));
}
