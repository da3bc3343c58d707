//! The slab heap: fixed-size blocks tracked by a bitmap (bit set = in use), counted per shard.
//!
//! **Allocation** is warp-cooperative. The leader of the lanes that call together
//! 1. reserves `k` blocks of one shard with one `fetch_add` on the shard's used count
//!    ([`Slab::reserve`]): once that succeeds, `k` clear bits are guaranteed to exist in the
//!    shard, because frees clear a bit *before* they decrement the count;
//! 2. claims them with one `fetch_or` per bitmap word ([`Slab::claim_round`]), several bits for
//!    several lanes at once, and hands the new bits out by lane rank.
//!
//! Warps start at a hint (on the GPU, their index in the grid spread evenly over the bitmap), so
//! on a fresh heap neighbouring warps claim disjoint bits and a warp costs about two atomics.
//! When a shard has no room the warp scans the shard counts, one per lane, for another; a warp
//! that finds none returns null (counted in the statistics). Without concurrent frees, a heap of
//! `K` blocks serves exactly `K` requests.
//!
//! **Free**: lanes freeing blocks of the same word (`match.any`) OR their bits together and one of
//! them clears them with one `fetch_and`, then decrements the shard count. In checked mode
//! ([`FLAG_CHECKED_FREES`]) the returned word tells which bits were already clear: those are
//! counted as double frees and left out of the count, so the heap stays consistent. Pointers
//! outside the heap or not at a block start are counted and ignored in either mode.
//!
//! Every access to heap memory goes through the addresses in the [`HeapHandle`].

use crate::heap_layout::*;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::warp::{lowest_set_bits, nth_set_bit, rank_in, Warp};

/// A view of one formatted slab segment.
#[derive(Clone, Copy, Debug)]
pub struct Slab<'a> {
    h: &'a HeapHandle,
}

/// No block (an index that no heap reaches).
const NONE: u64 = u64::MAX;

impl<'a> Slab<'a> {
    /// Views a slab segment.
    ///
    /// # Safety
    /// `h` must describe a formatted slab (see [`crate::heap_layout`]) whose arrays stay valid,
    /// and are accessed only atomically by others, for `'a`.
    #[inline(always)]
    pub unsafe fn new(h: &'a HeapHandle) -> Self {
        Slab { h }
    }

    /// The handle.
    pub fn handle(&self) -> &'a HeapHandle {
        self.h
    }

    #[inline(always)]
    fn word(&self, i: u32) -> &'a AtomicU64 {
        debug_assert!(i < self.h.nwords);
        // SAFETY: `new`'s contract: `words` holds `nwords` atomics for 'a.
        unsafe { &*(self.h.words as *const AtomicU64).add(i as usize) }
    }

    #[inline(always)]
    fn used(&self, s: u32) -> &'a AtomicU32 {
        debug_assert!(s < self.h.nshards);
        // SAFETY: as for `word`, with `nshards` counts.
        unsafe { &*(self.h.shard_used as *const AtomicU32).add(s as usize) }
    }

    #[inline(always)]
    fn peak(&self, s: u32) -> &'a AtomicU32 {
        // SAFETY: as for `used`.
        unsafe { &*(self.h.shard_peak as *const AtomicU32).add(s as usize) }
    }

    #[inline(always)]
    fn counter(&self, which: usize, slot: u32) -> &'a AtomicU64 {
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
    fn valid_bits(&self, w: u32) -> u64 {
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
    /// the reservations of all callers add up to exactly the capacity.
    #[inline(always)]
    pub fn reserve(&self, s: u32, want: u32) -> u32 {
        let cap = self.shard_capacity(s);
        // Acquire: pairs with the Release decrement in `free`, so a reserved block's bit is seen
        // clear by the claim that follows.
        let old = self.used(s).fetch_add(want, Ordering::Acquire);
        let take = if old >= cap { 0 } else { want.min(cap - old) };
        if take < want {
            self.used(s).fetch_sub(want - take, Ordering::Relaxed);
        }
        if take > 0 {
            self.peak(s).fetch_max(old + take, Ordering::Relaxed);
        }
        take
    }

    /// Gives back `n` reserved blocks of shard `s` that were never claimed.
    #[inline(always)]
    pub fn unreserve(&self, s: u32, n: u32) {
        if n > 0 {
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
    pub fn claim_round(&self, w: u32, cur: u64, from: u32, want: u32) -> (u64, u64) {
        let free = !cur & self.valid_bits(w) & (u64::MAX << from);
        if free == 0 || want == 0 {
            return (0, cur);
        }
        let mask = lowest_set_bits(free, want);
        // Acquire: the previous owner's writes (released by its free) happen before ours.
        let old = self.word(w).fetch_or(mask, Ordering::Acquire);
        (mask & !old, old | mask)
    }

    /// True when shard `s` has a block not counted as used.
    #[inline(always)]
    pub fn has_room(&self, s: u32) -> bool {
        self.used(s).load(Ordering::Relaxed) < self.shard_capacity(s)
    }

    /// Allocates one block for each calling lane of `warp`; null for lanes that could not get one.
    ///
    /// `hint` is a block index where this warp prefers to start (taken from the leader).
    /// Failures are counted when `count_failures` (the last segment of a chain).
    #[inline(always)]
    pub fn alloc<W: Warp>(&self, warp: &W, hint: u64, count_failures: bool) -> *mut u8 {
        let active = warp.active();
        let leader = active.trailing_zeros();
        let is_leader = warp.lane() == leader;
        let rank = rank_in(active, warp.lane());
        let total = active.count_ones();
        let cap = self.h.capacity;
        let hint = warp.shfl64(active, hint, leader) % cap;

        let words_log2 = self.h.shard_words_log2;
        let mut shard = ((hint / 64) >> words_log2) as u32;
        let mut start_word = (hint / 64) as u32;
        let mut from = (hint % 64) as u32;
        let mut served = 0u32;
        let mut mine = NONE;
        // Each round either serves a lane or scans every shard; this bounds a pathological race
        // with frees to a null result instead of a hang.
        let mut rounds = 2 * self.h.nshards + 8;

        while served < total && rounds > 0 {
            rounds -= 1;
            let mut take = 0;
            if is_leader {
                take = self.reserve(shard, total - served);
            }
            let take = warp.shfl(active, take, leader);
            if take > 0 {
                self.claim(
                    warp,
                    active,
                    (shard, start_word, from),
                    take,
                    (rank, served),
                    &mut mine,
                );
                served += take;
                if served == total {
                    break;
                }
            }
            match self.find_shard(warp, active, shard + 1) {
                Some(s) => {
                    shard = s;
                    start_word = s << words_log2;
                    from = 0;
                }
                None => break,
            }
        }
        if count_failures && is_leader && served < total {
            self.counter(COUNTER_FAILED_ALLOCS, warp.slot_hint())
                .fetch_add((total - served) as u64, Ordering::Relaxed);
        }
        if mine == NONE {
            core::ptr::null_mut()
        } else {
            // The block's previous owner released it before its bit was cleared; our writes to
            // it must come after that on the GPU too.
            warp.fence();
            (self.h.data + mine * self.h.block_size) as *mut u8
        }
    }

    /// Claims `take` reserved bits of `shard`, starting at `start_word` bit `from`, and gives
    /// the lane of rank `served + j` the `j`-th of them.
    #[inline(always)]
    fn claim<W: Warp>(
        &self,
        warp: &W,
        active: u32,
        (shard, start_word, from): (u32, u32, u32),
        take: u32,
        (rank, served): (u32, u32),
        mine: &mut u64,
    ) {
        let leader = active.trailing_zeros();
        let is_leader = warp.lane() == leader;
        let first = shard << self.h.shard_words_log2;
        let words = (self.h.nwords - first).min(1 << self.h.shard_words_log2);
        let mut w = start_word;
        let mut from = from;
        // The first word is tried optimistically as empty (one atomic on a fresh heap); later
        // words are read first, since a walk means the shard is filling up.
        let mut cur = 0u64;
        let mut known = true;
        let mut left = take;
        let mut served = served;
        let mut budget = 4 * words + 8;
        while left > 0 {
            let mut got = 0u64;
            if is_leader {
                if !known {
                    cur = self.word(w).load(Ordering::Relaxed);
                    known = true;
                }
                let (g, now) = self.claim_round(w, cur, from, left);
                got = g;
                cur = now;
            }
            let got = warp.shfl64(active, got, leader);
            let word = warp.shfl(active, w, leader);
            let n = got.count_ones();
            if rank >= served && rank < served + n {
                *mine = word as u64 * 64 + nth_set_bit(got, rank - served) as u64;
            }
            served += n;
            left -= n;
            if is_leader && left > 0 && (!cur & self.valid_bits(w) & (u64::MAX << from)) == 0 {
                w = if w + 1 == first + words { first } else { w + 1 };
                from = 0;
                known = false;
            }
            budget -= 1;
            if budget == 0 {
                break;
            }
        }
        if is_leader && left > 0 {
            // Only a broken invariant (a foreign write to the bitmap) gets here: give the
            // reservation back rather than spin.
            self.unreserve(shard, left);
        }
        let _ = served;
    }

    /// A shard after `from` (cyclically) with room, found by the lanes reading one count each.
    #[inline(always)]
    fn find_shard<W: Warp>(&self, warp: &W, active: u32, from: u32) -> Option<u32> {
        let lanes = active.count_ones();
        let rank = rank_in(active, warp.lane());
        let n = self.h.nshards;
        let mut base = 0;
        while base < n {
            let i = base + rank;
            let s = ((from as u64 + i as u64) % n as u64) as u32;
            let room = i < n && self.has_room(s);
            let hits = warp.ballot(active, room);
            if hits != 0 {
                return Some(warp.shfl(active, s, hits.trailing_zeros()));
            }
            base += lanes;
        }
        None
    }

    /// Block index of `ptr`, if it is the start of one of this segment's blocks.
    #[inline(always)]
    pub fn index_of(&self, ptr: *mut u8) -> Option<u64> {
        let off = (ptr as u64).wrapping_sub(self.h.data);
        let idx = if self.h.block_shift != u32::MAX {
            if off & (self.h.block_size - 1) != 0 {
                return None;
            }
            off >> self.h.block_shift
        } else {
            if !off.is_multiple_of(self.h.block_size) {
                return None;
            }
            off / self.h.block_size
        };
        (idx < self.h.capacity).then_some(idx)
    }

    /// Frees `ptr` (a block of this segment, see [`Slab::index_of`]) for each calling lane.
    #[inline(always)]
    pub fn free_index<W: Warp>(&self, warp: &W, idx: u64) {
        // Each lane's writes to its block are performed before the group's `fetch_and` below,
        // which the warp issues after this fence in program order.
        warp.fence();
        let active = warp.active();
        let word = (idx / 64) as u32;
        let bit = 1u64 << (idx % 64);
        let group = warp.match_any(active, word as u64);
        let bits = warp.or_reduce(group, bit);
        if warp.lane() != group.trailing_zeros() {
            return;
        }
        let shard = word >> self.h.shard_words_log2;
        let lanes = group.count_ones();
        let mut freed = bits;
        if self.h.flags & FLAG_CHECKED_FREES != 0 {
            // Release: our writes to the blocks happen before their next owner's.
            let old = self.word(word).fetch_and(!bits, Ordering::Release);
            freed = bits & old;
            let doubles = lanes - freed.count_ones();
            if doubles > 0 {
                self.counter(COUNTER_DOUBLE_FREES, warp.slot_hint())
                    .fetch_add(doubles as u64, Ordering::Relaxed);
            }
        } else {
            self.word(word).fetch_and(!bits, Ordering::Release);
        }
        // After the bits are clear, so a reservation never outnumbers the clear bits.
        self.unreserve(shard, freed.count_ones());
    }

    /// Counts a pointer that belongs to no segment.
    #[inline(always)]
    pub fn count_foreign(&self, slot: u32) {
        self.counter(COUNTER_FOREIGN_FREES, slot)
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// Allocates from the chain of slab segments starting at `h`.
///
/// # Safety
/// `h` and every `next` handle must satisfy [`Slab::new`] for the duration of the call.
#[inline(always)]
pub unsafe fn chain_alloc<W: Warp>(h: &HeapHandle, warp: &W, hint: u64) -> *mut u8 {
    let mut h = h;
    loop {
        let last = h.next == 0;
        // SAFETY: the caller vouches for every segment of the chain.
        let p = unsafe { Slab::new(h) }.alloc(warp, hint, last);
        if !p.is_null() || last {
            return p;
        }
        // SAFETY: as above; `next` is a handle of the chain.
        h = unsafe { &*(h.next as *const HeapHandle) };
    }
}

/// Frees `ptr` into whichever segment of the chain at `h` holds it; counts it as foreign if none.
///
/// # Safety
/// As for [`chain_alloc`]; `ptr` must not be used after this call if it is a block of the heap.
#[inline(always)]
pub unsafe fn chain_free<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8) {
    let first = h;
    let mut h = h;
    loop {
        // SAFETY: the caller vouches for every segment of the chain.
        let slab = unsafe { Slab::new(h) };
        if let Some(idx) = slab.index_of(ptr) {
            slab.free_index(warp, idx);
            return;
        }
        if h.next == 0 {
            // SAFETY: as above.
            unsafe { Slab::new(first) }.count_foreign(warp.slot_hint());
            return;
        }
        // SAFETY: as above.
        h = unsafe { &*(h.next as *const HeapHandle) };
    }
}
