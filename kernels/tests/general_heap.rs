//! The general heap (`carve_malloc` / `carve_free`) on the host: class routing, free by pointer,
//! exhaustion of one class, exact statistics; mixed sizes across 32 lanes of one call through the
//! lock-step warp emulator, as the PTX entry points run them.
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::{AtomicU64, Ordering};

use carve_kernels::general::{self, NO_CLASS};
use carve_kernels::heap_layout::*;
use carve_kernels::size_class::{class_of, class_size, NUM_SMALL_CLASSES};
use carve_kernels::warp::{SoloLane, Warp};
use support::general::HostGeneral;
use support::lockstep;

fn hash(i: u32) -> u32 {
    let mut x = i.wrapping_mul(0x9E37_79B9) ^ 0x5bd1_e995;
    x ^= x >> 15;
    x = x.wrapping_mul(0x2c1b_3c6d);
    x ^ (x >> 12)
}

#[test]
fn every_size_routes_to_its_class_and_frees_by_pointer() {
    let heap = HostGeneral::new(1);
    let w = SoloLane::default();
    let sizes: Vec<u64> = (1..=65_536u64)
        .step_by(97)
        .chain((0..NUM_SMALL_CLASSES as u32).map(|c| class_size(c) as u64))
        .collect();
    for &bytes in &sizes {
        let p = heap.malloc(&w, bytes);
        assert!(!p.is_null(), "{bytes} B");
        heap.assert_block_of(p, bytes);
        // SAFETY: the block is ours, `class_size >= bytes` bytes.
        unsafe { p.write_bytes(0xAB, bytes as usize) };
        assert_eq!(heap.total_in_use(), 1, "{bytes} B");
        heap.free(&w, p);
        assert_eq!(heap.total_in_use(), 0, "{bytes} B");
    }
    for c in 0..heap.plan.nclasses {
        let (_, _, failed, foreign, double) = heap.class_stats(c);
        assert_eq!((failed, foreign, double), (0, 0, 0), "class {c}");
    }
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 0);
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 0);
}

#[test]
fn unserved_sizes_and_foreign_pointers_are_counted() {
    let heap = HostGeneral::new(1);
    let w = SoloLane { slot: 5 };
    assert!(heap.malloc(&w, 0).is_null());
    assert!(heap.malloc(&w, 65_537).is_null());
    assert!(heap.malloc(&w, u64::MAX).is_null());
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 3);
    heap.free(&w, core::ptr::null_mut());
    let mut outside = 0u64;
    heap.free(&w, &mut outside as *mut u64 as *mut u8);
    heap.free(&w, heap.base); // the header: below class 0
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 2);
    // Inside class 3's segment but not a block start: the class's slab counts it.
    let p = heap.malloc(&w, 64);
    heap.free(&w, p.wrapping_add(8));
    assert_eq!(heap.class_stats(3).3, 1);
    heap.free(&w, p);
    assert_eq!(heap.total_in_use(), 0);
}

/// A header that claims more classes than it has slots (as only a corrupted one can) names no
/// class past them: pointers there are counted as foreign frees, from a warp of mixed classes
/// and from a warp of one, and no class pointer past the slots is read.
#[test]
fn a_header_claiming_classes_past_its_slots_frees_none_of_them() {
    let heap = HostGeneral::new(1);
    // SAFETY: the header is this heap's own, and nothing else uses the heap.
    unsafe { (*heap.ptr().cast_mut()).nclasses = NO_CLASS + 4 };
    let (base, stride) = (heap.header().base, heap.header().stride_log2);
    let past = |c: u32, lane: u32| (base + ((c as u64) << stride) + 64 * lane as u64) as *mut u8;
    lockstep::run(32, 0, |w| {
        heap.free(w, past(NO_CLASS + w.lane() % 4, w.lane()))
    });
    lockstep::run(32, 0, |w| heap.free(w, past(NO_CLASS + 2, w.lane())));
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 64);
}

/// Large requests (above 64 KiB) take a whole block of the next power of two, from the large
/// classes whose block fits the stride; larger ones are counted as unserved.
#[test]
fn large_requests_take_whole_power_of_two_blocks() {
    // 4 MiB strides: the large classes of 128 KiB to 2 MiB fit, 4 MiB and up do not.
    let heap = HostGeneral::new(3 << 20);
    assert_eq!(heap.plan.nclasses, NUM_SMALL_CLASSES + 5);
    let w = SoloLane::default();
    for bytes in [65_537u64, 100_000, 1 << 17, (1 << 17) + 1, 1 << 20, 2 << 20] {
        let p = heap.malloc(&w, bytes);
        assert!(!p.is_null(), "{bytes} B");
        heap.assert_block_of(p, bytes);
        let c = class_of(bytes as u32).unwrap() as u64;
        assert_eq!(class_size(c as u32) as u64, bytes.next_power_of_two());
        assert_eq!(
            p as u64 % 4096,
            0,
            "{bytes} B: blocks of 4 KiB or more are 4 KiB aligned"
        );
        // SAFETY: the block is ours, `class_size >= bytes` bytes.
        unsafe { p.write_bytes(0xCD, bytes as usize) };
        heap.free(&w, p);
    }
    assert_eq!(heap.total_in_use(), 0);
    assert!(
        heap.malloc(&w, (2 << 20) + 1).is_null(),
        "the 4 MiB class is not in use"
    );
    assert!(
        heap.malloc(&w, (16 << 20) + 1).is_null(),
        "past every class"
    );
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 2);
    // The 2 MiB class holds one block: the second request fails in the class.
    let top = heap.plan.nclasses - 1;
    assert_eq!(heap.class(top).capacity, 1);
    let a = heap.malloc(&w, 2 << 20);
    assert!(!a.is_null());
    assert!(heap.malloc(&w, 1_500_000).is_null());
    assert_eq!(heap.class_stats(top).2, 1);
    heap.free(&w, a);
    assert_eq!(heap.total_in_use(), 0);
}

#[test]
fn exhausting_one_class_leaves_the_others_alone() {
    let heap = HostGeneral::new(1);
    let w = SoloLane::default();
    let last = NUM_SMALL_CLASSES - 1;
    assert_eq!(
        heap.plan.nclasses, NUM_SMALL_CLASSES,
        "128 KiB strides hold no large class"
    );
    let cap = heap.class(last).capacity;
    assert_eq!(cap, heap.plan.classes()[last].capacity);
    let mut big: Vec<*mut u8> = (0..cap).map(|_| heap.malloc(&w, 65_536)).collect();
    assert!(big.iter().all(|p| !p.is_null()));
    assert!(heap.malloc(&w, 60_000).is_null(), "class {last} is full");
    assert_eq!(heap.class_stats(last).2, 1, "the class counts its failure");
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 0);
    // Every other class still serves its whole capacity.
    let cap0 = heap.class(0).capacity;
    let small: Vec<*mut u8> = (0..cap0).map(|_| heap.malloc(&w, 16)).collect();
    assert!(small.iter().all(|p| !p.is_null()));
    let mut seen: Vec<u64> = small.iter().map(|&p| p as u64).collect();
    seen.sort_unstable();
    seen.dedup();
    assert_eq!(seen.len() as u64, cap0, "distinct blocks");
    assert!(heap.malloc(&w, 1).is_null());
    assert!(!heap.malloc(&w, 17).is_null(), "class 1 untouched");
    assert_eq!(
        heap.class_stats(0),
        (cap0, 0, 1, 0, 0),
        "no peak with cursors"
    );
    // Frees return blocks: the full class serves again.
    let p = big.pop().unwrap();
    heap.free(&w, p);
    assert_eq!(heap.malloc(&w, 65_536), p);
}

/// 32 lanes, each its own size (a hash over 16 B to 4 KiB, plus some unserved sizes), in one
/// call: every block in its class, no two overlapping; then one mixed free returns them all.
#[test]
fn mixed_sizes_across_a_warp_in_one_call() {
    let heap = HostGeneral::new(1 << 18);
    for round in 0..8u32 {
        let size = |l: u32| -> u64 {
            match hash(l + 32 * round) % 23 {
                0 if round % 2 == 1 => 0,
                1 if round % 2 == 1 => 20 << 20,
                h if h < 4 => 64, // a few lanes share a class
                _ => 16 + (hash(l ^ (round << 8)) % 4081) as u64,
            }
        };
        let failed_before = heap.header_counter(COUNTER_FAILED_ALLOCS);
        let got = lockstep::run(32, round, |w| {
            let bytes = size(w.lane());
            let p = heap.malloc(w, bytes);
            if !p.is_null() {
                // SAFETY: the block is this lane's, at least `bytes` long.
                unsafe { p.write_bytes(w.lane() as u8, bytes as usize) };
            }
            (p as u64, bytes)
        });
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut unserved = 0;
        for (l, &(p, bytes)) in got.iter().enumerate() {
            if general::request_class(bytes) == NO_CLASS {
                assert_eq!(p, 0, "lane {l}: {bytes} B");
                unserved += 1;
                continue;
            }
            assert_ne!(p, 0, "lane {l}: {bytes} B");
            heap.assert_block_of(p as *mut u8, bytes);
            // SAFETY: written above by lane `l`; nobody else holds it.
            let s = unsafe { std::slice::from_raw_parts(p as *const u8, bytes as usize) };
            assert!(s.iter().all(|&b| b == l as u8), "lane {l}: overwritten");
            live.push((p, bytes));
        }
        assert!(disjoint(&mut live), "blocks overlap");
        assert_eq!(heap.total_in_use(), live.len() as u64);
        assert_eq!(
            heap.header_counter(COUNTER_FAILED_ALLOCS) - failed_before,
            unserved
        );
        // Free in a different lane order than allocation, nulls included.
        lockstep::run(32, round, |w| {
            let (p, _) = got[(31 - w.lane()) as usize];
            heap.free(w, p as *mut u8);
        });
        assert_eq!(heap.total_in_use(), 0, "round {round}");
    }
    for c in 0..heap.plan.nclasses {
        let (_, _, failed, foreign, double) = heap.class_stats(c);
        assert_eq!((failed, foreign, double), (0, 0, 0), "class {c}");
    }
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 0);
}

/// A whole warp asking one size takes the single-class path: 32 consecutive blocks of the run.
#[test]
fn one_size_across_a_warp_takes_one_run() {
    let heap = HostGeneral::new(1 << 18);
    let got = lockstep::run(32, 0, |w| heap.malloc(w, 48) as u64);
    let h = heap.class(2);
    let mut idx: Vec<u64> = got.iter().map(|&p| (p - h.data) / 48).collect();
    idx.sort_unstable();
    assert!(idx.windows(2).all(|w| w[1] == w[0] + 1), "{idx:?}");
    assert_eq!(heap.class_stats(2).0, 32);
    lockstep::run(32, 0, |w| heap.free(w, got[w.lane() as usize] as *mut u8));
    assert_eq!(heap.class_stats(2), (0, 0, 0, 0, 0), "no peak with cursors");
}

/// Up to `n` entries of `live`, taken out at places `next` picks.
fn take_at_random<T>(live: &mut Vec<T>, n: usize, next: &mut impl FnMut() -> u64) -> Vec<T> {
    (0..n.min(live.len()))
        .map(|_| live.swap_remove((next() % live.len() as u64) as usize))
        .collect()
}

/// True when no two of `blocks` (address, bytes) overlap; sorts them.
fn disjoint(blocks: &mut [(u64, u64)]) -> bool {
    blocks.sort_unstable();
    blocks.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0)
}

// Warps whose lanes ask for several classes at once.
#[path = "general_heap/mixed_warps.rs"]
mod mixed_warps;
// Class chains laid out as growth lays them, run out under mixed warps and random frees.
#[path = "general_heap/chain_churn.rs"]
mod chain_churn;
// `carve_malloc`'s entry point for a whole warp: one class of one heap, or a fall back.
#[path = "general_heap/one_class.rs"]
mod one_class;
