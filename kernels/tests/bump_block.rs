//! The block-cooperative bump allocation (`bump_block`) on the host: lock-step warps (one CPU
//! thread per lane) form a block whose barrier is a `std::sync::Barrier`, so the protocol's
//! warp sums, layout, chain walk and failure counts run as on the GPU.
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::AtomicU64;
use std::sync::Barrier;
use std::thread;

use carve_kernels::bump_block::{chain_alloc_block, Block, BLOCK_SCRATCH_WORDS};
use carve_kernels::heap_layout::COUNTER_FAILED_ALLOCS;
use support::lockstep::{self, Lane};
use support::HostHeap;

struct HostBlock<'a, 'l> {
    lane: &'a Lane<'l>,
    warp: u32,
    warps: u32,
    scratch: &'a [AtomicU64],
    barrier: &'a Barrier,
}

impl<'l> Block for HostBlock<'_, 'l> {
    type W = Lane<'l>;
    fn warp(&self) -> &Lane<'l> {
        self.lane
    }
    fn warp_index(&self) -> u32 {
        self.warp
    }
    fn warps(&self) -> u32 {
        self.warps
    }
    fn scratch(&self, i: u32) -> &AtomicU64 {
        &self.scratch[i as usize]
    }
    fn sync(&self) {
        self.barrier.wait();
    }
}

/// Runs `f` on every thread of a block whose warps have `lanes[w]` lanes; each thread's result
/// by (warp, lane).
fn run_block<R, F>(lanes: &[u32], f: F) -> Vec<Vec<R>>
where
    R: Send,
    F: Fn(&HostBlock<'_, '_>, u32) -> R + Sync,
{
    let threads: u32 = lanes.iter().sum();
    let barrier = Barrier::new(threads as usize);
    let scratch: Vec<AtomicU64> = (0..BLOCK_SCRATCH_WORDS)
        .map(|_| AtomicU64::new(0))
        .collect();
    let warps = lanes.len() as u32;
    thread::scope(|s| {
        let handles: Vec<_> = lanes
            .iter()
            .enumerate()
            .map(|(w, &n)| {
                let (f, barrier, scratch) = (&f, &barrier, &scratch);
                s.spawn(move || {
                    lockstep::run(n, w as u32, |lane| {
                        let block = HostBlock {
                            lane,
                            warp: w as u32,
                            warps,
                            scratch,
                            barrier,
                        };
                        f(
                            &block,
                            w as u32 * 32 + carve_kernels::warp::Warp::lane(lane),
                        )
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Thread `t`'s request in the mixed tests: sizes 1 to 200 bytes, none for every fifth thread.
fn mixed(t: u32) -> u64 {
    if t % 5 == 4 {
        0
    } else {
        1 + (t as u64 * 37) % 200
    }
}

/// Checks that the (address, bytes) ranges lie in the arena of `heap`, aligned and disjoint.
fn assert_disjoint(heap: &HostHeap, mut ranges: Vec<(u64, u64)>, align: u64) {
    let (lo, hi) = (heap.data_start(), heap.data_start() + heap.handle.capacity);
    ranges.sort_unstable();
    for &(a, n) in &ranges {
        assert!(a >= lo && a + n <= hi, "{a:#x}+{n} outside the arena");
        assert_eq!(a % align, 0, "{a:#x} not aligned to {align}");
    }
    for r in ranges.windows(2) {
        assert!(r[0].0 + r[0].1 <= r[1].0, "{r:?} overlap");
    }
}

#[test]
fn a_block_with_a_partial_warp_gets_disjoint_aligned_ranges() {
    for (chunked, align) in [(false, 16), (true, 64)] {
        let heap = if chunked {
            HostHeap::bump(1 << 20, 4, 14)
        } else {
            HostHeap::bump(1 << 20, 0, 0)
        };
        let h = &*heap.handle;
        let got = run_block(&[32, 32, 32, 5], |b, t| {
            // SAFETY: a formatted host bump arena; every thread of the block calls.
            let p = unsafe { chain_alloc_block(h, b, mixed(t), align) } as u64;
            (p, mixed(t))
        });
        let all: Vec<(u64, u64)> = got.into_iter().flatten().collect();
        for &(p, want) in &all {
            assert_eq!(p != 0, want != 0, "{want} bytes got {p:#x}");
        }
        let ranges: Vec<_> = all.into_iter().filter(|&(_, n)| n != 0).collect();
        let asked: u64 = ranges.iter().map(|r| r.1).sum();
        assert_disjoint(&heap, ranges, align);
        assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 0);
        // One reservation for the block (too large for a quarter chunk, so from the global
        // offset even when chunked): the layout's padding at most, one alignment per lane and
        // per warp, and the start's.
        let used = heap.bump_offset();
        assert!(
            used >= asked && used <= asked + 101 * align + 5 * align,
            "{used} for {asked}"
        );
    }
}

#[test]
fn repeated_calls_reuse_the_scratch_and_stay_disjoint() {
    let heap = HostHeap::bump(1 << 20, 0, 0);
    let h = &*heap.handle;
    let got = run_block(&[32, 32, 17], |b, t| {
        (0..6)
            .map(|round| {
                let want = mixed(t + round * 13);
                // SAFETY: as above.
                (unsafe { chain_alloc_block(h, b, want, 16) } as u64, want)
            })
            .collect::<Vec<_>>()
    });
    let all: Vec<(u64, u64)> = got.into_iter().flatten().flatten().collect();
    assert_eq!(all.len(), 81 * 6);
    for &(p, want) in &all {
        assert_eq!(p != 0, want != 0);
    }
    assert_disjoint(&heap, all.into_iter().filter(|r| r.1 != 0).collect(), 16);
}

#[test]
fn a_block_that_does_not_fit_gets_null_everywhere_and_is_counted() {
    // 64 threads × 64 B = 4 KiB; the first segment has 1 KiB, the second 8 KiB.
    let first = HostHeap::bump(1 << 10, 0, 0);
    let second = HostHeap::bump(8 << 10, 0, 0);
    let mut chained = HostHeap::bump(1 << 10, 0, 0);
    chained.handle.next = &*second.handle as *const _ as u64;
    // Alone, the small segment serves nobody and counts every request; invalid requests
    // (alignment not a power of two) are counted too.
    let h = &*first.handle;
    let got = run_block(&[32, 32], |b, t| {
        let align = if t == 7 { 48 } else { 16 };
        // SAFETY: as above.
        let p = unsafe { chain_alloc_block(h, b, 64, align) };
        p as u64
    });
    assert!(got.iter().flatten().all(|&p| p == 0));
    assert_eq!(first.counter(COUNTER_FAILED_ALLOCS), 64);
    assert_eq!(first.bump_offset(), 0, "a failed block takes nothing");
    // Chained, the block is served from the second segment, whole.
    let h = &*chained.handle;
    let got = run_block(&[32, 32], |b, _| {
        // SAFETY: as above; `next` is a formatted segment that outlives the call.
        let p = unsafe { chain_alloc_block(h, b, 64, 16) };
        p as u64
    });
    let ranges: Vec<_> = got.into_iter().flatten().map(|p| (p, 64)).collect();
    assert!(ranges.iter().all(|&(p, _)| p != 0));
    assert_disjoint(&second, ranges, 16);
    assert_eq!(chained.counter(COUNTER_FAILED_ALLOCS), 0);
    assert_eq!(second.bump_offset(), 64 * 64);
}

#[test]
fn a_block_asking_nothing_touches_nothing() {
    let heap = HostHeap::bump(1 << 10, 0, 0);
    let h = &*heap.handle;
    let got = run_block(&[32, 3], |b, _| {
        // SAFETY: as above.
        let p = unsafe { chain_alloc_block(h, b, 0, 16) };
        p as u64
    });
    assert!(got.iter().flatten().all(|&p| p == 0));
    assert_eq!(heap.bump_offset(), 0);
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 0);
}
