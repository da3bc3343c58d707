//! Stream slots: each stream's stacks, found by hashing the stream, claimed on first use, and
//! handed to another stream once they hold no block; and the seal that moves a stream's fresh
//! blocks under a mark.

use std::sync::TryLockError;

use super::stack::{chain_tail, Moved, TaggedStack};
use super::{Inner, Undo, FREES_PER_MARK};
use crate::resource::memory_resource::MemoryResource;
use crate::stream::{StreamId, StreamRef};
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{Mutex, MutexGuard};

/// One stream's stacks, on their own cache lines so streams on different threads do not share.
/// (The slot's stream key lives apart, in `Inner::keys`, so that finding a slot reads only
/// lines nobody writes once streams have their slots.)
#[repr(align(128))]
pub(super) struct Slot {
    /// Freed since the stream's last mark.
    pub fresh: TaggedStack,
    /// Covered by the stream's last mark.
    pub sealed: TaggedStack,
    /// Frees counted here: the mark cadence, and, with `allocs`, the blocks in use.
    pub frees: AtomicUsize,
    /// Allocations counted here.
    pub allocs: AtomicUsize,
    /// `Inner::demand` at the stream's last mark.
    pub demand_seen: AtomicUsize,
    /// Held by a seal and by a change of stream, so that no seal spans a change.
    pub sealing: Mutex<()>,
}

impl Slot {
    pub fn new() -> Self {
        Slot {
            fresh: TaggedStack::new(),
            sealed: TaggedStack::new(),
            frees: AtomicUsize::new(0),
            allocs: AtomicUsize::new(0),
            demand_seen: AtomicUsize::new(0),
            sealing: Mutex::new(()),
        }
    }
}

/// A slot as found for a stream: valid while `Inner::owns` says so.
#[derive(Clone, Copy)]
pub(super) struct Claimed<'a> {
    pub slot: &'a Slot,
    pub i: usize,
    key: usize,
}

/// A lock, or `None` if another thread holds it; a poisoned lock guards no data here.
pub(super) fn try_lock(m: &Mutex<()>) -> Option<MutexGuard<'_, ()>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    }
}

fn key_of(stream: StreamRef<'_>) -> usize {
    stream.id().get().wrapping_add(1)
}

impl<R: MemoryResource> Inner<R> {
    /// Whether `c`'s slot still belongs to the stream it was found for.
    #[inline]
    pub(super) fn owns(&self, c: Claimed<'_>) -> bool {
        self.keys[c.i].load(Ordering::Acquire) == c.key
    }

    /// Slot indices in probe order for `key`.
    fn probe(&self, key: usize) -> impl Iterator<Item = usize> {
        let n = self.keys.len();
        let start = ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % n;
        (start..n).chain(0..start)
    }

    /// The stream's slot, claimed on first use: open addressing from a hash of the stream, so
    /// finding it costs about one probe however many streams there are. Keys never return to
    /// unclaimed, so a probe that meets an unclaimed slot knows the stream has none beyond it.
    pub(super) fn slot_of(&self, stream: StreamRef<'_>) -> Option<Claimed<'_>> {
        let key = key_of(stream);
        for i in self.probe(key) {
            let k = &self.keys[i];
            let now = match k.load(Ordering::Acquire) {
                0 => match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(self.claimed(i, key)),
                    Err(now) => now,
                },
                now => now,
            };
            if now == key {
                return Some(self.claimed(i, key));
            }
        }
        None
    }

    fn claimed(&self, i: usize, key: usize) -> Claimed<'_> {
        Claimed {
            slot: &self.slots[i],
            i,
            key,
        }
    }

    /// The stream's slot, or, once every slot is claimed, the first slot on the stream's probe
    /// path that holds no block, handed over to it (so `slot_of` finds it early). The caller
    /// holds the refill lock, so no steal or gather runs meanwhile. Both stacks are closed while
    /// the key changes: a push or pop that began for the old stream fails and looks again.
    pub(super) fn take_over_slot(&self, stream: StreamRef<'_>) -> Option<Claimed<'_>> {
        if let Some(c) = self.slot_of(stream) {
            return Some(c);
        }
        let key = key_of(stream);
        for i in self.probe(key) {
            let slot = &self.slots[i];
            let Some(_sealing) = try_lock(&slot.sealing) else {
                continue;
            };
            if !slot.fresh.close_if_empty() {
                continue;
            }
            if !slot.sealed.close_if_empty() {
                slot.fresh.reopen();
                continue;
            }
            self.keys[i].store(key, Ordering::Release);
            slot.fresh.reopen();
            slot.sealed.reopen();
            return Some(self.claimed(i, key));
        }
        None
    }

    /// [`take_over_slot`](Self::take_over_slot) if the refill lock is free now (frees never
    /// wait for a refill).
    pub(super) fn try_take_over_slot(&self, stream: StreamRef<'_>) -> Option<Claimed<'_>> {
        let _guard = try_lock(&self.refill)?;
        self.take_over_slot(stream)
    }

    /// The stream a claimed slot belongs to.
    pub(super) fn stream_of(&self, slot: usize) -> StreamId {
        let key = self.keys[slot].load(Ordering::Acquire);
        StreamId::from_usize(key.wrapping_sub(1))
    }

    /// Frees `index` (its live bit already cleared) onto `c`'s slot; every `FREES_PER_MARK`
    /// frees, while some stream ran short, seals. `Moved`: the slot changed stream first and
    /// nothing was done. A panicking mark unwinds from here with the block freed.
    pub(super) fn push_free(
        &self,
        stream: StreamRef<'_>,
        c: Claimed<'_>,
        index: u32,
    ) -> Result<(), Moved> {
        // Counted before the push: the estimate of blocks in use never runs ahead of the truth.
        let n = c.slot.frees.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if let Err(moved) = c.slot.fresh.push_if(self, index, index, || self.owns(c)) {
            c.slot.frees.fetch_sub(1, Ordering::Relaxed);
            return Err(moved);
        }
        if n % FREES_PER_MARK as usize != 0 {
            return Ok(());
        }
        let demand = self.demand.load(Ordering::Relaxed);
        if c.slot.demand_seen.swap(demand, Ordering::Relaxed) != demand {
            self.seal(stream, c);
        }
        Ok(())
    }

    /// Marks the stream and moves its fresh blocks (detached before the mark, so the mark covers
    /// them all) to its sealed stack. Skipped if another seal or a change of stream holds the
    /// slot. A mark that fails or panics leaves the blocks fresh (reachable after a
    /// synchronisation), and the seal epoch even.
    fn seal(&self, stream: StreamRef<'_>, c: Claimed<'_>) {
        let Some(_sealing) = try_lock(&c.slot.sealing) else {
            return;
        };
        if !self.owns(c) {
            return;
        }
        self.seal_epoch.fetch_add(1, Ordering::AcqRel);
        let _even = Undo::new(|| {
            self.seal_epoch.fetch_add(1, Ordering::AcqRel);
        });
        let Some(first) = c.slot.fresh.take_all() else {
            return;
        };
        let last = chain_tail(self, first);
        let back = Undo::new(|| c.slot.fresh.push_chain(self, first, last));
        if self.order.mark(stream).is_ok() {
            back.disarm();
            c.slot.sealed.push_chain(self, first, last);
        }
    }
}
