//! A warp's free into one slab segment: a run of one word with one `fetch_and`, else groups
//! by word; double and foreign frees counted, never applied.

use super::{Slab, NONE};
use crate::exact_div::exact_quotient;
use crate::heap_layout::*;
use crate::sync::atomic::Ordering;
use crate::warp::{rank_in, Warp};

impl<'a> Slab<'a> {
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

    /// Frees blocks `base .. base + lanes` by the calling lane alone: the run's part in each
    /// bitmap word it touches cleared with one Release `fetch_and`, then that word's shard count
    /// moved; blocks that were free already are counted as double frees on a checked heap.
    /// `carve_free`'s mixed class groups clear their runs in the same parts, each by the lane
    /// whose block starts it. Returns `false`, having done nothing, when the run is empty,
    /// longer than 32 blocks or not inside this segment.
    #[inline(always)]
    pub fn free_blocks<W: Warp>(&self, warp: &W, base: u64, lanes: u32) -> bool {
        let inside = base
            .checked_add(lanes as u64)
            .is_some_and(|end| end <= self.h.capacity);
        if lanes == 0 || lanes > 32 || !inside {
            return false;
        }
        let (w, o, next) = run_parts(base, lanes);
        if next > 0 {
            self.free_part(warp, w + 1, part_bits(0, next));
        }
        self.free_part(warp, w, part_bits(o, lanes - next));
        true
    }

    /// Clears `bits` of word `w` with one Release `fetch_and` (as in `free_run`), then settles
    /// the free.
    #[inline(always)]
    fn free_part<W: Warp>(&self, warp: &W, w: u32, bits: u64) {
        let old = warp.fetch_and_release(self.word(w), !bits);
        self.settle_free(warp, w, bits.count_ones(), (old & bits).count_ones());
    }

    /// Moves the count of `word`'s shard after a free of `lanes` blocks of which `freed` were in
    /// use; counts the rest as double frees on a checked heap.
    #[inline(always)]
    fn settle_free<W: Warp>(&self, warp: &W, word: u32, lanes: u32, freed: u32) {
        if freed < lanes {
            self.at_home()
                .count_double_frees(warp.slot_hint(), lanes - freed);
        }
        // The shard counts' address is read from the region, after the bitmap's atomic: from
        // the register copy it would stay live across the whole fast path, and at 32 registers
        // ptxas spilled it in `carve_heap_slab_free`.
        self.at_home()
            .unreserve(word >> self.h.shard_words_log2, freed);
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
        // Lanes freeing the same block: only the first clears it, the others count as double
        // frees. Were both to clear it, a block claimed between the two clears (at once, with
        // cursors) would be freed under its next owner.
        let first_of_block = in_run == active || {
            let same = warp.match_any(active, idx);
            same.trailing_zeros() == lane
        };
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
        } else if first_of_block {
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

/// Where the run of `lanes <= 32` blocks from block `base` lies in the bitmap: its first word,
/// its first bit there, and how many of its blocks lie in the next word (0 when it ends in the
/// first).
#[inline(always)]
pub(crate) fn run_parts(base: u64, lanes: u32) -> (u32, u32, u32) {
    let o = (base & 63) as u32;
    ((base >> 6) as u32, o, (o + lanes).saturating_sub(64))
}

/// The bits of a run part of `n <= 32` blocks from bit `o` of its word.
#[inline(always)]
pub(crate) fn part_bits(o: u32, n: u32) -> u64 {
    ((1u64 << n) - 1) << o
}
