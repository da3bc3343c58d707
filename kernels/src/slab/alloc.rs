//! A warp's allocation from one slab segment: the straight-line fast path, with the leader's
//! reservation and claim of a run; what it leaves goes to [`Slab::alloc_slow`].

use super::{wrap_hint, Lead, Slab, NONE};
use crate::warp::{rank_in, Warp};

impl<'a> Slab<'a> {
    /// Allocates one block for each calling lane of `warp`; null for lanes that could not get one.
    ///
    /// `hint` is a block index where this warp prefers to start; every calling lane passes the
    /// same one (see [`warp_hint`](super::warp_hint)).
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
            mask: self.shard_mask(),
            at_cursor: false,
        };
        self.finish(warp, lead, count)
    }

    /// The shard that holds block `hint`.
    #[inline(always)]
    pub(crate) fn shard_of(&self, hint: u64) -> u32 {
        ((hint >> 6) >> self.h.shard_words_log2) as u32
    }

    /// The blocks of a whole shard less one (shards hold a power of two blocks).
    #[inline(always)]
    pub(crate) fn shard_mask(&self) -> u64 {
        (64u64 << self.h.shard_words_log2) - 1
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
        self.claim_run_into(warp, hint, n, (hint >> 6) as u32 + 1)
    }

    /// [`Slab::claim_run_seen`] for a run whose bits past the hint's word lie in word `next`
    /// (the word after it, or its shard's first for a run that goes round its shard).
    #[inline(always)]
    fn claim_run_into<W: Warp>(&self, warp: &W, hint: u64, n: u32, next: u32) -> (u32, u64) {
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
            let old_hi = warp.fetch_or_acquire(self.word(next), hi);
            won |= ((hi & !old_hi) << (64 - o)) as u32;
        }
        (won, old_lo | lo)
    }

    /// [`Slab::lead`] for a group that shares its warp with others (`carve_malloc` with mixed
    /// classes), where runs collide far more often. Two changes:
    /// - The run starts where the count of the hint's shard stood, not at `hint`. While a shard
    ///   fills (after a bulk free, or from new), groups then take consecutive runs and collide
    ///   only over blocks freed out of order; from hashed starts, a group's run meets earlier
    ///   groups' runs more often as the shard fills (lab/bench/mixed_fast_step_model.py).
    /// - When the run leaves reserved blocks unclaimed, the leader claims them at once among the
    ///   clear bits of the run's first word, with one more `fetch_or` and no collective.
    ///
    /// A run that would pass the end of its shard is taken where the cursor stands after it:
    /// split over the shard's end and start, its blocks would not be the run that `carve_free`'s
    /// leaders clear in one step, and its free would go out of line (in `carve bench
    /// device-alloc`'s 2^22 mixed row, about one warp in ten).
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
        let cap = self.shard_capacity(s);
        let (mut take, mut old) = self.reserve_seen(s, cap, total);
        if take == 0 {
            return (hint, 0, 0, 0);
        }
        let log2 = self.h.shard_words_log2;
        if self.cursor && old + take > 64 << log2 {
            // The cursor moves on once more, and the run starts where it then stood: past the
            // shard's start, unless other groups moved it round. The blocks the first move
            // passed over lie on its next lap.
            (take, old) = self.reserve_seen(s, cap, total);
        }
        let hint = ((s as u64) << (6 + log2)) + old as u64;
        // A run that still passes the end of a whole shard goes on at its start
        // ([`Lead::block`]): the blocks this shard's cursor reaches next. Shards end on word
        // boundaries.
        let mut next = (hint >> 6) as u32 + 1;
        if next & ((1 << log2) - 1) == 0 {
            next -= 1 << log2;
        }
        let (won, seen) = self.claim_run_into(warp, hint, take, next);
        let missing = take - won.count_ones();
        if missing == 0 {
            return (hint, take, won, 0);
        }
        // Bits of this word only: it lies in the reserved shard.
        let (extra, _) = self.claim_round(warp, (hint >> 6) as u32, seen, 0, missing);
        (hint, take, won, extra)
    }
}
