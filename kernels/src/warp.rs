//! The warp as the allocators see it: which lanes take part, and the few collective operations
//! they use to share one atomic.
//!
//! The algorithms in [`crate::slab`] and [`crate::bump`] are generic over [`Warp`]. On the GPU,
//! `nvptx::NvptxWarp` maps these to `activemask`, `shfl.sync` and `match.sync`; on the host,
//! [`SoloLane`] is a warp of one lane, so CPU threads and loom run exactly the code that a warp
//! leader runs, with every collective degenerate.

use crate::sync::atomic::{AtomicU64, Ordering};

/// Collective operations over the lanes named by a mask. Every lane in `mask` must make the same
/// call (as for the `*_sync` PTX instructions).
pub trait Warp {
    /// True when [`Warp::active`] reads the lanes executing now (`activemask`), so lanes that
    /// left drop out of it by themselves; false when it names a fixed set ([`Among`], a full
    /// warp), which code that lets some lanes leave must narrow itself.
    const TRACKS_ACTIVE: bool = false;
    /// The lanes executing this call together (`activemask`).
    fn active(&self) -> u32;
    /// This lane's index, `0..32`.
    fn lane(&self) -> u32;
    /// `v` as held by lane `src`.
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32;
    /// The lanes in `mask` whose `v` equals this lane's.
    fn match_any(&self, mask: u32, v: u64) -> u32;
    /// True when every lane in `mask` holds the same `v`.
    fn match_all(&self, mask: u32, v: u64) -> bool;
    /// Lanes in `mask` whose `pred` is true.
    fn ballot(&self, mask: u32, pred: bool) -> u32;
    /// A small number shared by warps that run close together (the SM id on the GPU), used to
    /// pick per-SM cursors.
    fn slot_hint(&self) -> u32;
    /// `a.fetch_or(v)` with Acquire ordering: the block whose bit this lane sets was released by
    /// its previous owner's [`Warp::fetch_and_release`]. On the GPU this is one
    /// `atom.acquire.gpu` (`core`'s atomics lower to relaxed `atom` there and drop the ordering),
    /// so no lane pays for a device-wide fence.
    #[inline(always)]
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        a.fetch_or(v, Ordering::Acquire)
    }
    /// `a.fetch_and(v)` with Release ordering: this lane's reads and writes of the block it frees
    /// happen before the next owner's. On the GPU, `atom.release.gpu`.
    #[inline(always)]
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        a.fetch_and(v, Ordering::Release)
    }

    /// `v` as held by lane `src`, 64-bit.
    #[inline(always)]
    fn shfl64(&self, mask: u32, v: u64, src: u32) -> u64 {
        let lo = self.shfl(mask, v as u32, src) as u64;
        let hi = self.shfl(mask, (v >> 32) as u32, src) as u64;
        lo | (hi << 32)
    }

    /// Bitwise OR of `v` over the lanes of `mask`, known to every lane of it: a tree over the
    /// lanes' ranks, five shuffle rounds whatever the mask.
    #[inline(always)]
    fn or_reduce(&self, mask: u32, v: u64) -> u64 {
        let n = mask.count_ones();
        let rank = rank_in(mask, self.lane());
        let mut acc = v;
        let mut d = 1;
        while d < n {
            // Every lane shuffles (the instruction needs all of `mask`); only ranks that are
            // multiples of 2d with a partner keep what they read.
            let partner = rank + d;
            let src = if rank.is_multiple_of(2 * d) && partner < n {
                nth_set_bit(mask as u64, partner)
            } else {
                self.lane()
            };
            let other = self.shfl64(mask, acc, src);
            if src != self.lane() {
                acc |= other;
            }
            d *= 2;
        }
        self.shfl64(mask, acc, mask.trailing_zeros())
    }
}

/// The lanes of `mask` of `warp`, as a warp of their own: `active()` is `mask`. Every lane of
/// `mask`, and no other, must make each call.
#[derive(Clone, Copy, Debug)]
pub struct Among<'w, W> {
    /// The whole warp.
    pub warp: &'w W,
    /// The lanes taking part.
    pub mask: u32,
}

impl<'w, W: Warp> Among<'w, W> {
    /// The calling lanes of `warp` (its `active()`, read once, here) that pass the same `key` as
    /// this one: one `match_any` that every calling lane makes. The device heap's entry points
    /// group lanes by heap with it.
    ///
    /// The set stays fixed from here on. Read again further in, `activemask` could name lanes
    /// that entered apart and reconverged there (with another heap, class or segment in hand)
    /// or leave out lanes of this set that fell behind; collectives over either would share one
    /// lane's claim or free among lanes it was not made for.
    #[inline(always)]
    pub fn grouped(warp: &'w W, key: u64) -> Self {
        let active = warp.active();
        Among {
            warp,
            mask: warp.match_any(active, key),
        }
    }
}

impl<W: Warp> Warp for Among<'_, W> {
    #[inline(always)]
    fn active(&self) -> u32 {
        self.mask
    }
    #[inline(always)]
    fn lane(&self) -> u32 {
        self.warp.lane()
    }
    #[inline(always)]
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
        self.warp.shfl(mask, v, src)
    }
    #[inline(always)]
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        self.warp.match_any(mask, v)
    }
    #[inline(always)]
    fn match_all(&self, mask: u32, v: u64) -> bool {
        self.warp.match_all(mask, v)
    }
    #[inline(always)]
    fn ballot(&self, mask: u32, pred: bool) -> u32 {
        self.warp.ballot(mask, pred)
    }
    #[inline(always)]
    fn slot_hint(&self) -> u32 {
        self.warp.slot_hint()
    }
    #[inline(always)]
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        self.warp.fetch_or_acquire(a, v)
    }
    #[inline(always)]
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        self.warp.fetch_and_release(a, v)
    }
}

/// A warp of one lane: the host build's stand-in, where each thread is its own warp leader.
#[derive(Clone, Copy, Debug, Default)]
pub struct SoloLane {
    /// What [`Warp::slot_hint`] returns (a per-thread number in stress tests).
    pub slot: u32,
}

impl Warp for SoloLane {
    const TRACKS_ACTIVE: bool = true;
    #[inline]
    fn active(&self) -> u32 {
        1
    }
    #[inline]
    fn lane(&self) -> u32 {
        0
    }
    #[inline]
    fn shfl(&self, _mask: u32, v: u32, _src: u32) -> u32 {
        v
    }
    #[inline]
    fn match_any(&self, _mask: u32, _v: u64) -> u32 {
        1
    }
    #[inline]
    fn match_all(&self, _mask: u32, _v: u64) -> bool {
        true
    }
    #[inline]
    fn ballot(&self, _mask: u32, pred: bool) -> u32 {
        pred as u32
    }
    #[inline]
    fn slot_hint(&self) -> u32 {
        self.slot
    }
}

/// Number of lanes of `mask` below `lane`.
#[inline(always)]
pub fn rank_in(mask: u32, lane: u32) -> u32 {
    (mask & ((1u64 << lane) as u32).wrapping_sub(1)).count_ones()
}

/// Position of the `n`-th (from 0) set bit of `x`; 64 when `x` has `n` or fewer set bits.
/// Branch-free binary search on popcounts: the same six steps for every input.
#[inline(always)]
pub fn nth_set_bit(x: u64, n: u32) -> u32 {
    if n >= x.count_ones() {
        return 64;
    }
    let mut x = x;
    let mut n = n;
    let mut pos = 0;
    let mut width = 32;
    while width > 0 {
        let low = (x & ((1u64 << width) - 1)).count_ones();
        if n >= low {
            n -= low;
            x >>= width;
            pos += width;
        }
        width /= 2;
    }
    pos
}

/// The lowest `k` set bits of `x` (all of them when it has fewer).
#[inline(always)]
pub fn lowest_set_bits(x: u64, k: u32) -> u64 {
    let p = nth_set_bit(x, k);
    if p >= 64 {
        x
    } else {
        x & ((1u64 << p) - 1)
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;

    #[test]
    fn nth_set_bit_matches_a_scan() {
        let xs = [
            0u64,
            1,
            0x8000_0000_0000_0000,
            u64::MAX,
            0xF0F0_1234_5678_0001,
        ];
        for &x in &xs {
            let set: std::vec::Vec<u32> = (0..64).filter(|b| x >> b & 1 == 1).collect();
            for n in 0..66 {
                let want = set.get(n as usize).copied().unwrap_or(64);
                assert_eq!(nth_set_bit(x, n), want, "x={x:#x} n={n}");
            }
        }
    }

    #[test]
    fn lowest_set_bits_takes_k() {
        assert_eq!(lowest_set_bits(0b1011_0110, 2), 0b0000_0110);
        assert_eq!(lowest_set_bits(0b1011_0110, 0), 0);
        assert_eq!(lowest_set_bits(0b1011_0110, 9), 0b1011_0110);
        assert_eq!(lowest_set_bits(u64::MAX, 64), u64::MAX);
        assert_eq!(lowest_set_bits(u64::MAX, 63), u64::MAX >> 1);
    }

    #[test]
    fn rank_counts_lower_lanes() {
        assert_eq!(rank_in(0b1011, 0), 0);
        assert_eq!(rank_in(0b1011, 3), 2);
        assert_eq!(rank_in(u32::MAX, 31), 31);
    }

    #[test]
    fn solo_lane_reduces_to_itself() {
        let w = SoloLane::default();
        assert_eq!(w.or_reduce(1, 0xAB), 0xAB);
        assert_eq!(w.shfl64(1, u64::MAX - 3, 0), u64::MAX - 3);
    }
}
