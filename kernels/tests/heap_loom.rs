//! loom models of the device heap's races, on the host build (each thread a warp of one lane).
//! Run: `RUSTFLAGS="--cfg carve_loom" cargo test --release -p carve-kernels --test heap_loom`
#![cfg(carve_loom)]

mod support;

use carve_kernels::bump::Bump;
use carve_kernels::heap_layout::*;
use carve_kernels::slab::Slab;
use carve_kernels::warp::SoloLane;
use loom::sync::Arc;
use loom::thread;
use support::HostHeap;

/// A free racing two allocations on a 2-block heap: no block is handed out twice, the freed
/// block is reusable, and the counts agree with the bitmap at the end.
#[test]
fn slab_alloc_races_free() {
    loom::model(|| {
        let heap = Arc::new(HostHeap::slab(2, 16, Some(0), FLAG_CHECKED_FREES));
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let slab = unsafe { Slab::new(&heap.handle) };
        let w = SoloLane::default();
        let a = slab.alloc(&w, 0, true) as u64;
        assert_ne!(a, 0);
        let h2 = heap.clone();
        let t = thread::spawn(move || {
            // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
            let slab = unsafe { Slab::new(&h2.handle) };
            slab.free_index(&SoloLane { slot: 1 }, slab.index_of(a as *mut u8).unwrap());
        });
        let b = slab.alloc(&w, 0, true) as u64;
        let c = slab.alloc(&w, 1, true) as u64;
        t.join().unwrap();
        // Two blocks, one freed concurrently: b always succeeds (one block was never taken).
        assert_ne!(b, 0);
        assert_ne!(b, c);
        let live = [b, c].iter().filter(|&&p| p != 0).count() as u64;
        assert_eq!(heap.in_use(), live);
        assert_eq!(heap.bits_set(), live);
        if c == 0 {
            // The free had not happened yet: once it has, the block comes back.
            assert_ne!(slab.alloc(&w, 0, true), core::ptr::null_mut());
        }
    });
}

/// Two warps with the same hint on a 2-block heap: both reserve, both try bit 0 on the fast
/// path; the loser claims the other bit on the slow path. Both succeed with distinct blocks.
#[test]
fn slab_fast_path_loser_falls_back() {
    loom::model(|| {
        let heap = Arc::new(HostHeap::slab(2, 16, Some(0), FLAG_CHECKED_FREES));
        let h2 = heap.clone();
        let t = thread::spawn(move || {
            // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
            unsafe { Slab::new(&h2.handle) }.alloc(&SoloLane { slot: 1 }, 0, true) as u64
        });
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let slab = unsafe { Slab::new(&heap.handle) };
        let a = slab.alloc(&SoloLane::default(), 0, true) as u64;
        let b = t.join().unwrap();
        assert!(a != 0 && b != 0 && a != b, "{a:#x} {b:#x}");
        assert_eq!((heap.in_use(), heap.bits_set()), (2, 2));
        assert!(slab.alloc(&SoloLane::default(), 0, true).is_null());
        assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 1);
    });
}

/// Two reservations racing for the last block of a shard: exactly one gets it, and the loser's
/// excess is given back.
#[test]
fn slab_reserve_is_exact() {
    loom::model(|| {
        let heap = Arc::new(HostHeap::slab(3, 16, Some(0), 0));
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let slab = unsafe { Slab::new(&heap.handle) };
        assert_eq!(slab.reserve(0, 2), 2);
        let h2 = heap.clone();
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let t = thread::spawn(move || unsafe { Slab::new(&h2.handle) }.reserve(0, 2));
        let mine = slab.reserve(0, 1);
        let theirs = t.join().unwrap();
        assert_eq!(mine + theirs, 1);
        assert_eq!(heap.in_use(), 3);
    });
}

/// The bump reservation: a chunk with room for one of two racing requests. Exactly one fits;
/// the other closes the chunk and installs the next from the global offset; the ranges are
/// disjoint and inside the arena. (A third warp would wait for the closer's store; loom explores
/// a spinning load reading the old value forever, so that wait is exercised by the 16-thread
/// stress test instead.)
#[test]
fn bump_slot_reservation() {
    loom::model(|| {
        // Two 32-byte chunks. The slot's first chunk is opened before the race.
        let heap = Arc::new(HostHeap::bump(64, 1, 5));
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let b = unsafe { Bump::new(&heap.handle) };
        assert_eq!(b.reserve_in_slot(0, 16), Some(0));
        let h2 = heap.clone();
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let t = thread::spawn(move || unsafe { Bump::new(&h2.handle) }.reserve_in_slot(0, 16));
        let mine = b.reserve_in_slot(0, 16).expect("room");
        let theirs = t.join().unwrap().expect("room");
        let mut got = [mine, theirs];
        got.sort_unstable();
        assert_eq!(
            got,
            [16, 32],
            "one fills the first chunk, one opens the second"
        );
        assert_eq!(heap.bump_offset(), 64);
        // Both chunks are spoken for: the next request is refused at the arena's end.
        assert_eq!(b.reserve_in_slot(0, 32), None);
    });
}

/// Two warps racing on the global offset for the arena's last bytes: one fits, one is refused.
#[test]
fn bump_global_reservation_is_exact_for_the_winner() {
    loom::model(|| {
        let heap = Arc::new(HostHeap::bump(48, 0, 0));
        let h2 = heap.clone();
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let t = thread::spawn(move || unsafe { Bump::new(&h2.handle) }.reserve_global(32));
        // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
        let mine = unsafe { Bump::new(&heap.handle) }.reserve_global(32);
        let theirs = t.join().unwrap();
        assert!(
            mine.is_some() != theirs.is_some(),
            "exactly one of two 32-byte requests fits in 48"
        );
        assert_eq!(mine.or(theirs), Some(0));
        // The loser may have added before it saw the end: never more than the two requests.
        assert!(heap.bump_offset() == 32 || heap.bump_offset() == 64);
    });
}

/// A slab whose shard counts are cursors (a general heap's class), of `cap` blocks in one shard.
fn cursor_heap(cap: u64) -> Arc<HostHeap> {
    Arc::new(HostHeap::slab(
        cap,
        16,
        Some(0),
        FLAG_CHECKED_FREES | FLAG_CURSOR_SHARDS,
    ))
}

/// The cursor view of `heap`.
fn cursors(heap: &HostHeap) -> Slab<'_> {
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { Slab::new(&heap.handle) }.cursors(true)
}

/// With cursors, a free (one `fetch_and`, no count) racing two allocations on a 2-block slab:
/// no block is handed out twice, the bitmap holds exactly the live blocks, and a block the
/// race left free comes back.
#[test]
fn cursor_slab_alloc_races_free() {
    loom::model(|| {
        let heap = cursor_heap(2);
        let w = SoloLane::default();
        let a = cursors(&heap).alloc(&w, 0, true) as u64;
        assert_ne!(a, 0);
        let h2 = heap.clone();
        let t = thread::spawn(move || {
            let slab = cursors(&h2);
            slab.free_index(&SoloLane { slot: 1 }, slab.index_of(a as *mut u8).unwrap());
        });
        let b = cursors(&heap).alloc(&w, 0, true) as u64;
        let c = cursors(&heap).alloc(&w, 1, true) as u64;
        t.join().unwrap();
        assert_ne!(b, 0, "one block was never taken");
        assert_ne!(b, c);
        let live = [b, c].iter().filter(|&&p| p != 0).count() as u64;
        assert_eq!(heap.bits_set(), live);
        if c == 0 {
            assert!(!cursors(&heap).alloc(&w, 0, true).is_null());
        }
        assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    });
}

/// Two warps free the same block at once (a double free across warps, before any
/// reallocation) while a third allocates: the block is cleared once, the other free is
/// counted, and no block is handed out twice.
#[test]
fn cursor_slab_double_free_across_warps() {
    loom::model(|| {
        let heap = cursor_heap(2);
        let w = SoloLane::default();
        let a = cursors(&heap).alloc(&w, 0, true) as u64;
        let b = cursors(&heap).alloc(&w, 0, true) as u64;
        assert!(a != 0 && b != 0 && a != b);
        let frees: Vec<_> = (1..3)
            .map(|slot| {
                let h = heap.clone();
                thread::spawn(move || {
                    let slab = cursors(&h);
                    slab.free_index(&SoloLane { slot }, slab.index_of(a as *mut u8).unwrap());
                })
            })
            .collect();
        for t in frees {
            t.join().unwrap();
        }
        assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 1);
        assert_eq!(heap.bits_set(), 1);
        let c = cursors(&heap).alloc(&w, 0, true) as u64;
        assert_eq!(c, a, "the one free block");
        assert!(cursors(&heap).alloc(&w, 0, true).is_null());
        assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 1);
    });
}

/// Two warps race for the last block of a slab with cursors (nothing reserves it): exactly one
/// gets it, the other returns null and counts the failure, with no spin.
#[test]
fn cursor_slab_allocs_race_for_the_last_block() {
    loom::model(|| {
        let heap = cursor_heap(2);
        let held = cursors(&heap).alloc(&SoloLane::default(), 1, true) as u64;
        assert_ne!(held, 0);
        let h2 = heap.clone();
        let t = thread::spawn(move || cursors(&h2).alloc(&SoloLane { slot: 1 }, 0, true) as u64);
        let mine = cursors(&heap).alloc(&SoloLane::default(), 1, true) as u64;
        let theirs = t.join().unwrap();
        assert!((mine == 0) != (theirs == 0), "{mine:#x} {theirs:#x}");
        assert_ne!(mine.max(theirs), held);
        assert_eq!(heap.bits_set(), 2);
        assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 1);
    });
}

/// A 3-block slab with cursors whose first two allocations, `a` and `b`, are held: the heap,
/// both blocks, and the run they form (its first index), in either order.
fn two_held_in_a_run() -> (Arc<HostHeap>, u64, u64, u64) {
    let heap = cursor_heap(3);
    let w = SoloLane::default();
    let a = cursors(&heap).alloc(&w, 0, true) as u64;
    let b = cursors(&heap).alloc(&w, 0, true) as u64;
    let slab = cursors(&heap);
    let (i, j) = (
        slab.index_of(a as *mut u8).unwrap(),
        slab.index_of(b as *mut u8).unwrap(),
    );
    assert_eq!(i.abs_diff(j), 1, "blocks {i} and {j} are no run");
    (heap, a, b, i.min(j))
}

/// Two warps free the same run of two blocks at once, each with one `fetch_and`, as the leaders
/// of `carve_free`'s mixed class groups do (`Slab::free_blocks`, a run inside one word): each block is cleared once,
/// each second clear is counted, and the blocks come back once each.
#[test]
fn cursor_slab_run_double_free_across_warps() {
    loom::model(|| {
        let (heap, a, b, base) = two_held_in_a_run();
        let w = SoloLane::default();
        let frees: Vec<_> = (1..3)
            .map(|slot| {
                let h = heap.clone();
                thread::spawn(move || cursors(&h).free_blocks(&SoloLane { slot }, base, 2))
            })
            .collect();
        for t in frees {
            assert!(t.join().unwrap());
        }
        assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 2);
        assert_eq!(heap.bits_set(), 0);
        let mut got: Vec<u64> = (0..3)
            .map(|_| cursors(&heap).alloc(&w, 0, true) as u64)
            .collect();
        got.sort_unstable();
        got.dedup();
        assert_eq!(got.len(), 3, "a block handed out twice: {got:x?}");
        assert!(got.contains(&a) && got.contains(&b) && !got.contains(&0));
        assert!(cursors(&heap).alloc(&w, 0, true).is_null());
    });
}

/// A run across two bitmap words freed in its two parts at once, each part by its own lane, as
/// `carve_free`'s mixed step frees a group's run (the leader clears the first word's part, the
/// lane of the run's first block in the next word that word's), while another warp frees the
/// whole run: each block is cleared once, each second clear is counted, and the bitmap ends
/// clear.
#[test]
fn cursor_slab_run_across_words_freed_in_parts_and_whole() {
    loom::model(|| {
        let heap = cursor_heap(66);
        assert_eq!(cursors(&heap).claim_run(&SoloLane::default(), 63, 2), 0b11);
        let frees: Vec<_> = [(63, 1), (64, 1), (63, 2)]
            .into_iter()
            .zip(1..)
            .map(|((base, lanes), slot)| {
                let h = heap.clone();
                thread::spawn(move || cursors(&h).free_blocks(&SoloLane { slot }, base, lanes))
            })
            .collect();
        for t in frees {
            assert!(t.join().unwrap());
        }
        assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 2);
        assert_eq!(heap.bits_set(), 0);
    });
}

/// A warp frees a run of two blocks (`Slab::free_blocks`) while another allocates from the same
/// bitmap word: the allocation gets a block that was free when it claimed it, never a held
/// one, no double free is counted, and the bitmap ends holding exactly the live block.
#[test]
fn cursor_slab_run_free_races_alloc() {
    loom::model(|| {
        let (heap, _, _, base) = two_held_in_a_run();
        let w = SoloLane::default();
        let h2 = heap.clone();
        let t = thread::spawn(move || cursors(&h2).free_blocks(&SoloLane { slot: 1 }, base, 2));
        let c = cursors(&heap).alloc(&w, 0, true) as u64;
        assert!(t.join().unwrap());
        assert_ne!(c, 0, "a block was free throughout");
        assert_eq!(heap.bits_set(), 1);
        assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
        let d = cursors(&heap).alloc(&w, 0, true) as u64;
        let e = cursors(&heap).alloc(&w, 0, true) as u64;
        assert!(d != 0 && e != 0 && d != e && c != d && c != e);
        assert!(cursors(&heap).alloc(&w, 0, true).is_null());
    });
}
