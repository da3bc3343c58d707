//! A slab segment's arrays and the atomic steps on them: reserving blocks in a shard's count,
//! claiming bits of a bitmap word.

use super::{wrap_cursor, Slab};
use crate::heap_layout::*;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::warp::{lowest_set_bits, Warp};

impl<'a> Slab<'a> {
    /// Views a slab segment.
    ///
    /// # Safety
    /// `h` must describe a formatted slab (see [`crate::heap_layout`]) whose arrays stay valid,
    /// and are accessed only atomically by others, for `'a`.
    #[inline(always)]
    pub unsafe fn new(h: &'a HeapHandle) -> Self {
        Slab {
            h,
            home: h,
            cursor: false,
        }
    }

    /// This view with shard counts that are cursors (`cursor`: the segment is a class of a
    /// general heap, whose handles carry [`FLAG_CURSOR_SHARDS`]) or counts of blocks in use.
    #[inline(always)]
    pub fn cursors(self, cursor: bool) -> Self {
        debug_assert_eq!(cursor, self.h.flags & FLAG_CURSOR_SHARDS != 0);
        Slab { cursor, ..self }
    }

    /// Views a slab segment through `copy`, a copy of the handle at `home` (equal to it).
    ///
    /// # Safety
    /// As for [`Slab::new`], for `home`.
    #[inline(always)]
    pub unsafe fn with_copy(copy: &'a HeapHandle, home: &'a HeapHandle) -> Self {
        debug_assert!(copy == home);
        Slab {
            h: copy,
            home,
            cursor: false,
        }
    }

    /// The same segment through its handle in the region (for the out-of-line paths).
    #[inline(always)]
    pub(super) fn at_home(&self) -> Self {
        Slab {
            h: self.home,
            home: self.home,
            cursor: self.cursor,
        }
    }

    /// Blocks in this segment. Only fields are handed out, never the handle: on the GPU it may
    /// be a register copy ([`Slab::with_copy`]), which a reference passed to an out-of-line
    /// function would move to local memory.
    pub fn capacity(&self) -> u64 {
        self.h.capacity
    }

    /// The handle in the region (the one [`Slab::with_copy`] was given as `home`).
    pub(crate) fn home(&self) -> &'a HeapHandle {
        self.home
    }

    #[inline(always)]
    pub(super) fn word(&self, i: u32) -> &'a AtomicU64 {
        debug_assert!(i < self.h.nwords);
        // SAFETY: `new`'s contract: `words` holds `nwords` atomics for 'a.
        unsafe { &*(self.h.words as *const AtomicU64).add(i as usize) }
    }

    #[inline(always)]
    pub(super) fn used(&self, s: u32) -> &'a AtomicU32 {
        debug_assert!(s < self.h.nshards);
        // SAFETY: as for `word`, with `nshards` counts.
        unsafe { &*(self.h.shard_used as *const AtomicU32).add(s as usize) }
    }

    #[inline(always)]
    pub(super) fn peak(&self, s: u32) -> &'a AtomicU32 {
        // SAFETY: as for `used`.
        unsafe { &*(self.h.shard_peak as *const AtomicU32).add(s as usize) }
    }

    #[inline(always)]
    pub(super) fn counter(&self, which: usize, slot: u32) -> &'a AtomicU64 {
        let i = which * COUNTER_SLOTS + (slot as usize % COUNTER_SLOTS);
        // SAFETY: `counters` holds COUNTERS × COUNTER_SLOTS atomics for 'a.
        unsafe { &*(self.h.counters as *const AtomicU64).add(i) }
    }

    /// Blocks in shard `s` (the last one may be short).
    #[inline(always)]
    pub fn shard_capacity(&self, s: u32) -> u32 {
        let per = 64u64 << self.h.shard_words_log2;
        let start = s as u64 * per;
        (self.h.capacity - start).min(per) as u32
    }

    /// Bits of word `w` that stand for blocks (all but the tail of the last word).
    #[inline(always)]
    pub(super) fn valid_bits(&self, w: u32) -> u64 {
        let rest = self.h.capacity - w as u64 * 64;
        if rest >= 64 {
            u64::MAX
        } else {
            (1u64 << rest) - 1
        }
    }

    /// Reserves up to `want` blocks of shard `s` with one `fetch_add`; returns how many.
    ///
    /// The excess over the shard's capacity is given back at once, so without concurrent frees
    /// the reservations of all callers add up to exactly the capacity. With cursors nothing is
    /// reserved: `want`, and the claim finds what it can.
    #[inline(always)]
    pub fn reserve(&self, s: u32, want: u32) -> u32 {
        self.reserve_in(s, self.shard_capacity(s), want)
    }

    /// [`Slab::reserve`] for shard `s` of `cap` blocks.
    #[inline(always)]
    pub(super) fn reserve_in(&self, s: u32, cap: u32, want: u32) -> u32 {
        if self.cursor {
            return want;
        }
        self.reserve_seen(s, cap, want).0
    }

    /// [`Slab::reserve_in`], with the shard's count before this call's `fetch_add`; a reservation
    /// of `take > 0` blocks ends at or below the shard's capacity from there: `old + take <= cap`.
    ///
    /// With cursors: moves the cursor by `want` (one Relaxed `fetch_add`, nothing given back,
    /// no peak) and returns where it stood, as a block of the shard, and `want`: a run from
    /// there goes on at the shard's start past its end ([`super::Lead::block`]). The short last
    /// shard, whose end may fall inside a word, clips the run to its end instead (at least one
    /// block).
    #[inline(always)]
    pub(super) fn reserve_seen(&self, s: u32, cap: u32, want: u32) -> (u32, u32) {
        if self.cursor {
            let old = self.used(s).fetch_add(want, Ordering::Relaxed);
            // Shards hold a power of two blocks, which divides 2^32: the cursor wraps in step.
            let per = 64u32 << self.h.shard_words_log2;
            let mut at = old & (per - 1);
            if cap == per {
                return (want, at);
            }
            if at >= cap {
                at = wrap_cursor(at, cap);
            }
            return (want.min(cap - at), at);
        }
        // Acquire: pairs with the Release decrement in `free`, so a reserved block's bit is seen
        // clear by the claim that follows. Relaxed, the slow path could wait on a bit it does not
        // see cleared yet: the loom model `slab_alloc_races_free` finds that spin.
        let old = self.used(s).fetch_add(want, Ordering::Acquire);
        let take = if old >= cap { 0 } else { want.min(cap - old) };
        if take < want {
            self.used(s).fetch_sub(want - take, Ordering::Relaxed);
        }
        if take > 0 {
            self.peak(s).fetch_max(old + take, Ordering::Relaxed);
        }
        (take, old)
    }

    /// Gives back `n` reserved blocks of shard `s` that were never claimed (or that a free
    /// cleared). Nothing with cursors: no count stands for them.
    #[inline(always)]
    pub fn unreserve(&self, s: u32, n: u32) {
        if n > 0 && !self.cursor {
            self.used(s).fetch_sub(n, Ordering::Release);
        }
    }

    /// One claim attempt on word `w`: sets up to `want` of the bits that `cur` (the caller's
    /// belief about the word) shows clear, at or above bit `from`. Returns the bits this call
    /// turned from clear to set, and the word's value after the `fetch_or`.
    ///
    /// Bits that were in fact set already are untouched, so a stale `cur` costs a retry, never a
    /// block handed out twice.
    #[inline(always)]
    pub fn claim_round<W: Warp>(
        &self,
        warp: &W,
        w: u32,
        cur: u64,
        from: u32,
        want: u32,
    ) -> (u64, u64) {
        let free = !cur & self.valid_bits(w) & (u64::MAX << from);
        if free == 0 || want == 0 {
            return (0, cur);
        }
        let mask = lowest_set_bits(free, want);
        // Acquire: the previous owners' accesses (released by their frees) happen before ours.
        let old = warp.fetch_or_acquire(self.word(w), mask);
        (mask & !old, old | mask)
    }

    /// True when shard `s` has a block not counted as used; with cursors, a clear bit in its
    /// words (a Relaxed load each: a stale answer costs a scan or a retry, never a block).
    #[inline(always)]
    pub fn has_room(&self, s: u32) -> bool {
        if self.cursor {
            let first = s << self.h.shard_words_log2;
            let end = (first + (1 << self.h.shard_words_log2)).min(self.h.nwords);
            return (first..end)
                .any(|w| !self.word(w).load(Ordering::Relaxed) & self.valid_bits(w) != 0);
        }
        self.used(s).load(Ordering::Relaxed) < self.shard_capacity(s)
    }

    /// Block `i`'s address (a multiply whatever the size: cheaper than testing for a shift).
    #[inline(always)]
    pub(crate) fn block(&self, i: u64) -> *mut u8 {
        (self.h.data + i * self.h.block_size) as *mut u8
    }
}
