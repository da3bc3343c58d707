//! 16 CPU threads on the host build of the slab and bump allocators: each thread is a warp of
//! one lane ([`SoloLane`]), running the same code a warp leader runs on the GPU.
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Barrier;
use std::thread;

use carve_kernels::bump;
use carve_kernels::heap_layout::*;
use carve_kernels::slab::{self, Slab};
use carve_kernels::warp::SoloLane;
use support::{xorshift, HostHeap};

const THREADS: u32 = 16;

fn fill(p: *mut u8, bytes: u64, tag: u32) {
    for k in 0..bytes / 4 {
        // SAFETY: p is a block of `bytes` bytes owned by the caller.
        unsafe {
            (p as *mut u32)
                .add(k as usize)
                .write_volatile(tag ^ k as u32)
        };
    }
}

fn intact(p: *mut u8, bytes: u64, tag: u32) -> bool {
    // SAFETY: as for `fill`.
    (0..bytes / 4)
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        .all(|k| unsafe { (p as *const u32).add(k as usize).read_volatile() } == tag ^ k as u32)
}

#[test]
fn slab_16_threads_never_share_a_block_and_reuse_every_free() {
    let cap = 4000u64; // not a multiple of 64: the tail word is partial
    let bs = 48u64; // not a power of two
    let heap = HostHeap::slab(cap, bs, Some(2), FLAG_CHECKED_FREES);
    let owner: Vec<AtomicU32> = (0..cap).map(|_| AtomicU32::new(0)).collect();
    let barrier = Barrier::new(THREADS as usize);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (heap, owner, barrier) = (&heap, &owner, &barrier);
            s.spawn(move || {
                let warp = SoloLane { slot: t };
                // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
                let slab = unsafe { Slab::new(&heap.handle) };
                let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ ((t as u64 + 1) * 0x1234_5678);
                let mut held: Vec<(*mut u8, u32)> = Vec::new();
                barrier.wait();
                for i in 0..20_000u32 {
                    let tag = (t << 24) | i;
                    if held.len() < 400 && !xorshift(&mut rng).is_multiple_of(3) {
                        let hint = xorshift(&mut rng) % cap;
                        let p = slab.alloc(&warp, hint, true);
                        if p.is_null() {
                            continue;
                        }
                        let idx = slab.index_of(p).expect("a block of this heap");
                        assert_eq!(
                            owner[idx as usize].swap(tag, Ordering::Relaxed),
                            0,
                            "block {idx} handed out twice"
                        );
                        fill(p, bs, tag);
                        held.push((p, tag));
                    } else if !held.is_empty() {
                        let j = (xorshift(&mut rng) % held.len() as u64) as usize;
                        let (p, tag) = held.swap_remove(j);
                        assert!(intact(p, bs, tag), "block {p:?} overwritten");
                        let idx = slab.index_of(p).unwrap();
                        assert_eq!(owner[idx as usize].swap(0, Ordering::Relaxed), tag);
                        slab.free_index(&warp, idx);
                    }
                }
                for (p, tag) in held {
                    assert!(intact(p, bs, tag));
                    owner[slab.index_of(p).unwrap() as usize].store(0, Ordering::Relaxed);
                    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
                    unsafe { slab::chain_free(&heap.handle, &warp, p) };
                }
            });
        }
    });
    assert_eq!(heap.in_use(), 0);
    assert_eq!(heap.bits_set(), 0);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 0);
    assert!(heap.peak_sum() >= 400 && heap.peak_sum() <= cap);
}

#[test]
fn slab_exhaustion_serves_exactly_capacity_then_recovers() {
    let cap = 3000u64;
    let heap = HostHeap::slab(cap, 16, Some(1), FLAG_CHECKED_FREES);
    let run = |per_thread: u64| -> Vec<*mut u8> {
        let got = std::sync::Mutex::new(Vec::new());
        thread::scope(|s| {
            for t in 0..THREADS {
                let (heap, got) = (&heap, &got);
                s.spawn(move || {
                    let warp = SoloLane { slot: t };
                    let mine: Vec<u64> = (0..per_thread)
                        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
                        .map(|i| unsafe {
                            slab::chain_alloc(&heap.handle, &warp, (t as u64 * 997 + i) % cap)
                        } as u64)
                        .collect();
                    got.lock().unwrap().extend(mine);
                });
            }
        });
        got.into_inner()
            .unwrap()
            .into_iter()
            .map(|p| p as *mut u8)
            .collect()
    };
    // 2K requests for K blocks.
    let all = run(2 * cap / THREADS as u64 + 1);
    let mut ok: Vec<u64> = all
        .iter()
        .filter(|p| !p.is_null())
        .map(|&p| p as u64)
        .collect();
    assert_eq!(ok.len() as u64, cap, "exactly K of 2K requests succeed");
    ok.sort_unstable();
    ok.dedup();
    assert_eq!(ok.len() as u64, cap, "no block twice");
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), all.len() as u64 - cap);
    assert_eq!(heap.in_use(), cap);
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let slab = unsafe { Slab::new(&heap.handle) };
    for &p in &ok {
        slab.free_index(&SoloLane::default(), slab.index_of(p as *mut u8).unwrap());
    }
    assert_eq!(heap.in_use(), 0);
    assert_eq!(heap.bits_set(), 0);
    let again = run(cap / THREADS as u64 + 1);
    assert_eq!(again.iter().filter(|p| !p.is_null()).count() as u64, cap);
}

#[test]
fn slab_counts_double_and_foreign_frees_without_corruption() {
    let heap = HostHeap::slab(128, 32, None, FLAG_CHECKED_FREES);
    let w = SoloLane::default();
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let p = unsafe { slab::chain_alloc(&heap.handle, &w, 0) };
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let q = unsafe { slab::chain_alloc(&heap.handle, &w, 0) };
    assert!(!p.is_null() && !q.is_null() && p != q);
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { slab::chain_free(&heap.handle, &w, p) };
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { slab::chain_free(&heap.handle, &w, p) }; // double
                                                      // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { slab::chain_free(&heap.handle, &w, q.wrapping_add(8)) }; // misaligned
    let mut outside = 0u64;
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { slab::chain_free(&heap.handle, &w, &mut outside as *mut u64 as *mut u8) };
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 1);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 2);
    assert_eq!(heap.in_use(), 1);
    assert_eq!(heap.bits_set(), 1);
    // Every block but q is still available.
    let rest: Vec<_> = (0..200)
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        .map(|i| unsafe { slab::chain_alloc(&heap.handle, &w, i) })
        .collect();
    assert_eq!(rest.iter().filter(|p| !p.is_null()).count(), 127);
}

#[test]
fn slab_claim_run_spans_two_words_and_reports_what_it_won() {
    let heap = HostHeap::slab(200, 16, None, 0);
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let slab = unsafe { Slab::new(&heap.handle) };
    let w = SoloLane::default();
    // Bits 60..68 cross from word 0 into word 1.
    assert_eq!(slab.claim_run(&w, 60, 8), 0xFF);
    assert_eq!(heap.bits_set(), 8);
    // Bits 58..66: 60..65 are taken, 58, 59 are won (ranks 0, 1).
    assert_eq!(slab.claim_run(&w, 58, 8), 0b11);
    assert_eq!(slab.claim_run(&w, 100, 32), u32::MAX);
    assert_eq!(slab.claim_run(&w, 100, 0), 0);
    assert_eq!(heap.bits_set(), 8 + 2 + 32);
}

#[test]
fn slab_chain_moves_on_to_the_next_segment() {
    let a = HostHeap::slab(64, 16, None, 0);
    let b = HostHeap::slab(64, 16, None, 0);
    let mut head = *a.handle;
    head.next = &*b.handle as *const HeapHandle as u64;
    let w = SoloLane::default();
    let ps: Vec<_> = (0..130)
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        .map(|i| unsafe { slab::chain_alloc(&head, &w, i) })
        .collect();
    assert_eq!(ps.iter().filter(|p| !p.is_null()).count(), 128);
    assert_eq!((a.in_use(), b.in_use()), (64, 64));
    assert_eq!(
        b.counter(COUNTER_FAILED_ALLOCS),
        2,
        "failures counted at the last segment"
    );
    for p in ps.into_iter().filter(|p| !p.is_null()) {
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        unsafe { slab::chain_free(&head, &w, p) };
    }
    assert_eq!((a.in_use(), b.in_use()), (0, 0));
}

#[test]
fn bump_16_threads_hand_out_disjoint_aligned_ranges() {
    let cap = 1u64 << 22;
    let heap = HostHeap::bump(cap, 8, 14);
    let ranges = std::sync::Mutex::new(Vec::new());
    thread::scope(|s| {
        for t in 0..THREADS {
            let (heap, ranges) = (&heap, &ranges);
            s.spawn(move || {
                let warp = SoloLane { slot: t };
                let mut rng = 0xDEAD_BEEFu64 + t as u64 * 7919;
                let mut mine = Vec::new();
                loop {
                    let bytes = 1 + xorshift(&mut rng) % 600;
                    let align = 1u64 << (xorshift(&mut rng) % 9);
                    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
                    let p = unsafe { bump::chain_alloc(&heap.handle, &warp, bytes, align) } as u64;
                    if p == 0 {
                        break;
                    }
                    assert_eq!(p % align, 0, "alignment {align}");
                    assert!(p >= heap.data_start() && p + bytes <= heap.data_start() + cap);
                    mine.push((p, p + bytes));
                }
                ranges.lock().unwrap().extend(mine);
            });
        }
    });
    let mut r = ranges.into_inner().unwrap();
    r.sort_unstable();
    for w in r.windows(2) {
        assert!(w[0].1 <= w[1].0, "overlap: {:?} and {:?}", w[0], w[1]);
    }
    let used: u64 = r.iter().map(|(a, b)| b - a).sum();
    // Waste: rounding (< 16 + align per request) and at most one chunk per slot.
    assert!(used > cap / 4, "only {used} of {cap} bytes served");
    assert!(heap.counter(COUNTER_FAILED_ALLOCS) >= THREADS as u64);
}

#[test]
fn bump_without_chunks_fills_exactly() {
    let heap = HostHeap::bump(16 * 1000, 0, 0);
    let got = std::sync::atomic::AtomicU64::new(0);
    thread::scope(|s| {
        for t in 0..THREADS {
            let (heap, got) = (&heap, &got);
            s.spawn(move || {
                let w = SoloLane { slot: t };
                // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
                while !unsafe { bump::chain_alloc(&heap.handle, &w, 16, 16) }.is_null() {
                    got.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
    });
    assert_eq!(got.into_inner(), 1000);
    assert!(
        heap.bump_offset() >= 16 * 1000,
        "requests that lost the race may overshoot"
    );
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    assert!(unsafe { bump::chain_alloc(&heap.handle, &SoloLane::default(), 0, 16) }.is_null());
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    assert!(unsafe { bump::chain_alloc(&heap.handle, &SoloLane::default(), 16, 3) }.is_null());
}

#[test]
fn bump_slot_sequence() {
    let heap = HostHeap::bump(96, 1, 5);
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    let b = unsafe { carve_kernels::bump::Bump::new(&heap.handle) };
    let got: Vec<_> = (0..4).map(|_| b.reserve_in_slot(0, 16)).collect();
    assert_eq!(got, vec![Some(0), Some(16), Some(32), Some(48)]);
}
