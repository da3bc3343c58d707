//! `CarveAlloc`, the `GlobalAlloc` that Rust kernels use, on heaps in host memory: the host build
//! sends it to the same slab and bump chains as the device entry points, over a warp of one lane.
#![cfg(not(carve_loom))]

mod support;

use std::alloc::{GlobalAlloc, Layout};
use std::thread;

use carve_kernels::global_alloc::CarveAlloc;
use carve_kernels::heap_layout::*;
use support::HostHeap;

fn layout(size: usize, align: usize) -> Layout {
    Layout::from_size_align(size, align).unwrap()
}

fn on(heap: &HostHeap) -> CarveAlloc {
    let a = CarveAlloc::new();
    // SAFETY: the heap outlives the allocator in every test.
    unsafe { a.set_heap(&*heap.handle) };
    a
}

fn in_data(heap: &HostHeap, p: *mut u8, bytes: u64) -> bool {
    let start = heap.data_start();
    let end = start + heap.handle.capacity * heap.handle.block_size.max(1);
    p as u64 >= start && p as u64 + bytes <= end
}

#[test]
fn slab_serves_blocks_grows_within_them_and_frees_them() {
    // 48-byte blocks: 16-aligned (host test arrays guarantee no more).
    let heap = HostHeap::slab(64, 48, None, FLAG_CHECKED_FREES);
    let a = on(&heap);
    let l = layout(32, 8);
    // SAFETY: a non-zero layout; every pointer below is used within its size and freed once.
    unsafe {
        let p = a.alloc(l);
        assert!(!p.is_null() && in_data(&heap, p, 48) && (p as usize).is_multiple_of(16));
        p.write_bytes(0xAB, 32);
        assert_eq!(a.realloc(p, l, 48), p, "grows in place within the block");
        assert!(a.realloc(p, layout(48, 8), 49).is_null(), "past the block");
        assert_eq!(*p.add(31), 0xAB, "a refused realloc leaves the block alone");
        assert!(a.alloc(layout(49, 8)).is_null(), "larger than a block");
        assert!(
            a.alloc(layout(16, 32)).is_null(),
            "more aligned than a block"
        );
        assert_eq!(heap.in_use(), 1, "refusals do not reach the heap");
        a.dealloc(p, layout(48, 8));
    }
    assert_eq!((heap.in_use(), heap.bits_set()), (0, 0));
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 0);
    // Exhaustion is null, counted by the heap.
    // SAFETY: as above.
    let ps: Vec<*mut u8> = (0..65).map(|_| unsafe { a.alloc(l) }).collect();
    assert_eq!(ps.iter().filter(|p| p.is_null()).count(), 1);
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 1);
    for &p in ps.iter().filter(|p| !p.is_null()) {
        // SAFETY: each block once.
        unsafe { a.dealloc(p, l) };
    }
    assert_eq!(heap.in_use(), 0);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 0);
}

#[test]
fn slab_chain_serves_every_segment() {
    let mut first = HostHeap::slab(64, 64, None, FLAG_CHECKED_FREES);
    let second = HostHeap::slab(100, 64, None, FLAG_CHECKED_FREES);
    first.handle.next = &*second.handle as *const HeapHandle as u64;
    let a = on(&first);
    let l = layout(64, 16);
    // SAFETY: non-zero layouts; each block freed once.
    let ps: Vec<*mut u8> = (0..164).map(|_| unsafe { a.alloc(l) }).collect();
    assert!(ps.iter().all(|p| !p.is_null()), "both segments serve");
    // SAFETY: as above.
    assert!(unsafe { a.alloc(l) }.is_null());
    assert_eq!((first.in_use(), second.in_use()), (64, 100));
    for &p in &ps {
        // SAFETY: each block once.
        unsafe { a.dealloc(p, l) };
    }
    assert_eq!((first.in_use(), second.in_use()), (0, 0));
    assert_eq!(first.counter(COUNTER_FOREIGN_FREES), 0);
}

#[test]
fn bump_serves_any_size_and_grows_by_copying() {
    let heap = HostHeap::bump(4096, 0, 0);
    let a = on(&heap);
    // SAFETY: non-zero layouts; pointers used within their sizes.
    unsafe {
        let p = a.alloc(layout(24, 8));
        assert!(!p.is_null() && in_data(&heap, p, 24) && (p as usize).is_multiple_of(8));
        for k in 0..24 {
            p.add(k).write(k as u8);
        }
        assert_eq!(a.realloc(p, layout(24, 8), 8), p, "shrinks in place");
        let q = a.realloc(p, layout(24, 8), 1000);
        assert!(!q.is_null() && q != p && in_data(&heap, q, 1000));
        assert!(
            (0..24).all(|k| *q.add(k) == k as u8),
            "the copy keeps the bytes"
        );
        let used = heap.bump_offset();
        a.dealloc(q, layout(1000, 8));
        assert_eq!(heap.bump_offset(), used, "dealloc gives nothing back");
        assert!(
            a.alloc(layout(8, 8192)).is_null(),
            "alignment past the arena's"
        );
        assert!(a.alloc(layout(4096, 8)).is_null(), "exhausted");
    }
    assert_eq!(heap.counter(COUNTER_FAILED_ALLOCS), 1);
}

#[test]
fn no_heap_or_an_unformatted_one_is_null() {
    let a = CarveAlloc::new();
    // SAFETY: a non-zero layout; nothing is allocated.
    assert!(unsafe { a.alloc(layout(8, 8)) }.is_null());
    let mut heap = HostHeap::slab(64, 64, None, 0);
    heap.handle.magic = 0;
    let a = on(&heap);
    // SAFETY: as above.
    assert!(unsafe { a.alloc(layout(8, 8)) }.is_null());
    assert_eq!(heap.in_use(), 0);
}

/// 16 threads share one allocator and one slab, as a grid's threads do: no block is shared, every
/// grown allocation keeps its bytes, and every block comes back.
#[test]
fn threads_sharing_the_allocator_never_share_a_block() {
    const THREADS: u32 = 16;
    let cap = 16 * 8;
    let heap = HostHeap::slab(cap, 64, None, FLAG_CHECKED_FREES);
    let a = on(&heap);
    thread::scope(|s| {
        for t in 0..THREADS {
            let a = &a;
            s.spawn(move || {
                for round in 0..2000u32 {
                    // Distinct between threads at any moment.
                    let tag = (t * 16 + round % 16) as u8;
                    let small = layout(40, 8);
                    // SAFETY: non-zero layouts; the block is this thread's until freed, once.
                    unsafe {
                        let held: Vec<*mut u8> = (0..4).map(|_| a.alloc(small)).collect();
                        for &p in held.iter().filter(|p| !p.is_null()) {
                            p.write_bytes(tag, 40);
                        }
                        for &p in held.iter().filter(|p| !p.is_null()) {
                            let p = a.realloc(p, small, 64);
                            assert!((0..40).all(|k| *p.add(k) == tag), "thread {t}");
                            a.dealloc(p, layout(64, 8));
                        }
                    }
                }
            });
        }
    });
    assert_eq!((heap.in_use(), heap.bits_set()), (0, 0));
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 0);
}
