//! The per-thread default stream is a different stream on every thread: its id differs between
//! threads, and a suballocator used from two threads on `StreamRef::PER_THREAD` orders a block
//! that one thread frees before the other may have it. CPU only: host memory, a `CheckedOrder`.

mod common;

use std::collections::HashSet;
use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::{CheckedOrder, FixedSizeOptions, OrderFaults, PoolOptions, StreamOrder};
use carve::{
    BinningMemoryResource, FixedSizeMemoryResource, HostMemoryResource, MemoryResource,
    PoolMemoryResource, StreamId, StreamRef,
};
use common::rng::{seeded, RngExt};

/// `StreamRef::PER_THREAD`'s id, taken on a new thread.
fn per_thread_id_on_a_new_thread() -> StreamId {
    std::thread::spawn(|| {
        let id = StreamRef::PER_THREAD.id();
        assert_eq!(id, StreamRef::PER_THREAD.id(), "stable within a thread");
        id
    })
    .join()
    .unwrap()
}

#[test]
fn per_thread_stream_ids_differ_between_threads() {
    let here = StreamRef::PER_THREAD.id();
    let a = per_thread_id_on_a_new_thread();
    let b = per_thread_id_on_a_new_thread();
    assert_ne!(a, b, "two threads' per-thread streams share an id");
    assert_ne!(here, a);
    assert_ne!(here, b);
    for other in [
        StreamRef::DEFAULT,
        StreamRef::simulated(0),
        StreamRef::simulated(1),
    ] {
        assert_ne!(here, other.id(), "{other:?}");
    }
}

/// Thread A fills `mr` with blocks of `bytes` and frees them all on its per-thread stream; then
/// thread B allocates `bytes` on its own. Returns A's blocks and B's.
fn free_on_one_thread_then_allocate_on_another(
    mr: &(dyn MemoryResource + Sync),
    bytes: usize,
    count: usize,
) -> (HashSet<usize>, NonNull<u8>) {
    let a_blocks = std::thread::scope(|s| {
        s.spawn(|| {
            let blocks: Vec<_> = (0..count)
                .map(|_| mr.allocate(StreamRef::PER_THREAD, bytes, 256).unwrap())
                .collect();
            let addrs = blocks.iter().map(|p| p.as_ptr() as usize).collect();
            for p in blocks {
                // SAFETY: allocated above from `mr` with these arguments, freed once.
                unsafe { mr.deallocate(StreamRef::PER_THREAD, p, bytes, 256) }.unwrap();
            }
            addrs
        })
        .join()
        .unwrap()
    });
    let b = std::thread::scope(|s| {
        s.spawn(|| {
            let p = mr.allocate(StreamRef::PER_THREAD, bytes, 256).unwrap();
            p.as_ptr() as usize
        })
        .join()
        .unwrap()
    });
    (a_blocks, NonNull::new(b as *mut u8).unwrap())
}

/// B's block came from A (the resource was full), and the checker saw that crossing ordered.
fn assert_crossing_ordered(order: &CheckedOrder, a_blocks: &HashSet<usize>, b: NonNull<u8>) {
    assert!(
        a_blocks.contains(&(b.as_ptr() as usize)),
        "thread B should have been handed one of thread A's blocks"
    );
    let violations = order.violations();
    assert!(violations.is_empty(), "{violations:#?}");
    let counts = order.counts();
    assert!(
        counts.crossings >= 1,
        "thread B reused a block thread A freed on its per-thread stream, but no ordering call \
         covered a change of stream: {counts:?}"
    );
}

#[test]
fn fixed_size_orders_a_block_freed_on_another_threads_per_thread_stream() {
    let order = CheckedOrder::new(OrderFaults::default());
    let mr = order.check(
        FixedSizeMemoryResource::new(
            order.upstream(HostMemoryResource::new()),
            FixedSizeOptions::new(256)
                .blocks_per_refill(16)
                .max_refills(1)
                .order(order.clone() as Arc<dyn StreamOrder>),
        )
        .unwrap(),
    );
    let (a, b) = free_on_one_thread_then_allocate_on_another(&mr, 256, 16);
    assert_crossing_ordered(&order, &a, b);
    // SAFETY: B's block, from `mr`, freed once.
    unsafe { mr.deallocate(StreamRef::PER_THREAD, b, 256, 256) }.unwrap();
}

#[test]
fn pool_orders_a_block_freed_on_another_threads_per_thread_stream() {
    let order = CheckedOrder::new(OrderFaults::default());
    let mr = order.check(
        PoolMemoryResource::new(
            order.upstream(HostMemoryResource::new()),
            PoolOptions::new(0)
                .maximum(1 << 20)
                .order(order.clone() as Arc<dyn StreamOrder>),
        )
        .unwrap(),
    );
    let (a, b) = free_on_one_thread_then_allocate_on_another(&mr, 1 << 20, 1);
    assert_crossing_ordered(&order, &a, b);
    // SAFETY: B's block, from `mr`, freed once.
    unsafe { mr.deallocate(StreamRef::PER_THREAD, b, 1 << 20, 256) }.unwrap();
}

#[test]
fn binning_orders_a_block_freed_on_another_threads_per_thread_stream() {
    let order = CheckedOrder::new(OrderFaults::default());
    let bins = BinningMemoryResource::over_pool(
        order.upstream(HostMemoryResource::new()),
        8,
        12,
        PoolOptions::new(0)
            .maximum(4 << 20)
            .order(order.clone() as Arc<dyn StreamOrder>),
    )
    .unwrap();
    let mr = order.check(bins);
    // The 4 KiB bin takes whole 4 MiB refills: one fills the pool.
    let (a, b) = free_on_one_thread_then_allocate_on_another(&mr, 4096, 1024);
    assert_crossing_ordered(&order, &a, b);
    // SAFETY: B's block, from `mr`, freed once.
    unsafe { mr.deallocate(StreamRef::PER_THREAD, b, 4096, 256) }.unwrap();
}

/// Four threads allocate and free at random on their per-thread streams over a small
/// fixed-size resource and a small pool, so blocks keep changing threads: every change follows
/// a covering ordering call.
#[test]
fn threads_on_per_thread_streams_never_reuse_a_block_unordered() {
    let order = CheckedOrder::new(OrderFaults::default());
    let fixed = order.check(
        FixedSizeMemoryResource::new(
            order.upstream(HostMemoryResource::new()),
            FixedSizeOptions::new(512)
                .blocks_per_refill(8)
                .max_refills(4)
                .order(order.clone() as Arc<dyn StreamOrder>),
        )
        .unwrap(),
    );
    let pool = order.check(
        PoolMemoryResource::new(
            order.upstream(HostMemoryResource::new()),
            PoolOptions::new(0)
                .maximum(256 << 10)
                .order(order.clone() as Arc<dyn StreamOrder>)
                .shards(2),
        )
        .unwrap(),
    );
    let resources: [(&(dyn MemoryResource + Sync), usize); 2] = [(&fixed, 512), (&pool, 16 << 10)];
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let resources = &resources;
            s.spawn(move || {
                let mut rng = seeded(0x9E37_79B9_7F4A_7C15u64.wrapping_mul(t + 1));
                let mut live: Vec<(usize, NonNull<u8>, usize)> = Vec::new();
                for _ in 0..4000 {
                    let seed: u64 = rng.random();
                    let which = (seed >> 8) as usize % 2;
                    let (mr, max) = resources[which];
                    if live.len() < 4 && seed % 3 != 0 {
                        let bytes = 1 + (seed >> 20) as usize % max;
                        // Full is fine: other threads hold the rest.
                        if let Ok(p) = mr.allocate(StreamRef::PER_THREAD, bytes, 256) {
                            live.push((which, p, bytes));
                        }
                    } else if let Some((w, p, bytes)) = live.pop() {
                        // SAFETY: allocated above from this resource, freed once.
                        unsafe {
                            resources[w]
                                .0
                                .deallocate(StreamRef::PER_THREAD, p, bytes, 256)
                        }
                        .unwrap();
                    }
                }
                for (w, p, bytes) in live {
                    // SAFETY: as above.
                    unsafe {
                        resources[w]
                            .0
                            .deallocate(StreamRef::PER_THREAD, p, bytes, 256)
                    }
                    .unwrap();
                }
            });
        }
    });
    let violations = order.violations();
    assert!(violations.is_empty(), "{violations:#?}");
    assert!(order.counts().crossings > 0, "{:?}", order.counts());
}
