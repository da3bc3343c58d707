//! Warps whose lanes call the device heap's entry points (`carve_kernels::entry`: the code of
//! `carve_slab_alloc` and the rest) with different arguments, as `kernels/carve_heap.h` allows:
//! null heaps, heaps of another kind, two heaps in one warp, interior, misaligned and foreign
//! pointers, double frees. The lock-step warp fails a test when a collective names a lane that
//! has returned. Each lane's block must come from its own heap and be claimed there; bad frees
//! are counted and change nothing; every heap's invariants hold after each call.
#![cfg(not(carve_loom))]

mod support;

use carve_kernels::heap_layout::*;
use carve_kernels::warp::Warp;
use support::general::HostGeneral;
use support::lockstep::{self, Lane};
use support::{entry, HostHeap};

/// One call by a whole warp: lane `l` runs `f(lane, l)`; the lanes' results, by lane.
fn warp<R: Send>(f: impl Fn(&Lane<'_>, usize) -> R + Sync) -> Vec<R> {
    lockstep::run(32, 0, |w| f(w, w.lane() as usize))
}

/// A handle's address, as kernels pass it.
fn addr<T>(h: &T) -> u64 {
    h as *const T as u64
}

/// No two lanes got the same block.
fn assert_distinct(got: &[u64]) {
    let mut live: Vec<u64> = got.iter().copied().filter(|&p| p != 0).collect();
    let n = live.len();
    live.sort_unstable();
    live.dedup();
    assert_eq!(live.len(), n, "a block handed out twice: {got:x?}");
}

/// Each lane's block is a claimed block of `heap`; `want` says which lanes get one.
fn assert_from(heap: &HostHeap, got: &[u64], want: impl Fn(usize) -> bool) {
    for (l, &p) in got.iter().enumerate() {
        if !want(l) {
            continue;
        }
        let i = heap
            .index_of(p as *mut u8)
            .unwrap_or_else(|| panic!("lane {l}: {p:#x} is no block of its heap"));
        assert!(
            heap.is_claimed(i),
            "lane {l}: block {i} handed out unclaimed"
        );
    }
}

fn counters(heap: &HostHeap) -> (u64, u64, u64) {
    (
        heap.counter(COUNTER_FAILED_ALLOCS),
        heap.counter(COUNTER_DOUBLE_FREES),
        heap.counter(COUNTER_FOREIGN_FREES),
    )
}

/// Lanes 1 and 3 of every 4 pass a null heap or one of another kind: they get null, and the
/// others are served, by `carve_slab_alloc`, `carve_bump_alloc` and `carve_malloc`; the frees
/// of such lanes are ignored.
#[test]
fn lanes_with_null_or_wrong_kind_heaps_get_null_and_leave_the_others_whole() {
    let slab = HostHeap::slab(256, 32, None, FLAG_CHECKED_FREES);
    let bump = HostHeap::bump(4096, 0, 0);
    let general = HostGeneral::new(1);
    let served = |l: usize| l.is_multiple_of(2);
    // Lane l's heap: its own kind, null, its own kind, another kind.
    let pick = |l: usize, own: u64, other: u64| [own, 0, own, other][l % 4];
    let (s, b, g) = (
        addr(&*slab.handle),
        addr(&*bump.handle),
        general.ptr() as u64,
    );

    let got = warp(|w, l| entry::slab_alloc(pick(l, s, b) as *const _, w, 0) as u64);
    assert!(got.iter().enumerate().all(|(l, &p)| served(l) || p == 0));
    assert_from(&slab, &got, served);
    assert_distinct(&got);
    assert_eq!(slab.bits_set(), 16);
    slab.check();
    // Lanes without a slab pass their neighbour's block: ignored, as null heaps are.
    warp(|w, l| {
        let p = got[l & !1] as *mut u8;
        entry::slab_free(pick(l, s, b) as *const _, w, p)
    });
    assert_eq!(slab.bits_set(), 0);
    assert_eq!(counters(&slab), (0, 0, 0));
    slab.check();

    let got = warp(|w, l| entry::bump_alloc(pick(l, b, s) as *const _, w, 48, 16) as u64);
    let start = bump.data_start();
    for (l, &p) in got.iter().enumerate() {
        if served(l) {
            assert!(
                p >= start && p + 48 <= start + bump.bump_offset(),
                "lane {l}: {p:#x}"
            );
            assert_eq!(p % 16, 0);
        } else {
            assert_eq!(p, 0, "lane {l}");
        }
    }
    let mut live: Vec<u64> = got.iter().copied().filter(|&p| p != 0).collect();
    live.sort_unstable();
    assert!(live.windows(2).all(|w| w[1] - w[0] >= 48), "ranges overlap");
    assert_eq!(bump.counter(COUNTER_FAILED_ALLOCS), 0);

    let got = warp(|w, l| entry::malloc(pick(l, g, s) as *const _, w, 64, 0) as u64);
    for (l, &p) in got.iter().enumerate() {
        if served(l) {
            assert!(
                general.is_claimed(p as *mut u8),
                "lane {l}: {p:#x} unclaimed"
            );
        } else {
            assert_eq!(p, 0, "lane {l}");
        }
    }
    assert_distinct(&got);
    assert_eq!(general.total_in_use(), 16);
    general.check();
    warp(|w, l| entry::free(pick(l, g, s) as *const _, w, got[l & !1] as *mut u8));
    assert_eq!(general.total_in_use(), 0);
    assert_eq!(general.header_counter(COUNTER_FOREIGN_FREES), 0);
    assert_eq!(general.total_double_frees(), 0);
    general.check();
    assert_eq!(
        counters(&slab),
        (0, 0, 0),
        "the slab passed as a general heap"
    );
}

/// Even lanes pass slab `a`, odd lanes slab `b`: each lane's block is one of its own heap,
/// claimed there; each lane frees it into its own heap.
#[test]
fn two_slabs_in_one_warp_alloc_each_from_its_own() {
    let a = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let b = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let (ha, hb) = (addr(&*a.handle), addr(&*b.handle));
    let heap_of = |l: usize| if l.is_multiple_of(2) { ha } else { hb };
    let got = warp(|w, l| entry::slab_alloc(heap_of(l) as *const _, w, 0) as u64);
    assert_from(&a, &got, |l| l.is_multiple_of(2));
    assert_from(&b, &got, |l| l % 2 == 1);
    assert_distinct(&got);
    assert_eq!((a.bits_set(), b.bits_set()), (16, 16));
    a.check();
    b.check();
    warp(|w, l| entry::slab_free(heap_of(l) as *const _, w, got[l] as *mut u8));
    for h in [&a, &b] {
        assert_eq!(h.bits_set(), 0);
        assert_eq!(counters(h), (0, 0, 0));
        h.check();
    }
}

/// Lanes 0..16 free the run of slab `a` that one whole-warp allocation gave them while lanes
/// 16..32 free the same positions of slab `b` (one run of one word, in rank order, across the
/// warp): each heap clears exactly its own lanes' bits.
#[test]
fn two_slabs_in_one_warp_free_each_into_its_own() {
    let a = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let b = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let (ha, hb) = (addr(&*a.handle), addr(&*b.handle));
    // Whole warps on one heap: the same run of 32 blocks of each.
    let in_a = warp(|w, _| entry::slab_alloc(ha as *const _, w, 1) as u64);
    let in_b = warp(|w, _| entry::slab_alloc(hb as *const _, w, 1) as u64);
    assert_eq!(
        a.index_of(in_a[0] as *mut u8),
        b.index_of(in_b[0] as *mut u8)
    );
    let split = |l: usize| if l < 16 { (ha, in_a[l]) } else { (hb, in_b[l]) };
    warp(|w, l| {
        let (h, p) = split(l);
        entry::slab_free(h as *const _, w, p as *mut u8)
    });
    for l in 0..32 {
        let (ia, ib) = (
            a.index_of(in_a[l] as *mut u8).unwrap(),
            b.index_of(in_b[l] as *mut u8).unwrap(),
        );
        assert_eq!(a.is_claimed(ia), l >= 16, "a's block of lane {l}");
        assert_eq!(b.is_claimed(ib), l < 16, "b's block of lane {l}");
    }
    assert_eq!((a.bits_set(), b.bits_set()), (16, 16));
    a.check();
    b.check();

    // The rest, with both heaps in the call.
    let rest = |l: usize| if l < 16 { (hb, in_b[l]) } else { (ha, in_a[l]) };
    warp(|w, l| {
        let (h, p) = rest(l);
        entry::slab_free(h as *const _, w, p as *mut u8)
    });
    for h in [&a, &b] {
        assert_eq!(h.bits_set(), 0);
        assert_eq!(counters(h), (0, 0, 0));
        h.check();
    }
}

/// As above for two general heaps: one size in every lane, so the warp reaches the class's
/// straight-line paths.
#[test]
fn two_general_heaps_in_one_warp_malloc_and_free_each_in_its_own() {
    let (g, h) = (HostGeneral::new(1), HostGeneral::new(1));
    let (pg, ph) = (g.ptr() as u64, h.ptr() as u64);
    let heap_of = |l: usize| if l.is_multiple_of(2) { pg } else { ph };
    let got = warp(|w, l| entry::malloc(heap_of(l) as *const _, w, 64, 0) as u64);
    for (l, &p) in got.iter().enumerate() {
        let own = if l.is_multiple_of(2) { &g } else { &h };
        assert!(
            own.is_claimed(p as *mut u8),
            "lane {l}: {p:#x} not claimed in its heap"
        );
    }
    assert_distinct(&got);
    assert_eq!((g.total_in_use(), h.total_in_use()), (16, 16));
    g.check();
    h.check();
    warp(|w, l| entry::free(heap_of(l) as *const _, w, got[l] as *mut u8));
    for x in [&g, &h] {
        assert_eq!(x.total_in_use(), 0);
        assert_eq!(x.total_double_frees(), 0);
        assert_eq!(x.header_counter(COUNTER_FOREIGN_FREES), 0);
        x.check();
    }
}

/// One free call in which the lanes pass their own block, an interior pointer, a misaligned
/// one, a block of another heap, an address outside every heap, null, and their block with a
/// null heap: only the own blocks are freed; the bad pointers are counted as foreign frees.
#[test]
fn bad_frees_in_one_warp_are_counted_and_harmless() {
    let a = HostHeap::slab(256, 32, None, FLAG_CHECKED_FREES);
    let b = HostHeap::slab(64, 32, None, FLAG_CHECKED_FREES);
    let (ha, hb) = (addr(&*a.handle), addr(&*b.handle));
    let mine = warp(|w, _| entry::slab_alloc(ha as *const _, w, 0) as u64);
    let theirs = warp(|w, _| entry::slab_alloc(hb as *const _, w, 0) as u64);
    let outside = 0x7000_0000_0000u64;
    // (heap, pointer) of lane l; counted: interior, misaligned, another heap's, outside.
    let call = |l: usize| match l % 8 {
        1 => (ha, mine[l] + 8),
        2 => (ha, mine[l] + 1),
        3 => (ha, theirs[l]),
        4 => (ha, outside),
        5 => (ha, 0),
        6 => (0, mine[l]),
        _ => (ha, mine[l]),
    };
    warp(|w, l| {
        let (h, p) = call(l);
        entry::slab_free(h as *const _, w, p as *mut u8)
    });
    for (l, &p) in mine.iter().enumerate() {
        let freed = l % 8 == 0 || l % 8 == 7;
        let i = a.index_of(p as *mut u8).unwrap();
        assert_eq!(a.is_claimed(i), !freed, "lane {l}'s block");
    }
    assert_eq!(counters(&a), (0, 0, 16));
    assert_eq!(counters(&b), (0, 0, 0));
    assert_eq!(b.bits_set(), 32, "another heap's blocks stay claimed");
    a.check();
    b.check();

    // The same on a general heap; the class's slab counts pointers inside its segment, the
    // header those outside every class.
    let (g, other) = (HostGeneral::new(1), HostGeneral::new(1));
    let (pg, po) = (g.ptr() as u64, other.ptr() as u64);
    let mine = warp(|w, _| entry::malloc(pg as *const _, w, 64, 0) as u64);
    let theirs = warp(|w, _| entry::malloc(po as *const _, w, 64, 0) as u64);
    let call = |l: usize| match l % 8 {
        1 => (pg, mine[l] + 8),
        2 => (pg, mine[l] + 1),
        3 => (pg, theirs[l]),
        4 => (pg, outside),
        5 => (pg, 0),
        6 => (0, mine[l]),
        _ => (pg, mine[l]),
    };
    warp(|w, l| {
        let (h, p) = call(l);
        entry::free(h as *const _, w, p as *mut u8)
    });
    for (l, &p) in mine.iter().enumerate() {
        let freed = l % 8 == 0 || l % 8 == 7;
        assert_eq!(g.is_claimed(p as *mut u8), !freed, "lane {l}'s block");
    }
    let class = g.block_of(mine[0] as *mut u8).unwrap().0;
    assert_eq!(g.class_stats(class).3, 8, "interior and misaligned");
    assert_eq!(
        g.header_counter(COUNTER_FOREIGN_FREES),
        8,
        "outside every class"
    );
    assert_eq!(g.total_double_frees(), 0);
    assert_eq!(other.total_in_use(), 32);
    g.check();
    other.check();
}

/// Lanes of two classes in one free call, some passing interior pointers of their class: each
/// class's group frees as a warp of its own lanes, and its lanes whose pointer is no block
/// leave only after the group's collectives.
#[test]
fn a_class_group_with_interior_pointers_frees_the_rest() {
    let g = HostGeneral::new(1);
    let heap = g.ptr() as u64;
    let size = |l: usize| if l < 16 { 64 } else { 128 };
    let got = warp(|w, l| entry::malloc(heap as *const _, w, size(l), 0) as u64);
    let bad = |l: usize| l % 5 == 2;
    warp(|w, l| {
        let p = got[l] + if bad(l) { 8 } else { 0 };
        entry::free(heap as *const _, w, p as *mut u8)
    });
    for (l, &p) in got.iter().enumerate() {
        assert_eq!(g.is_claimed(p as *mut u8), bad(l), "lane {l}'s block");
    }
    let class = |l: usize| g.block_of(got[l] as *mut u8).unwrap().0;
    assert_eq!(
        g.class_stats(class(0)).3,
        3,
        "interior pointers of the 64 B class"
    );
    assert_eq!(
        g.class_stats(class(16)).3,
        3,
        "interior pointers of the 128 B class"
    );
    assert_eq!(g.total_double_frees(), 0);
    g.check();
}

/// Two lanes of one call free the same block, and a later warp frees a block again: each extra
/// free is counted and clears nothing; the same with two heaps in the warp.
#[test]
fn double_frees_in_one_warp_and_across_warps_are_counted() {
    let a = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let b = HostHeap::slab(128, 16, None, FLAG_CHECKED_FREES);
    let (ha, hb) = (addr(&*a.handle), addr(&*b.handle));
    let got = warp(|w, _| entry::slab_alloc(ha as *const _, w, 0) as u64);
    // Lane 1 frees lane 0's block too; its own stays out.
    warp(|w, l| {
        entry::slab_free(
            ha as *const _,
            w,
            got[if l == 1 { 0 } else { l }] as *mut u8,
        )
    });
    assert_eq!(counters(&a), (0, 1, 0));
    assert_eq!(a.bits_set(), 1);
    a.check();
    // Another warp frees lane 0's and lane 5's blocks again, and lane 1's for the first time.
    warp(|w, l| {
        let p = match l {
            0 | 1 | 5 => got[l] as *mut u8,
            _ => std::ptr::null_mut(),
        };
        entry::slab_free(ha as *const _, w, p)
    });
    assert_eq!(counters(&a), (0, 3, 0));
    assert_eq!(a.bits_set(), 0);
    a.check();

    // Both heaps in one warp, a double free in each.
    let heap_of = |l: usize| if l < 16 { ha } else { hb };
    let got = warp(|w, l| entry::slab_alloc(heap_of(l) as *const _, w, 0) as u64);
    assert_from(&a, &got, |l| l < 16);
    assert_from(&b, &got, |l| l >= 16);
    let twice = |l: usize| match l {
        3 => got[2],
        20 => got[21],
        _ => got[l],
    };
    warp(|w, l| entry::slab_free(heap_of(l) as *const _, w, twice(l) as *mut u8));
    assert_eq!(counters(&a), (0, 4, 0));
    assert_eq!(counters(&b), (0, 1, 0));
    assert_eq!((a.bits_set(), b.bits_set()), (1, 1));
    let left = |l: usize| if l == 3 || l == 20 { got[l] } else { 0 };
    warp(|w, l| entry::slab_free(heap_of(l) as *const _, w, left(l) as *mut u8));
    for h in [&a, &b] {
        assert_eq!(h.bits_set(), 0);
        h.check();
    }
}

/// A double free after the block went to a new owner cannot be told from the new owner's free:
/// it frees the new owner's block, uncounted (`kernels/carve_heap.h` says so). The new owner's
/// own free is then the one counted.
#[test]
fn a_stale_free_after_reallocation_frees_the_new_owners_block() {
    let a = HostHeap::slab(32, 16, None, FLAG_CHECKED_FREES);
    let h = addr(&*a.handle);
    let first = warp(|w, _| entry::slab_alloc(h as *const _, w, 0) as u64);
    warp(|w, l| entry::slab_free(h as *const _, w, first[l] as *mut u8));
    // Every block of the heap again: lane 0's old block has a new owner.
    let second = warp(|w, _| entry::slab_alloc(h as *const _, w, 0) as u64);
    let stale = first[0];
    let owner = second.iter().position(|&p| p == stale).unwrap();
    let i = a.index_of(stale as *mut u8).unwrap();
    warp(|w, l| {
        let p = if l == 0 { stale } else { 0 };
        entry::slab_free(h as *const _, w, p as *mut u8)
    });
    assert!(
        !a.is_claimed(i),
        "the stale free freed the new owner's block"
    );
    assert_eq!(counters(&a), (0, 0, 0), "and nothing counted it");
    a.check();
    warp(|w, l| entry::slab_free(h as *const _, w, second[l] as *mut u8));
    assert_eq!(
        counters(&a),
        (0, 1, 0),
        "lane {owner}'s own free is the one counted"
    );
    assert_eq!(a.bits_set(), 0);
    a.check();
}

/// Stress: four warps at once (real threads, 32 lanes each), many rounds; each lane allocates
/// from slab `a`, slab `b` or a null heap at random, or frees a block it holds, into its own
/// heap or, now and then, into the other one (a foreign free, the block kept). Blocks carry
/// their owner's tag, checked before each free: no block is held twice. At the end every count
/// matches the ledger and both heaps' invariants hold.
#[test]
fn four_warps_of_mixed_heaps_keep_every_block_and_count() {
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
    let a = HostHeap::slab(700, 32, Some(1), FLAG_CHECKED_FREES);
    let b = HostHeap::slab(300, 32, Some(1), FLAG_CHECKED_FREES);
    let heaps = [&a, &b];
    let addrs = [addr(&*a.handle), addr(&*b.handle)];
    // Per heap: failed allocations and foreign frees the lanes saw.
    let nulls = [AtomicU64::new(0), AtomicU64::new(0)];
    let foreign = [AtomicU64::new(0), AtomicU64::new(0)];
    let rounds = if cfg!(miri) { 6 } else { 120 };
    std::thread::scope(|s| {
        for warp_index in 0..4u32 {
            let (heaps, nulls, foreign) = (&heaps, &nulls, &foreign);
            s.spawn(move || {
                lockstep::run(32, warp_index, |w| {
                    let l = w.lane() as u64;
                    let mut rng =
                        (l + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (warp_index as u64) << 40;
                    let mut held: Vec<(usize, u64, u64)> = Vec::new();
                    for round in 0..rounds {
                        support::xorshift(&mut rng);
                        let seed = warp_index * 1000 + round;
                        let tag = warp_index as u64 * 1_000_000 + round as u64 * 100 + l;
                        let alloc = held.len() < 8 && !rng.is_multiple_of(3);
                        // Allocations, then frees: the emulator's `active()` does not tell
                        // lanes at different call sites apart.
                        if alloc {
                            let pick = (rng >> 8) % 5;
                            let (which, heap) = match pick {
                                0 => (None, 0),
                                1 | 2 => (Some(0), addrs[0]),
                                _ => (Some(1), addrs[1]),
                            };
                            let p = entry::slab_alloc(heap as *const _, w, seed) as u64;
                            match which {
                                None => assert_eq!(p, 0),
                                Some(h) if p == 0 => {
                                    nulls[h].fetch_add(1, Relaxed);
                                }
                                Some(h) => {
                                    let i = heaps[h].index_of(p as *mut u8).expect("own heap");
                                    assert!(heaps[h].is_claimed(i));
                                    // SAFETY: the block is this lane's until it frees it.
                                    unsafe { (p as *mut u64).write_volatile(tag) };
                                    held.push((h, p, tag));
                                }
                            }
                        }
                        w.sync();
                        if !alloc && !held.is_empty() {
                            let j = ((rng >> 16) % held.len() as u64) as usize;
                            let (h, p, tag) = held[j];
                            // SAFETY: as above.
                            let seen = unsafe { (p as *const u64).read_volatile() };
                            assert_eq!(seen, tag, "block {p:#x} held twice");
                            let misroute = (rng >> 24).is_multiple_of(7);
                            let into = if misroute { 1 - h } else { h };
                            if misroute {
                                foreign[into].fetch_add(1, Relaxed);
                            } else {
                                held.swap_remove(j);
                            }
                            entry::slab_free(addrs[into] as *const _, w, p as *mut u8);
                        }
                        w.sync();
                    }
                    for (h, p, _) in held {
                        entry::slab_free(addrs[h] as *const _, w, p as *mut u8);
                    }
                });
            });
        }
    });
    for (h, heap) in heaps.iter().enumerate() {
        assert_eq!(heap.bits_set(), 0, "heap {h}");
        assert_eq!(
            counters(heap),
            (nulls[h].load(Relaxed), 0, foreign[h].load(Relaxed)),
            "heap {h}"
        );
        heap.check();
    }
}
