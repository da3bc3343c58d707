//! The allocation path: the stream's own stacks, then the shared ready stack, then, under the
//! refill lock, other streams' blocks or a new slab. The order of that last step bounds held
//! memory (see the module docs of `fixed_size`).

use std::ptr;

use super::slots::Claimed;
use super::stack::{chain_tail, Links, Moved, TaggedStack, NIL};
use super::{Inner, Slab, Undo, GRAIN};
use crate::error::Result;
use crate::resource::memory_resource::MemoryResource;
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::sync::lock;
use crate::sync::spin_loop;

/// Chains detached for a device-wide synchronisation; dropped before they are handed on (the
/// synchronisation failed or panicked), they go back where they were.
struct Detached<'a, R: MemoryResource> {
    inner: &'a Inner<R>,
    chains: Vec<(&'a TaggedStack, u32, u32)>,
}

impl<R: MemoryResource> Drop for Detached<'_, R> {
    fn drop(&mut self) {
        for (stack, first, last) in self.chains.drain(..) {
            stack.push_chain(self.inner, first, last);
        }
    }
}

impl<R: MemoryResource> Inner<R> {
    /// A free block for `stream`, ordered after any other stream it came from, counted in use.
    pub(super) fn pop_for(&self, stream: StreamRef<'_>) -> Result<u32> {
        loop {
            let epoch = self.seal_epoch.load(Ordering::Acquire);
            let slot = self.slot_of(stream);
            if let Some(c) = slot {
                match self.pop_own(c) {
                    Ok(Some(i)) => return Ok(self.counted(slot, i)),
                    Ok(None) => {}
                    // The slot is changing stream: wait for the change, then look again.
                    Err(Moved) => {
                        spin_loop();
                        continue;
                    }
                }
            }
            if let Some(i) = self.ready.pop(self) {
                return Ok(self.counted(slot, i));
            }
            if let Some(i) = self.slow(stream, epoch)? {
                return Ok(i);
            }
            spin_loop();
        }
    }

    fn pop_own(&self, c: Claimed<'_>) -> std::result::Result<Option<u32>, Moved> {
        let owned = || self.owns(c);
        match c.slot.fresh.pop_if(self, owned)? {
            Some(i) => Ok(Some(i)),
            None => c.slot.sealed.pop_if(self, owned),
        }
    }

    /// Counts `i` as allocated (after the pop: the estimate never runs ahead of the truth).
    fn counted(&self, slot: Option<Claimed<'_>>, i: u32) -> u32 {
        let allocs = slot.map_or(&self.loose_allocs, |c| &c.slot.allocs);
        allocs.fetch_add(1, Ordering::Relaxed);
        i
    }

    /// Blocks in use, from the counters: allocations read first, so a free counted meanwhile
    /// only lowers the estimate. Never above the blocks in use at some moment of the call.
    pub(super) fn in_use(&self) -> usize {
        let sum = |loose: usize, f: &dyn Fn(&super::slots::Slot) -> usize| {
            self.slots.iter().fold(loose, |a, s| a.wrapping_add(f(s)))
        };
        let allocs = sum(self.loose_allocs.load(Ordering::Relaxed), &|s| {
            s.allocs.load(Ordering::Relaxed)
        });
        let frees = sum(self.loose_frees.load(Ordering::Relaxed), &|s| {
            s.frees.load(Ordering::Relaxed)
        });
        match allocs.wrapping_sub(frees) {
            d if d <= self.total_blocks() => d,
            _ => 0,
        }
    }

    pub(super) fn total_blocks(&self) -> usize {
        self.slab_count.load(Ordering::Acquire) * self.per_slab as usize
    }

    /// Under the refill lock: the stream's stacks and the ready stack again, then another
    /// stream's sealed stack, then, if enough blocks are free elsewhere, all of them after one
    /// device-wide synchronisation, else a new slab; once refills fail, whatever is free.
    /// `Ok(None)`: blocks were moving, look again.
    fn slow(&self, stream: StreamRef<'_>, epoch: usize) -> Result<Option<u32>> {
        let _guard = lock(&self.refill);
        let slot = self.take_over_slot(stream);
        if let Some(c) = slot {
            // Under this lock the slot cannot change stream.
            if let Ok(Some(i)) = self.pop_own(c) {
                return Ok(Some(self.counted(slot, i)));
            }
        }
        if let Some(i) = self.ready.pop(self) {
            return Ok(Some(self.counted(slot, i)));
        }
        if let Some(c) = slot {
            if let Some(i) = self.steal(stream, c)? {
                return Ok(Some(self.counted(slot, i)));
            }
        }
        let in_use = self.in_use();
        let free = self.total_blocks().saturating_sub(in_use);
        let plenty = free >= in_use.max(self.per_slab as usize);
        let moving = || {
            let now = self.seal_epoch.load(Ordering::Acquire);
            now != epoch || now % 2 == 1
        };
        if plenty {
            self.demand.fetch_add(1, Ordering::Relaxed);
            // As many blocks as the stream has in use (at least a refill's worth): a stream
            // that keeps running dry doubles its stock each time, and streams that are not
            // short keep theirs instead of all allocating from the shared stack.
            let want = slot.map_or(usize::MAX, |c| {
                self.in_use_on(c).max(self.per_slab as usize)
            });
            if let Some(i) = self.gather(slot, want)? {
                return Ok(Some(self.counted(slot, i)));
            }
            if moving() {
                return Ok(None);
            }
        }
        let short = match self.refill(stream, slot) {
            Ok(i) => return Ok(Some(self.counted(slot, i))),
            Err(e) if e.is_out_of_memory() => e,
            Err(e) => return Err(e),
        };
        if !plenty {
            self.demand.fetch_add(1, Ordering::Relaxed);
            if let Some(i) = self.gather(slot, usize::MAX)? {
                return Ok(Some(self.counted(slot, i)));
            }
        }
        // Blocks being sealed are on no stack for a moment, and a seal that ran during the scan
        // may have moved blocks behind it: look again before giving up.
        if moving() {
            return Ok(None);
        }
        Err(short)
    }

    /// Takes another stream's whole sealed stack: detach first, then wait on that stream's last
    /// mark, which was recorded after every block in the chain was sealed. A wait that fails or
    /// panics puts the chain back.
    fn steal(&self, stream: StreamRef<'_>, mine: Claimed<'_>) -> Result<Option<u32>> {
        for (i, other) in self.slots.iter().enumerate() {
            if i == mine.i || other.sealed.is_empty() {
                continue;
            }
            let Some(first) = other.sealed.take_all() else {
                continue;
            };
            let last = chain_tail(self, first);
            let back = Undo::new(|| other.sealed.push_chain(self, first, last));
            self.order.wait_for_mark(stream, self.stream_of(i))?;
            back.disarm();
            let rest = self.next(first).load(Ordering::Relaxed);
            if rest != NIL {
                mine.slot.fresh.push_chain(self, rest, last);
            }
            return Ok(Some(first));
        }
        Ok(None)
    }

    /// Detaches every other stream's blocks and the parked ones, waits for all device work,
    /// and only then hands up to `want` of them to the caller's stream (to every stream if it
    /// has no slot); the rest go back to the streams they came from (parked ones to every
    /// stream). A synchronisation that fails or panics puts every chain back where it was.
    fn gather(&self, mine: Option<Claimed<'_>>, want: usize) -> Result<Option<u32>> {
        let mut taken = Detached {
            inner: self,
            chains: Vec::new(),
        };
        // Per stack: whether its stream has blocks in use (it gets back what the caller leaves).
        let stacks = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !mine.is_some_and(|m| ptr::eq(*s, m.slot)))
            .flat_map(|(i, s)| {
                let busy = self.in_use_at(i) > 0;
                [(&s.fresh, busy), (&s.sealed, busy)]
            })
            .chain([(&self.parked, false)]);
        let mut busy = Vec::new();
        for (stack, b) in stacks {
            if let Some(first) = stack.take_all() {
                taken.chains.push((stack, first, chain_tail(self, first)));
                busy.push(b);
            }
        }
        if taken.chains.is_empty() {
            return Ok(None);
        }
        self.order.synchronize_all()?;
        // Under the refill lock the caller's slot cannot change stream, and no stack closes.
        let to = mine.map_or(&self.ready, |m| &m.slot.fresh);
        let mut left = want.max(1);
        let mut chains: Vec<_> = std::mem::take(&mut taken.chains)
            .into_iter()
            .zip(busy)
            .collect();
        // Blocks of streams with nothing in use (which may be gone) and parked ones go to every
        // stream, and count towards the caller's share; then the caller takes the rest of its
        // share from busy streams, which keep what it leaves.
        chains.sort_by_key(|&(_, busy)| busy);
        for ((from, first, last), busy) in chains {
            if !busy {
                left = left.saturating_sub(self.chain_len(first, last));
                self.ready.push_chain(self, first, last);
                continue;
            }
            if left == 0 {
                from.push_chain(self, first, last);
                continue;
            }
            let (mut cut, mut n) = (first, 1);
            while n < left && cut != last {
                cut = self.next(cut).load(Ordering::Relaxed);
                n += 1;
            }
            let rest = self.next(cut).load(Ordering::Relaxed);
            to.push_chain(self, first, cut);
            if cut != last {
                from.push_chain(self, rest, last);
            }
            left -= n;
        }
        Ok(self.ready.pop(self).or_else(|| to.pop(self)))
    }

    /// Blocks in the detached chain `first -> ... -> last`.
    fn chain_len(&self, first: u32, last: u32) -> usize {
        let (mut at, mut n) = (first, 1);
        while at != last {
            at = self.next(at).load(Ordering::Relaxed);
            n += 1;
        }
        n
    }

    fn in_use_on(&self, c: Claimed<'_>) -> usize {
        self.in_use_at(c.i)
    }

    /// Blocks in use on slot `i`'s stream by its own counters (0 if frees there outnumber
    /// allocations, as when blocks allocated elsewhere are freed on it).
    fn in_use_at(&self, i: usize) -> usize {
        let allocs = self.slots[i].allocs.load(Ordering::Relaxed);
        let frees = self.slots[i].frees.load(Ordering::Relaxed);
        match allocs.wrapping_sub(frees) {
            d if d <= self.total_blocks() => d,
            _ => 0,
        }
    }

    /// A new slab from the upstream, allocated on `stream`. Its spare blocks go to the stream's
    /// fresh stack, or, for a stream without a slot, to every stream once `stream` is
    /// synchronised; if that fails or panics, the whole slab is parked (free to any stream
    /// after a device-wide synchronisation) and nothing is handed out.
    fn refill(&self, stream: StreamRef<'_>, slot: Option<Claimed<'_>>) -> Result<u32> {
        let n = self.slab_count.load(Ordering::Relaxed);
        let span = self.per_slab as usize * self.stride;
        if n >= self.max_slabs {
            return Err(self.oom(format!("all {} refills are spent", self.max_slabs)));
        }
        let base = match self.upstream.allocate(stream, span, GRAIN) {
            Ok(p) => p.as_ptr() as usize,
            Err(e) if e.is_out_of_memory() => {
                return Err(self.oom(format!("the upstream could not supply {span} bytes: {e}")))
            }
            Err(e) => return Err(e),
        };
        let first = n as u32 * self.per_slab;
        let per = self.per_slab;
        let last = first + per - 1;
        let slab = Box::new(Slab {
            base,
            next: (0..per)
                .map(|i| AtomicU32::new(if i + 1 < per { first + i + 1 } else { NIL }))
                .collect(),
            live: (0..per.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        });
        self.slabs[n].store(Box::into_raw(slab).expose_provenance(), Ordering::Release);
        self.slab_count.store(n + 1, Ordering::Release);
        self.lookup.insert(base, n as u32);
        if per == 1 {
            return Ok(first);
        }
        match slot {
            // Under the refill lock the slot cannot change stream.
            Some(c) => c.slot.fresh.push_chain(self, first + 1, last),
            None => {
                let park = Undo::new(|| self.parked.push_chain(self, first, last));
                self.order.synchronize(stream)?;
                park.disarm();
                self.ready.push_chain(self, first + 1, last);
            }
        }
        Ok(first)
    }
}
