//! Many warps on one slab chain at once, far below its capacity: every request is served.
//!
//! The GPU's mixed-size test (`heap_growth_gpu`, 65,536 threads over grown size classes) saw
//! requests fail while the class's chain had thousands of free blocks. Warps whose hints
//! collide (a grid larger than a segment's blocks / 32, or a warp's class groups, which share
//! one hint) pile into one shard; there, a claimer whose `fetch_or` keeps landing just after
//! others' loses round after round. `Slab::claim` gave up after `4 * words + 8` rounds and handed
//! its reservation back, and the slow path counted those lanes as served: they got null from a
//! shard that still had room (and so did the chain, from its last segment).
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use carve_kernels::heap_layout::*;
use carve_kernels::slab::{self, Slab};
use carve_kernels::warp::{Among, SoloLane, Warp};
use support::lockstep::{self, Lane};
use support::HostHeap;

/// A warp of one lane whose `fetch_or`s each land just after another warp's: before each one,
/// a rival that holds reservations in the same shard claims the lowest bit this one asks for.
struct Raced<'a> {
    inner: SoloLane,
    /// Blocks the rival has reserved and not claimed yet.
    rival: &'a AtomicU64,
}

impl Warp for Raced<'_> {
    fn active(&self) -> u32 {
        self.inner.active()
    }
    support::forward_collectives!(inner);
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        let lowest = v & v.wrapping_neg();
        if self.rival.load(Ordering::Relaxed) > 0
            && a.fetch_or(lowest, Ordering::Relaxed) & lowest == 0
        {
            self.rival.fetch_sub(1, Ordering::Relaxed);
        }
        a.fetch_or(v, Ordering::Acquire)
    }
}

/// One shard of 64 blocks: 40 rival warps have reserved a block each, and each claims its bit
/// just before this warp's every `fetch_or`. The shard keeps 23 free blocks throughout, so this
/// warp's block must come, after 40 lost rounds at most.
#[test]
fn a_claimer_that_keeps_losing_races_still_gets_its_block() {
    let heap = HostHeap::slab(64, 16, Some(0), FLAG_CHECKED_FREES);
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let s = unsafe { Slab::new(&heap.handle) };
    let rivals = 40;
    assert_eq!(s.reserve(0, rivals), rivals);
    let rival = AtomicU64::new(rivals as u64);
    let w = Raced {
        inner: SoloLane::default(),
        rival: &rival,
    };
    let p = s.alloc(&w, 0, true);
    assert!(
        !p.is_null(),
        "null with {} free blocks",
        64 - heap.bits_set()
    );
    assert_eq!(rival.load(Ordering::Relaxed), 0, "every rival claimed");
    assert_eq!(heap.bits_set(), rivals as u64 + 1);
    assert_eq!(heap.in_use(), rivals as u64 + 1);
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 0);
}

/// A warp whose bitmap atomics take long to land, as on the GPU, where a `fetch_or` is a round
/// trip to L2 and every warp of a pile-up issues its own at once: others' land in between this
/// warp's read of a word and its `fetch_or` on it.
struct Slow<'a, W>(&'a W);

impl<W: Warp> Warp for Slow<'_, W> {
    fn active(&self) -> u32 {
        self.0.active()
    }
    fn lane(&self) -> u32 {
        self.0.lane()
    }
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
        self.0.shfl(mask, v, src)
    }
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        self.0.match_any(mask, v)
    }
    fn match_all(&self, mask: u32, v: u64) -> bool {
        self.0.match_all(mask, v)
    }
    fn ballot(&self, mask: u32, pred: bool) -> u32 {
        self.0.ballot(mask, pred)
    }
    fn slot_hint(&self) -> u32 {
        self.0.slot_hint()
    }
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        thread::sleep(Duration::from_micros(200));
        self.0.fetch_or_acquire(a, v)
    }
}

fn hash(i: u32) -> u32 {
    let mut x = i.wrapping_mul(0x9E37_79B9) ^ 0x5bd1_e995;
    x ^= x >> 15;
    x = x.wrapping_mul(0x2c1b_3c6d);
    x ^ (x >> 12)
}

/// Segments of the given capacities (the device's geometry for each), chained in order: the
/// heaps, and the head handle (a copy of the first's with `next` set, as in a grown chain).
fn chain_of(caps: &[u64], bs: u64) -> (Vec<HostHeap>, Vec<HeapHandle>) {
    let heaps: Vec<HostHeap> = caps
        .iter()
        .map(|&c| HostHeap::slab(c, bs, None, FLAG_CHECKED_FREES))
        .collect();
    // Copies of every handle but the last, each pointing at the next copy (the last at the
    // heap's own handle); built back to front so the copies' addresses are fixed first.
    let mut copies: Vec<HeapHandle> = heaps.iter().map(|h| *h.handle).collect();
    for i in (0..heaps.len() - 1).rev() {
        let next = if i + 1 == heaps.len() - 1 {
            &*heaps[i + 1].handle as *const HeapHandle as u64
        } else {
            &copies[i + 1] as *const HeapHandle as u64
        };
        copies[i].next = next;
    }
    (heaps, copies)
}

/// `warps` lock-step warps of 32 lanes at once, warp `i` with slot `i`; lane results by warp.
fn grid<R: Send>(warps: u32, f: impl Fn(u32, &Lane<'_>) -> R + Sync) -> Vec<Vec<R>> {
    thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..warps)
            .map(|wi| s.spawn(move || lockstep::run(32, wi, |w| f(wi, w))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The GPU test's mixed rounds, scaled down: a chain of three segments (the head a third of the
/// demand, as after growth), many warps at once with colliding hints and slow atomics, each
/// warp's lanes in groups (`match_any` + `Among`, as the general heap's mixed path) that share
/// the warp's hint, or whole warps; the demand is below the capacity, so every request is
/// served, each block once; then everything is freed, and the next round starts from an empty
/// chain.
#[test]
fn many_grouped_warps_on_a_chain_are_all_served() {
    let warps = 48u32;
    let demand = warps as u64 * 32;
    let caps = [demand / 3, demand / 3, demand / 2];
    let (heaps, copies) = chain_of(&caps, 16);
    let head = &copies[0];
    for round in 0..6u32 {
        let got = grid(warps, |wi, w| {
            let seed = wi + round * warps;
            // Hints collide as on the GPU, where a grid has far more warps than a segment
            // has runs of 32 blocks.
            let hint = slab::warp_hint(seed % 2, head.capacity);
            let w = &Slow(w);
            // SAFETY: a formatted host chain that outlives the call; the lanes of `group` (or
            // the whole warp) make the call together.
            let p = unsafe {
                if round % 2 == 1 && wi % 4 == 0 {
                    slab::chain_alloc(head, w, hint)
                } else {
                    let all = w.active();
                    let key = hash(seed * 32 + w.lane()) % 12;
                    let group = w.match_any(all, key as u64);
                    slab::chain_alloc(
                        head,
                        &Among {
                            warp: w,
                            mask: group,
                        },
                        hint,
                    )
                }
            };
            p as u64
        });
        let mut all: Vec<u64> = got.iter().flatten().copied().collect();
        let nulls = all.iter().filter(|&&p| p == 0).count();
        let failed: u64 = heaps.iter().map(|h| h.counter(COUNTER_FAILED_ALLOCS)).sum();
        let used: Vec<(u64, u64)> = heaps.iter().map(|h| (h.in_use(), h.bits_set())).collect();
        assert_eq!(
            nulls, 0,
            "round {round}: {nulls} of {demand} requests failed ({failed} counted) with \
             capacities {caps:?} and (in use, bits) {used:?}"
        );
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len() as u64,
            demand,
            "round {round}: a block handed out twice"
        );
        for h in &heaps {
            assert_eq!(h.in_use(), h.bits_set(), "round {round}");
        }
        assert_eq!(heaps.iter().map(|h| h.in_use()).sum::<u64>(), demand);
        // Free everything, one warp's blocks per warp (whole warps: the grouped free paths).
        grid(warps, |wi, w| {
            let p = got[wi as usize][w.lane() as usize] as *mut u8;
            // SAFETY: as above; each block freed once, by the lane that got it.
            unsafe { slab::chain_free(head, w, p) };
        });
        for h in &heaps {
            assert_eq!((h.in_use(), h.bits_set()), (0, 0), "round {round}");
            assert_eq!(h.counter(COUNTER_DOUBLE_FREES), 0);
            assert_eq!(h.counter(COUNTER_FOREIGN_FREES), 0);
        }
    }
}

/// One segment, partial groups: lanes of a few groups per warp only (the others idle), many
/// warps with colliding hints and slow atomics on a heap that holds them all.
#[test]
fn partial_groups_on_one_segment_are_all_served() {
    let warps = 96u32;
    let heap = HostHeap::slab(warps as u64 * 24, 16, None, FLAG_CHECKED_FREES);
    let h = &*heap.handle;
    let got = grid(warps, |wi, w| {
        let key = hash(wi * 32 + w.lane()) % 16;
        if key >= 10 {
            return 0;
        }
        let w = &Slow(w);
        let mine = w.active();
        let group = w.match_any(mine, key as u64);
        let hint = slab::warp_hint(wi % 2, h.capacity);
        // SAFETY: a formatted host heap that outlives the call; the group calls together.
        unsafe {
            slab::chain_alloc(
                h,
                &Among {
                    warp: w,
                    mask: group,
                },
                hint,
            ) as u64
        }
    });
    let asked = (0..warps * 32).filter(|&i| hash(i) % 16 < 10).count() as u64;
    assert!(asked <= h.capacity);
    let mut all: Vec<u64> = got.iter().flatten().copied().filter(|&p| p != 0).collect();
    assert_eq!(
        all.len() as u64,
        asked,
        "served of {asked} asked, capacity {}",
        h.capacity
    );
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len() as u64, asked, "a block handed out twice");
    assert_eq!((heap.in_use(), heap.bits_set()), (asked, asked));
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 0);
}
