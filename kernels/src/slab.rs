//! The slab heap: fixed-size blocks tracked by a bitmap (bit set = in use), counted per shard.
//!
//! **Allocation** is warp-cooperative; on its fast path the warp's leader makes two or three
//! atomics for all its lanes:
//! 1. it reserves `k` blocks of the shard holding the warp's hint with one `fetch_add` on the
//!    shard's used count ([`Slab::reserve`]): once that succeeds, `k` clear bits are guaranteed
//!    to exist in the shard, because frees clear a bit *before* they decrement the count;
//! 2. it sets bits `hint .. hint + k` with one Acquire `fetch_or` per word they touch (one or
//!    two, in flight together: [`Slab::claim_run`]) and shuffles to the lanes which ones it won;
//!    lane `r` gets block `hint + r`.
//!
//! Warps start at a hint ([`warp_hint`] on the GPU: neighbour warps land far apart, on
//! different shard counts and words, in disjoint word-aligned runs of 32 when the grid fits),
//! so on a fresh heap step 2 always wins. Lanes that lose
//! (a bit already set, or a short reservation) take the slow path (`Slab::alloc_slow`): the
//! leader claims the rest of the reservation word by word with one `fetch_or` per word, then
//! scans the shard counts, one per lane, for other shards; a warp that finds none returns null
//! (counted in the statistics). Without concurrent frees, a heap of `K` blocks serves exactly
//! `K` requests.
//!
//! **Free**: lanes freeing blocks of one word clear their bits with one Release `fetch_and` when
//! the bits form a run (the usual case: blocks freed in the order they were handed out), else
//! one per lane; then the group's first lane decrements the shard's count by the bits that were
//! in fact set. A bit that was already clear is a double free: left out of the count in every
//! mode, so the heap stays consistent, and counted in checked mode ([`FLAG_CHECKED_FREES`]).
//! Pointers outside the heap or not at a block start are counted and ignored in either mode.
//!
//! No device-wide fence is on either path: the handover of a block is ordered by the Acquire and
//! Release of the bitmap atomics themselves; the counts are Relaxed hints plus the reservation
//! invariant above.
//!
//! Every access to heap memory goes through the addresses in the [`HeapHandle`].

use crate::chain::{self, SegmentAlloc};
use crate::exact_div::exact_quotient;
use crate::heap_layout::*;
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::warp::{lowest_set_bits, nth_set_bit, rank_in, Warp};

/// A view of one formatted slab segment.
#[derive(Clone, Copy, Debug)]
pub struct Slab<'a> {
    /// The fields the fast paths read (on the GPU, a copy in registers).
    h: &'a HeapHandle,
    /// The handle in the region, which the out-of-line slow paths read, so that calling them
    /// does not make the register copy spill to memory.
    home: &'a HeapHandle,
}

/// No block (an index that no heap reaches).
const NONE: u64 = u64::MAX;

/// Where a warp's fast-path allocation left off ([`Slab::lead`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lead {
    /// The shard of `hint`.
    pub shard: u32,
    /// The first block of the run, `< capacity`.
    pub hint: u64,
    /// Blocks reserved in `shard` (the leader's; other lanes may hold anything).
    pub take: u32,
    /// Bit `r`: block `hint + r` is the rank-`r` lane's.
    pub won: u32,
    /// Bits of the hint's word claimed after the run ([`Slab::lead_retrying`]): the `j`-th set
    /// bit is the block of the `j`-th lane (by rank) that `won` left out.
    pub extra: u64,
}

impl Lead {
    /// The block index of the lane of rank `rank`, if the fast step served it.
    #[inline(always)]
    pub(crate) fn block(&self, rank: u32) -> Option<u64> {
        if self.won >> rank & 1 != 0 {
            return Some(self.hint + rank as u64);
        }
        let j = rank - (self.won & ((1u64 << rank) - 1) as u32).count_ones();
        (j < self.extra.count_ones()).then(|| (self.hint & !63) + nth_set_bit(self.extra, j) as u64)
    }
}

impl<'a> Slab<'a> {
    /// Views a slab segment.
    ///
    /// # Safety
    /// `h` must describe a formatted slab (see [`crate::heap_layout`]) whose arrays stay valid,
    /// and are accessed only atomically by others, for `'a`.
    #[inline(always)]
    pub unsafe fn new(h: &'a HeapHandle) -> Self {
        Slab { h, home: h }
    }

    /// Views a slab segment through `copy`, a copy of the handle at `home` (equal to it).
    ///
    /// # Safety
    /// As for [`Slab::new`], for `home`.
    #[inline(always)]
    pub unsafe fn with_copy(copy: &'a HeapHandle, home: &'a HeapHandle) -> Self {
        debug_assert!(copy == home);
        Slab { h: copy, home }
    }

    /// The same segment through its handle in the region (for the out-of-line paths).
    #[inline(always)]
    fn at_home(&self) -> Self {
        Slab {
            h: self.home,
            home: self.home,
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
        self.reserve_in(s, self.shard_capacity(s), want)
    }

    /// [`Slab::reserve`] for shard `s` of `cap` blocks.
    #[inline(always)]
    fn reserve_in(&self, s: u32, cap: u32, want: u32) -> u32 {
        self.reserve_seen(s, cap, want).0
    }

    /// [`Slab::reserve_in`], with the shard's count before this call's `fetch_add`; a reservation
    /// of `take > 0` blocks ends at or below the shard's capacity from there: `old + take <= cap`.
    #[inline(always)]
    fn reserve_seen(&self, s: u32, cap: u32, want: u32) -> (u32, u32) {
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

    /// True when shard `s` has a block not counted as used.
    #[inline(always)]
    pub fn has_room(&self, s: u32) -> bool {
        self.used(s).load(Ordering::Relaxed) < self.shard_capacity(s)
    }

    /// Block `i`'s address (a multiply whatever the size: cheaper than testing for a shift).
    #[inline(always)]
    pub(crate) fn block(&self, i: u64) -> *mut u8 {
        (self.h.data + i * self.h.block_size) as *mut u8
    }

    /// Allocates one block for each calling lane of `warp`; null for lanes that could not get one.
    ///
    /// `hint` is a block index where this warp prefers to start; every calling lane passes the
    /// same one (see [`warp_hint`]).
    /// Failures are counted when `count_failures` (the last segment of a chain).
    #[inline(always)]
    pub fn alloc<W: Warp>(&self, warp: &W, hint: u64, count_failures: bool) -> *mut u8 {
        self.alloc_counting(warp, hint, Some(count_failures))
    }

    /// [`Slab::alloc`] that counts failures when this is the last segment of its chain (read
    /// only when a lane goes without a block, so the fast path never loads `next`).
    #[inline(always)]
    pub fn alloc_in_chain<W: Warp>(&self, warp: &W, hint: u64) -> *mut u8 {
        self.alloc_counting(warp, hint, None)
    }

    /// The fast path is straight-line: the leader reserves and claims the run `hint ..
    /// hint + lanes` (one `fetch_add`, one or two `fetch_or`), one shuffle tells the lanes what it
    /// won, and the lane of rank `r` takes block `hint + r`. Anything else goes out of line.
    #[inline(always)]
    fn alloc_counting<W: Warp>(&self, warp: &W, hint: u64, count: Option<bool>) -> *mut u8 {
        let active = warp.active();
        let leader = active.trailing_zeros();
        let total = active.count_ones();
        let cap = self.h.capacity;
        let hint = if hint < cap {
            hint
        } else {
            wrap_hint(hint, cap)
        };
        let shard = self.shard_of(hint);
        let mut take = 0;
        let mut won = 0;
        if warp.lane() == leader {
            (take, won) = self.lead(warp, hint, total);
        }
        // Bit `r` of `won`: block `hint + r` is the rank-`r` lane's.
        let won = warp.shfl(active, won, leader);
        let rank = rank_in(active, warp.lane());
        if won.count_ones() == total {
            return self.block(hint + rank as u64);
        }
        let lead = Lead {
            shard,
            hint,
            take,
            won,
            extra: 0,
        };
        self.finish(warp, lead, count)
    }

    /// The shard that holds block `hint`.
    #[inline(always)]
    pub(crate) fn shard_of(&self, hint: u64) -> u32 {
        ((hint >> 6) >> self.h.shard_words_log2) as u32
    }

    /// The leader's half of the fast path, for `total` lanes from block `hint` (`< capacity`):
    /// reserves in the hint's shard with one `fetch_add`, then claims the run from `hint` (one
    /// or two `fetch_or`). Returns the reservation and the run's bits won (bit `r` for block
    /// `hint + r`). It names no other lane, so the leaders of several groups of one warp can
    /// run it at once (`carve_malloc` with mixed classes).
    #[inline(always)]
    pub(crate) fn lead<W: Warp>(&self, warp: &W, hint: u64, total: u32) -> (u32, u32) {
        let (take, run) = self.reserve_run(hint, total);
        (take, self.claim_run(warp, hint, run))
    }

    /// Reserves up to `total` blocks in the shard of `hint`; returns the reservation and the
    /// length of the run from `hint` to claim (the shard may end first).
    #[inline(always)]
    fn reserve_run(&self, hint: u64, total: u32) -> (u32, u32) {
        // The shard's blocks, and the hint's place among them, without 64-bit multiplies.
        let per = 64u64 << self.h.shard_words_log2;
        let at = hint & (per - 1);
        let blocks = (self.h.capacity - (hint - at)).min(per);
        let take = self.reserve_in(self.shard_of(hint), blocks as u32, total);
        (take, (blocks - at).min(take as u64) as u32)
    }

    /// Every calling lane's block after a [`Slab::lead`] that did not serve them all (`lead`:
    /// as it left things, the same in every lane; `take` matters in the leader only): the
    /// rest goes out of line ([`Slab::alloc_slow`]). Null for lanes left without a block.
    #[inline(always)]
    pub(crate) fn finish<W: Warp>(&self, warp: &W, lead: Lead, count: Option<bool>) -> *mut u8 {
        let mine = self.at_home().alloc_slow(warp, lead, count);
        if mine == NONE {
            core::ptr::null_mut()
        } else {
            self.block(mine)
        }
    }

    /// Sets bits `hint .. hint + n` (`n <= 32`, inside one shard) with one Acquire `fetch_or` per
    /// word they touch (at most two, in flight together); returns which of them this call
    /// turned from clear to set, bit `r` for block `hint + r`.
    #[inline(always)]
    pub fn claim_run<W: Warp>(&self, warp: &W, hint: u64, n: u32) -> u32 {
        self.claim_run_seen(warp, hint, n).0
    }

    /// [`Slab::claim_run`], with the hint's word as the first `fetch_or` left it (0 when `n` is
    /// 0): what a retry in that word starts from.
    #[inline(always)]
    fn claim_run_seen<W: Warp>(&self, warp: &W, hint: u64, n: u32) -> (u32, u64) {
        if n == 0 {
            return (0, 0);
        }
        let w = (hint >> 6) as u32;
        let o = (hint & 63) as u32;
        let run = (1u64 << n) - 1;
        let lo = run << o;
        // Acquire: the previous owners' accesses (released by their frees) happen before the
        // lanes' that get these blocks through the shuffle that follows in warp order.
        let old_lo = warp.fetch_or_acquire(self.word(w), lo);
        let mut won = ((lo & !old_lo) >> o) as u32;
        if o + n > 64 {
            let hi = run >> (64 - o);
            let old_hi = warp.fetch_or_acquire(self.word(w + 1), hi);
            won |= ((hi & !old_hi) << (64 - o)) as u32;
        }
        (won, old_lo | lo)
    }

    /// [`Slab::lead`] for a group that shares its warp with others (`carve_malloc` with mixed
    /// classes), where runs collide far more often. Two changes:
    /// - The run starts where the count of the hint's shard stood, not at `hint`. While a shard
    ///   fills (after a bulk free, or from new), groups then take consecutive runs and collide
    ///   only over blocks freed out of order; from hashed starts, a group's run meets earlier
    ///   groups' runs more often as the shard fills (bench/mixed_fast_step_model.py).
    /// - When the run leaves reserved blocks unclaimed, the leader claims them at once among the
    ///   clear bits of the run's first word, with one more `fetch_or` and no collective.
    ///
    /// Returns the run's first block (`hint` when nothing was reserved), the reservation, the
    /// run's bits won, and the bits of the run's first word won by the retry (for the lanes the
    /// run did not serve, in rank order: see [`Lead::block`]).
    #[inline(always)]
    pub(crate) fn lead_retrying<W: Warp>(
        &self,
        warp: &W,
        hint: u64,
        total: u32,
    ) -> (u64, u32, u32, u64) {
        let s = self.shard_of(hint);
        let (take, old) = self.reserve_seen(s, self.shard_capacity(s), total);
        if take == 0 {
            return (hint, 0, 0, 0);
        }
        // `old + take` is within the shard: the run needs no clipping.
        let hint = ((s as u64) << (6 + self.h.shard_words_log2)) + old as u64;
        let (won, seen) = self.claim_run_seen(warp, hint, take);
        let missing = take - won.count_ones();
        if missing == 0 {
            return (hint, take, won, 0);
        }
        // Bits of this word only: it lies in the reserved shard.
        let (extra, _) = self.claim_round(warp, (hint >> 6) as u32, seen, 0, missing);
        (hint, take, won, extra)
    }

    /// The fast path's claim left lanes without a block (`won`: bit `r` for the rank-`r` lane's
    /// block `hint + r`; `take`, the leader's reservation in `shard`): the leader claims the rest
    /// of the reservation from `hint` on, then reserves and claims in other shards until every
    /// lane is served or no shard has room. Returns this lane's block index, or [`NONE`].
    #[cold]
    #[inline(never)]
    fn alloc_slow<W: Warp>(&self, warp: &W, lead: Lead, count: Option<bool>) -> u64 {
        let count_failures = count.unwrap_or(self.h.next == 0);
        let active = warp.active();
        let lane = warp.lane();
        let leader = active.trailing_zeros();
        let take = warp.shfl(active, lead.take, leader);
        let mut mine = lead.block(rank_in(active, lane)).unwrap_or(NONE);
        let mine = &mut mine;
        let Lead { shard, hint, .. } = lead;
        let got = warp.ballot(active, *mine != NONE);
        let pending = active & !got;
        let need = pending.count_ones();
        // Rank among the lanes still waiting; the others never match a handed-out rank.
        let rank = if pending & (1 << lane) != 0 {
            rank_in(pending, lane)
        } else {
            u32::MAX
        };
        let log2 = self.h.shard_words_log2;
        let left = take - got.count_ones();
        let mut served = 0;
        if left > 0 {
            let from = (hint >> 6) as u32;
            served = self.claim(
                warp,
                active,
                (shard, from, (hint & 63) as u32),
                left,
                (rank, 0),
                mine,
            );
        }
        let mut shard = shard;
        // Each round serves a lane or scans every shard: a pathological race with frees ends in
        // a null result, not a hang.
        let mut rounds = 2 * self.h.nshards + 8;
        while served < need && rounds > 0 {
            rounds -= 1;
            match self.find_shard(warp, active, shard + 1) {
                Some(s) => shard = s,
                None => break,
            }
            let mut t = 0;
            if lane == leader {
                t = self.reserve(shard, need - served);
            }
            let t = warp.shfl(active, t, leader);
            if t > 0 {
                served += self.claim(
                    warp,
                    active,
                    (shard, shard << log2, 0),
                    t,
                    (rank, served),
                    mine,
                );
            }
        }
        let failed = warp.ballot(active, *mine == NONE).count_ones();
        if count_failures && lane == leader && failed > 0 {
            self.counter(COUNTER_FAILED_ALLOCS, warp.slot_hint())
                .fetch_add(failed as u64, Ordering::Relaxed);
        }
        *mine
    }

    /// Claims `take` reserved bits of `shard`, starting at `start_word` bit `from`, and gives
    /// the lane of rank `served + j` the `j`-th of them. Returns how many it claimed (`take`
    /// unless frees kept racing it; the rest of the reservation is then given back).
    #[inline(always)]
    fn claim<W: Warp>(
        &self,
        warp: &W,
        active: u32,
        (shard, start_word, from): (u32, u32, u32),
        take: u32,
        (rank, served): (u32, u32),
        mine: &mut u64,
    ) -> u32 {
        let leader = active.trailing_zeros();
        let is_leader = warp.lane() == leader;
        let first = shard << self.h.shard_words_log2;
        let words = (self.h.nwords - first).min(1 << self.h.shard_words_log2);
        let mut w = start_word;
        let mut from = from;
        let mut cur = 0u64;
        let mut known = false;
        let mut left = take;
        let mut served = served;
        // Without frees, a round that claims nothing shows bits of the word newly set by other
        // claimers (each bit once per visit of its word), or finds the word full and moves on
        // (each word once, the first twice): a pile-up of warps on one shard loses many rounds,
        // yet every one of them is covered here.
        let mut budget = 65 * (words + 1) + 32;
        while left > 0 {
            let mut got = 0u64;
            if is_leader {
                if !known {
                    cur = self.word(w).load(Ordering::Relaxed);
                    known = true;
                }
                let (g, now) = self.claim_round(warp, w, cur, from, left);
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
            // Only frees racing the claim round after round, or a foreign write to the bitmap,
            // get here: give the reservation back rather than spin.
            self.unreserve(shard, left);
        }
        take - left
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
            let s = from.min(n) + i;
            let s = if s >= n { s - n } else { s };
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
            exact_quotient(off, self.h.block_size)?
        };
        (idx < self.h.capacity).then_some(idx)
    }

    /// The fast path of a warp's free: when the calling lanes' pointers are blocks `base ..
    /// base + lanes` of this segment in rank order, inside one bitmap word (a warp freeing what
    /// one [`Slab::alloc`] gave it), the leader clears them with one `fetch_and` and moves the
    /// shard count by the bits that were set. Returns `false` (the same for every lane), having
    /// done nothing, otherwise.
    #[inline(always)]
    pub fn free_run<W: Warp>(&self, warp: &W, ptr: *mut u8) -> bool {
        let active = warp.active();
        let lane = warp.lane();
        let leader = active.trailing_zeros();
        let lanes = active.count_ones();
        let idx = self.index_of(ptr).unwrap_or(NONE);
        let base = idx.wrapping_sub(rank_in(active, lane) as u64);
        // One 32-bit shuffle: bases at or past 2^32 blocks simply take the group path.
        let lead = warp.shfl(active, base as u32, leader);
        let ok = idx != NONE && base == lead as u64 && (base & 63) + lanes as u64 <= 64;
        if warp.ballot(active, ok) != active {
            return false;
        }
        if lane == leader {
            let run = (u64::MAX >> (64 - lanes)) << (base & 63);
            let word = (base >> 6) as u32;
            // Release: the lanes' accesses to their blocks (this warp's, issued before this
            // instruction, which the ballot above waited for) happen before the next owners'.
            let old = warp.fetch_and_release(self.word(word), !run);
            let freed = (old & run).count_ones();
            self.settle_free(warp, word, lanes, freed);
        }
        true
    }

    /// Clears the run of `lanes` blocks from `base` (`lanes <= 32`, inside the segment; it may
    /// cross into the next word) with one Release `fetch_and` per word, both in flight together,
    /// then moves each word's shard count by the bits that were set. One lane calls it for a
    /// group whose pointers are that run in rank order, after a collective that waited for the
    /// group's accesses to its blocks; it names no other lane, so the leaders of several groups
    /// of one warp can run it at once (`carve_free` with mixed classes).
    #[inline(always)]
    pub(crate) fn free_run_at<W: Warp>(&self, warp: &W, base: u64, lanes: u32) {
        debug_assert!(lanes > 0 && lanes <= 32 && base + lanes as u64 <= self.h.capacity);
        let w = (base >> 6) as u32;
        let o = (base & 63) as u32;
        let run = (1u64 << lanes) - 1;
        let lo = run << o;
        // Release: as in `free_run`.
        let old_lo = warp.fetch_and_release(self.word(w), !lo);
        if o + lanes > 64 {
            let hi = run >> (64 - o);
            let old_hi = warp.fetch_and_release(self.word(w + 1), !hi);
            self.settle_free(warp, w + 1, hi.count_ones(), (old_hi & hi).count_ones());
        }
        self.settle_free(warp, w, lo.count_ones(), (old_lo & lo).count_ones());
    }

    /// Moves the count of `word`'s shard after a free of `lanes` blocks of which `freed` were in
    /// use; counts the rest as double frees on a checked heap.
    #[inline(always)]
    fn settle_free<W: Warp>(&self, warp: &W, word: u32, lanes: u32, freed: u32) {
        if freed < lanes {
            self.at_home()
                .count_double_frees(warp.slot_hint(), lanes - freed);
        }
        self.unreserve(word >> self.h.shard_words_log2, freed);
    }

    /// Counts `n` double frees on a checked heap.
    #[cold]
    #[inline(never)]
    fn count_double_frees(&self, slot: u32, n: u32) {
        if self.h.flags & FLAG_CHECKED_FREES != 0 {
            self.counter(COUNTER_DOUBLE_FREES, slot)
                .fetch_add(n as u64, Ordering::Relaxed);
        }
    }

    /// Frees `ptr` (a block of this segment, see [`Slab::index_of`]) for each calling lane.
    ///
    /// Lanes freeing blocks of one word form a group. When their bits form a run in rank order
    /// (blocks freed in the order they were handed out, the common case), the group's first lane
    /// clears them all with one `fetch_and`; otherwise each lane clears its own bit.
    #[inline(always)]
    pub fn free_index<W: Warp>(&self, warp: &W, idx: u64) {
        self.free_index_among(warp, idx, warp.active())
    }

    /// [`free_index`](Self::free_index) among the lanes of `active` only: the lanes (this one
    /// included) that free into this segment in this call.
    #[inline(always)]
    pub fn free_index_among<W: Warp>(&self, warp: &W, idx: u64, active: u32) {
        let lane = warp.lane();
        let word = (idx >> 6) as u32;
        let b = (idx & 63) as u32;
        let first = warp.shfl(active, word, active.trailing_zeros());
        let group = if warp.ballot(active, word == first) == active {
            active
        } else {
            warp.match_any(active, word as u64)
        };
        let head = group.trailing_zeros();
        let b0 = warp.shfl(active, b, head);
        let in_run = warp.ballot(active, b == b0 + rank_in(group, lane));
        let lanes = group.count_ones();
        let mut freed = 0;
        let mut mine_was_set = false;
        if in_run & group == group {
            if lane == head {
                let run = ((1u64 << lanes) - 1) << b0;
                // Release: the lanes' accesses to their blocks (this warp's, issued before this
                // instruction) happen before the next owners'.
                let old = warp.fetch_and_release(self.word(word), !run);
                freed = (old & run).count_ones();
            }
        } else {
            let bit = 1u64 << b;
            let old = warp.fetch_and_release(self.word(word), !bit);
            mine_was_set = old & bit != 0;
        }
        // Waits for every lane's result: the count below moves only after the bits it stands
        // for are clear (a reservation never outnumbers the clear bits).
        let cleared = warp.ballot(active, mine_was_set);
        if lane != head {
            return;
        }
        if in_run & group != group {
            freed = (cleared & group).count_ones();
        }
        self.settle_free(warp, word, lanes, freed);
    }

    /// Counts a pointer that belongs to no segment.
    #[inline(always)]
    pub fn count_foreign(&self, slot: u32) {
        self.counter(COUNTER_FOREIGN_FREES, slot)
            .fetch_add(1, Ordering::Relaxed);
    }
}

/// A block index in `0..cap` from a hint at or past it (a later segment of a chain, a caller's
/// own hint): out of line, so that the fast path carries no 64-bit division.
#[cold]
#[inline(never)]
fn wrap_hint(hint: u64, cap: u64) -> u64 {
    hint % cap
}

/// The hint for warp `warp` of a grid: the warp index with its bits reversed, read as a fraction
/// of the capacity, rounded down to a multiple of 32.
///
/// Warps that run at the same time (neighbours in the grid) land far apart, on different shard
/// counts and bitmap words; the first `2^k` warps of a grid are spaced `cap / 2^k` blocks apart,
/// so when that is at least 32 (the grid's threads, rounded up to a power of two, fit the heap)
/// their runs never overlap, and a run of 32 never straddles two bitmap words. No division: one
/// bit reversal and one multiply.
#[inline(always)]
pub fn warp_hint(warp: u32, cap: u64) -> u64 {
    spread(warp, cap) & !31
}

/// The hint for a group of `lanes < 32` lanes of warp `warp` that ask one class while the rest
/// of the warp asks others (`carve_malloc` with mixed sizes): [`warp_hint`] without the rounding.
///
/// A class then gets a share of each warp's requests, and its capacity is sized to that share,
/// so it holds fewer than 32 blocks per warp of the grid: rounded to runs of 32, several warps
/// would start at the same block and all but the first lose their claim to the slow path
/// (in the 4 KiB class of `carve bench device-alloc`'s 2^22 mixed row, some 6 warps per run of
/// 32). Unrounded, warps are `cap / warps` blocks apart, about the blocks each takes; a run may
/// cross a word, which the claim handles with a second `fetch_or`.
///
/// In `carve_malloc`'s one step for mixed classes, the hint only picks the shard: the group's
/// run starts where that shard's count stands (`Slab::lead_retrying`).
#[inline(always)]
pub fn group_hint(warp: u32, cap: u64) -> u64 {
    spread(warp, cap)
}

/// `warp` with its bits reversed, read as a fraction of `cap`.
#[inline(always)]
fn spread(warp: u32, cap: u64) -> u64 {
    ((warp.reverse_bits() as u128 * cap as u128) >> 32) as u64
}

/// Allocates from the chain of slab segments starting at `h`, segment by segment, a block for
/// each calling lane; `hint` is a block index of the first segment, as for [`Slab::alloc`], and
/// moves to the same place in proportion in each later one.
///
/// # Safety
/// `h` and every `next` handle must satisfy [`Slab::new`] for the duration of the call.
#[inline(always)]
pub unsafe fn chain_alloc<W: Warp>(h: &HeapHandle, warp: &W, hint: u64) -> *mut u8 {
    let each = SlabSegments {
        hint,
        first_capacity: h.capacity,
        at: hint,
    };
    // SAFETY: forwarded contract; `SlabSegments` views each segment with `Slab::new`.
    unsafe { chain::alloc(h, warp, each) }
}

/// [`chain_alloc`] for the lanes that the chain's first segment, `h`, left without a block: the
/// segments after it, with `hint` (a block index of `h`) moved in proportion. Null when `h` ends
/// the chain.
///
/// # Safety
/// As for [`chain_alloc`].
#[inline(always)]
pub(crate) unsafe fn chain_alloc_after<W: Warp>(h: &HeapHandle, warp: &W, hint: u64) -> *mut u8 {
    if h.next == 0 {
        return core::ptr::null_mut();
    }
    // SAFETY: the caller vouches for every segment of the chain.
    let next = unsafe { &*(h.next as *const HeapHandle) };
    let each = SlabSegments {
        hint,
        first_capacity: h.capacity,
        at: rescale_hint(hint, h.capacity, next.capacity),
    };
    // SAFETY: forwarded contract; `SlabSegments` views each segment with `Slab::new`.
    unsafe { chain::alloc(next, warp, each) }
}

/// [`chain_alloc`]'s allocation from one segment: from `at`, the hint moved to that segment.
struct SlabSegments {
    /// The caller's hint, a block index of the first segment.
    hint: u64,
    /// The first segment's blocks.
    first_capacity: u64,
    /// Where the current segment's allocation starts.
    at: u64,
}

impl SegmentAlloc for SlabSegments {
    #[inline(always)]
    unsafe fn alloc<V: Warp>(&mut self, seg: &HeapHandle, warp: &V, last: bool) -> *mut u8 {
        // SAFETY: the trait's contract, for a slab segment.
        unsafe { Slab::new(seg) }.alloc(warp, self.at, last)
    }

    /// The same place in proportion: a hint spread over the first segment would crowd every
    /// warp into the start of a larger one.
    #[inline(always)]
    fn entering(&mut self, seg: &HeapHandle) {
        self.at = rescale_hint(self.hint, self.first_capacity, seg.capacity);
    }
}

/// `hint`, a block index among `from` blocks, moved to the same fraction of `to` blocks: to a
/// multiple of 32 when it was one (as [`warp_hint`] gives), else as it falls ([`group_hint`]).
#[cold]
#[inline(never)]
fn rescale_hint(hint: u64, from: u64, to: u64) -> u64 {
    if from == 0 {
        return 0;
    }
    let at = (hint.min(from) as u128 * to as u128 / from as u128) as u64;
    if hint & 31 == 0 {
        at & !31
    } else {
        at
    }
}

/// Frees `ptr` into whichever segment of the chain at `h` holds it; counts it as foreign if none.
///
/// # Safety
/// As for [`chain_alloc`]; `ptr` must not be used after this call if it is a block of the heap.
#[inline(always)]
pub unsafe fn chain_free<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8) {
    // SAFETY: the caller vouches for the chain.
    if unsafe { Slab::new(h) }.free_run(warp, ptr) {
        return;
    }
    // SAFETY: as above.
    unsafe { chain_free_each(h, warp, ptr) }
}

/// [`chain_free`] lane by lane: each lane finds its segment, then the lanes of a segment free
/// together in groups of one bitmap word.
///
/// # Safety
/// As for [`chain_free`].
#[inline(always)]
pub unsafe fn chain_free_each<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8) {
    // Each lane finds its segment (or none) with no collective...
    let mut seg = h;
    let found = loop {
        // SAFETY: the caller vouches for every segment of the chain.
        let slab = unsafe { Slab::new(seg) };
        if let Some(idx) = slab.index_of(ptr) {
            break Some((slab, idx));
        }
        if seg.next == 0 {
            break None;
        }
        // SAFETY: as above.
        seg = unsafe { &*(seg.next as *const HeapHandle) };
    };
    // ...then every calling lane, pointers of no segment included, groups by segment before
    // any leaves: a fixed set of lanes (`Among`) names all of them in its collectives. Group by
    // segment, not only by word: lanes that found different segments may be converged here,
    // and a group's head clears a run of its own segment's word.
    let active = warp.active();
    let key = found.map_or(0, |_| seg as *const HeapHandle as u64);
    let same = if warp.match_all(active, key) {
        active
    } else {
        warp.match_any(active, key)
    };
    match found {
        Some((slab, idx)) => slab.free_index_among(warp, idx, same),
        // SAFETY: as above.
        None => unsafe { Slab::new(h) }.count_foreign(warp.slot_hint()),
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::warp_hint;

    /// The first 2^k warps of a grid get disjoint, word-aligned runs of 32 inside the heap
    /// whenever the heap holds 32 blocks per warp of the grid rounded up to a power of two.
    #[test]
    fn warp_hints_of_a_grid_are_disjoint_runs() {
        for (warps, cap) in [
            (1u32, 32u64),
            (8, 256),
            (1 << 12, 3 << 16),
            (1 << 14, 600_000),
        ] {
            let mut hints: std::vec::Vec<u64> = (0..warps).map(|w| warp_hint(w, cap)).collect();
            assert!(
                hints.iter().all(|&h| h % 32 == 0 && h + 32 <= cap),
                "{warps} {cap}"
            );
            hints.sort_unstable();
            assert!(
                hints.windows(2).all(|p| p[1] >= p[0] + 32),
                "{warps} warps, cap {cap}"
            );
        }
    }

    /// Unrounded, the first 2^k warps of a grid start `cap / 2^k` blocks apart (give or take
    /// one), however few blocks that is.
    #[test]
    fn group_hints_of_a_grid_spread_evenly() {
        for (warps, cap) in [(1u32 << 17, 655_360u64), (1 << 10, 3000), (1 << 12, 4096)] {
            let mut hints: std::vec::Vec<u64> =
                (0..warps).map(|w| super::group_hint(w, cap)).collect();
            hints.sort_unstable();
            let gap = cap / warps as u64;
            assert!(hints.iter().all(|&h| h < cap));
            assert!(
                hints.windows(2).all(|p| p[1] - p[0] >= gap.max(1) - 1),
                "{warps} warps, cap {cap}"
            );
            hints.dedup();
            assert!(hints.len() as u64 >= (warps as u64).min(cap) - 1);
        }
    }

    /// Any warp index, any capacity: a block index of the heap.
    #[test]
    fn warp_hints_stay_inside_the_heap() {
        for cap in [1u64, 31, 33, 1000, 1 << 40] {
            for w in [0u32, 1, 2, 3, 1000, 123_457, u32::MAX] {
                assert!(warp_hint(w, cap) < cap, "warp {w}, cap {cap}");
            }
        }
    }
}
