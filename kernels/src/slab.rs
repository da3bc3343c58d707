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
//! **Cursors** ([`FLAG_CURSOR_SHARDS`], the classes of `carve_malloc`): the shard counts only
//! say where a group's run starts (a Relaxed `fetch_add` moves the cursor on), nothing is
//! reserved, and a free is its `fetch_and` alone. The bitmap is the whole truth: whether a shard
//! has room is read from its words, a claim that finds none ends after one pass over them, and
//! the host counts the blocks in use in the bitmap. Lanes freeing the same block in one call
//! clear it once, since a cleared bit can be claimed at once. Every block a cursor's shard hands
//! out lies on the cursor's path: a run that would pass the shard's end is taken where the
//! cursor stands after it (one run of consecutive blocks, which `carve_free` clears in one step;
//! the blocks passed over are the next lap's), one that still does goes on at the shard's
//! start, and lanes a run left without a block take runs at other shards' cursors, not the
//! clear bits ahead of their own, where that cursor's next runs would land and fail in turn.
//!
//! No device-wide fence is on either path: the handover of a block is ordered by the Acquire and
//! Release of the bitmap atomics themselves; the counts are Relaxed hints plus the reservation
//! invariant above.
//!
//! Every access to heap memory goes through the addresses in the [`HeapHandle`].

mod alloc;
mod bitmap;
mod free;
mod hint;
mod segments;

pub(crate) use free::{part_bits, run_parts};
pub use hint::{group_hint, warp_hint};
pub use segments::{chain_alloc, chain_free, chain_free_each};
pub(crate) use segments::{chain_alloc_after, chain_alloc_in, chain_free_each_in, chain_free_in};

use crate::heap_layout::*;
use crate::sync::atomic::Ordering;
use crate::warp::{nth_set_bit, rank_in, Warp};

/// A view of one formatted slab segment.
#[derive(Clone, Copy, Debug)]
pub struct Slab<'a> {
    /// The fields the fast paths read (on the GPU, a copy in registers).
    h: &'a HeapHandle,
    /// The handle in the region, which the out-of-line slow paths read, so that calling them
    /// does not make the register copy spill to memory.
    home: &'a HeapHandle,
    /// The shard counts are cursors ([`FLAG_CURSOR_SHARDS`]): set by the caller that knows the
    /// heap's kind (a general heap's classes), so that inlined paths fold it away.
    cursor: bool,
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
    /// The blocks of a shard less one ([`Slab::shard_mask`]): a run taken at a cursor goes on
    /// at its shard's start when it reaches the shard's end.
    pub mask: u64,
    /// The run was taken at its shard's cursor ([`Slab::lead_retrying`]): lanes it left without
    /// a block go to other shards' cursors first, not to the clear bits ahead of this one, on
    /// which later runs of this shard would land.
    pub at_cursor: bool,
}

impl Lead {
    /// The block index of the lane of rank `rank`, if the fast step served it.
    #[inline(always)]
    pub(crate) fn block(&self, rank: u32) -> Option<u64> {
        if self.won >> rank & 1 != 0 {
            return Some((self.hint & !self.mask) | ((self.hint + rank as u64) & self.mask));
        }
        let j = rank - (self.won & ((1u64 << rank) - 1) as u32).count_ones();
        (j < self.extra.count_ones()).then(|| (self.hint & !63) + nth_set_bit(self.extra, j) as u64)
    }
}

// The out-of-line paths: what the fast paths of `alloc.rs` and `free.rs` fall back to.
impl<'a> Slab<'a> {
    /// The fast path's claim left lanes without a block (`won`: bit `r` for the rank-`r` lane's
    /// block `hint + r`; `take`, the leader's reservation in `shard`): the leader claims the rest
    /// of the reservation from `hint` on, then reserves and claims in other shards until every
    /// lane is served or no shard has room. Returns this lane's block index, or [`NONE`].
    ///
    /// A run taken at a cursor (`at_cursor`) skips the first step: the clear bits after it are
    /// where this shard's next runs go, and taking them there sends those runs out of line in
    /// turn. Its lanes take runs at the cursors of the shards with room instead, as their own
    /// groups do, and a shard's bitmap word by word only when its cursor's run wins nothing.
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
        // With cursors nothing was reserved: the lanes still waiting look in the hint's shard
        // first, as far as its bitmap goes.
        let left = if lead.at_cursor {
            0
        } else if self.cursor {
            need
        } else {
            take - got.count_ones()
        };
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
            if lead.at_cursor {
                served += self.take_at_cursor(warp, active, shard, need - served, mine);
                continue;
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

    /// [`Slab::alloc_slow`]'s step in shard `s` for the `want` lanes still waiting (those with
    /// [`NONE`] in `mine`): a run at the shard's cursor, as
    /// [`Slab::lead_retrying`] takes it, then, if that wins nothing, the shard's clear bits word
    /// by word from its first. Returns how many it served.
    #[inline(always)]
    fn take_at_cursor<W: Warp>(
        &self,
        warp: &W,
        active: u32,
        s: u32,
        want: u32,
        mine: &mut u64,
    ) -> u32 {
        let leader = active.trailing_zeros();
        let start = (s as u64) << (6 + self.h.shard_words_log2);
        let (mut at, mut won, mut extra) = (start, 0, 0);
        if warp.lane() == leader {
            (at, _, won, extra) = self.lead_retrying(warp, start, want);
        }
        let lead = Lead {
            shard: s,
            hint: start + warp.shfl(active, (at - start) as u32, leader) as u64,
            take: 0,
            won: warp.shfl(active, won, leader),
            extra: warp.shfl64(active, extra, leader),
            mask: self.shard_mask(),
            at_cursor: true,
        };
        // The waiting lanes, ranked among themselves, take the run's blocks in rank order.
        let waiting = warp.ballot(active, *mine == NONE);
        if *mine == NONE {
            *mine = lead.block(rank_in(waiting, warp.lane())).unwrap_or(NONE);
        }
        let n = lead.won.count_ones() + lead.extra.count_ones();
        if n > 0 {
            return n;
        }
        let rank = if *mine == NONE {
            rank_in(waiting, warp.lane())
        } else {
            u32::MAX
        };
        let first = s << self.h.shard_words_log2;
        self.claim(warp, active, (s, first, 0), want, (rank, 0), mine)
    }

    /// Claims `take` reserved bits of `shard`, starting at `start_word` bit `from`, and gives
    /// the lane of rank `served + j` the `j`-th of them. Returns how many it claimed (`take`
    /// unless frees kept racing it, or, with cursors, the shard had fewer clear bits; the rest
    /// of the reservation is then given back).
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
        // With cursors nothing is reserved, so the shard may be full: the claim ends once the
        // leader has moved through every word without a bit (a `word` of `u32::MAX` tells the
        // lanes).
        let mut empty_moves = 0;
        while left > 0 {
            let mut got = 0u64;
            if is_leader && self.cursor && empty_moves > words {
                w = u32::MAX;
            } else if is_leader {
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
            if word == u32::MAX {
                break;
            }
            let n = got.count_ones();
            if rank >= served && rank < served + n {
                *mine = word as u64 * 64 + nth_set_bit(got, rank - served) as u64;
            }
            served += n;
            left -= n;
            empty_moves = if n > 0 { 0 } else { empty_moves };
            if is_leader && left > 0 && (!cur & self.valid_bits(w) & (u64::MAX << from)) == 0 {
                w = if w + 1 == first + words { first } else { w + 1 };
                from = 0;
                known = false;
                empty_moves += 1;
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

    /// Counts `n` double frees on a checked heap.
    #[cold]
    #[inline(never)]
    pub(crate) fn count_double_frees(&self, slot: u32, n: u32) {
        if self.h.flags & FLAG_CHECKED_FREES != 0 {
            self.counter(COUNTER_DOUBLE_FREES, slot)
                .fetch_add(n as u64, Ordering::Relaxed);
        }
    }
}

/// A block index in `0..cap` from a hint at or past it (a later segment of a chain, a caller's
/// own hint): out of line, so that the fast path carries no 64-bit division.
#[cold]
#[inline(never)]
fn wrap_hint(hint: u64, cap: u64) -> u64 {
    hint % cap
}

/// A cursor's place `at` in a short last shard of `cap` blocks (`at >= cap`): out of line, as
/// [`wrap_hint`].
#[cold]
#[inline(never)]
fn wrap_cursor(at: u32, cap: u32) -> u32 {
    at % cap
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
