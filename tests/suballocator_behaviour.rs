//! Deterministic behaviour of the suballocators: stream handover, cross-stream merging before
//! growth, growth policy, release, stats, and typed errors on bad input (state left intact).

mod common;

use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::{
    ArenaOptions, FixedSizeOptions, OrderEvent, PoolOptions, RecordingOrder, StreamOrder,
    MARK_EVERY,
};
use carve::{
    ArenaMemoryResource, Error, FixedSizeMemoryResource, HostMemoryResource, MemoryResource,
    PoolMemoryResource, StreamRef,
};
use common::{stream, ScriptedUpstream};

const KIB: usize = 1024;
const MIB: usize = 1 << 20;

fn pool_with(
    up: ScriptedUpstream,
    opts: PoolOptions,
) -> (PoolMemoryResource<ScriptedUpstream>, Arc<RecordingOrder>) {
    let order = Arc::new(RecordingOrder::new());
    let pool = PoolMemoryResource::new(up, opts.order(order.clone() as Arc<dyn StreamOrder>));
    (pool.unwrap(), order)
}

fn free<M: MemoryResource + ?Sized>(mr: &M, s: StreamRef<'_>, p: NonNull<u8>, bytes: usize) {
    // SAFETY: every caller passes a live block of `mr` allocated with `bytes`, freed once.
    unsafe { mr.deallocate(s, p, bytes, 256) }.unwrap();
}

#[test]
fn a_free_is_reused_on_its_stream_without_any_ordering() {
    let up = ScriptedUpstream::new();
    let (pool, order) = pool_with(up.clone(), PoolOptions::new(MIB));
    let (a, b) = (stream(0), stream(1));
    let p = pool.allocate(a, 1000, 256).unwrap();
    free(&pool, a, p, 1000);
    let q = pool.allocate(a, 1000, 256).unwrap();
    assert_eq!(p, q, "best fit on the same stream reuses the block");
    free(&pool, a, q, 1000);
    // Many frees, still no event: RMM records one per free.
    let many: Vec<_> = (0..100)
        .map(|_| pool.allocate(a, 512, 256).unwrap())
        .collect();
    for p in many {
        free(&pool, a, p, 512);
    }
    // Construction synchronised once (the initial chunk is free to every stream); 102 frees
    // on `a` recorded nothing (RMM records an event on each): no other stream wanted memory.
    assert_eq!(MARK_EVERY, 64);
    assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
    // Another stream, on a shard of its own, takes a slab of the initial chunk: no ordering.
    let r = pool.allocate(b, 1000, 256).unwrap();
    assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
    // A third takes the rest; a fourth finds the global core empty and grows it by what its
    // shard needs (a shard doubles from there, not the whole pool), marking the growth so that
    // others may take the rest with one wait. Nobody synchronises to reach a's unmarked blocks.
    let c = pool.allocate(stream(2), 1000, 256).unwrap();
    let d = pool.allocate(stream(3), 300 * KIB, 256).unwrap();
    assert_eq!(up.requests(), vec![MIB, 300 * KIB]);
    assert_eq!(
        order.events(),
        vec![OrderEvent::SyncAll, OrderEvent::Mark(stream(3).id())]
    );
    // A block of b's shard freed on `a` goes back to b's shard, sealed by a mark at once.
    free(&pool, a, r, 1000);
    assert_eq!(
        &order.events()[2..],
        &[OrderEvent::Mark(a.id())],
        "a cross-shard free is marked at once"
    );
    free(&pool, stream(2), c, 1000);
    free(&pool, stream(3), d, 300 * KIB);
    pool.check_invariants().unwrap();
}

#[test]
fn a_block_freed_on_another_stream_is_reused_after_one_event_wait() {
    // One shard and a bounded pool, so b must reuse what a freed.
    let (pool, order) = pool_with(
        ScriptedUpstream::new(),
        PoolOptions::new(64 * KIB).maximum(64 * KIB).shards(1),
    );
    let (a, b) = (stream(0), stream(1));
    let p = pool.allocate(a, 64 * KIB, 256).unwrap();
    free(&pool, a, p, 64 * KIB);
    // b runs short; a's block is fresh (unmarked), and the pool is at its maximum: the last
    // resort merges everything after one device-wide synchronisation.
    let q = pool.allocate(b, 64 * KIB, 256).unwrap();
    assert_eq!(q, p);
    assert_eq!(order.events(), vec![OrderEvent::SyncAll; 2]);
    // b's shortage made marks worthwhile: 64 frees on b mark it, and a then takes b's
    // sealed block with one wait, no synchronisation.
    free(&pool, b, q, 64 * KIB);
    for _ in 0..MARK_EVERY - 1 {
        let p = pool.allocate(b, 256, 256).unwrap();
        free(&pool, b, p, 256);
    }
    let r = pool.allocate(a, 64 * KIB, 256).unwrap();
    assert_eq!(
        &order.events()[2..],
        &[
            OrderEvent::Mark(b.id()),
            OrderEvent::Wait {
                waiter: a.id(),
                signaller: b.id()
            }
        ]
    );
    free(&pool, a, r, 64 * KIB);
    pool.check_invariants().unwrap();
}

#[test]
fn free_blocks_of_all_streams_merge_before_the_pool_grows() {
    // RMM issue #2039: two halves freed on two streams must serve one whole-pool request.
    let up = ScriptedUpstream::new();
    let (pool, order) = pool_with(up.clone(), PoolOptions::new(128 * KIB).maximum(128 * KIB));
    let (a, b, c) = (stream(0), stream(1), stream(2));
    let x = pool.allocate(a, 64 * KIB, 256).unwrap();
    let y = pool.allocate(a, 64 * KIB, 256).unwrap();
    free(&pool, a, x, 64 * KIB);
    free(&pool, b, y, 64 * KIB);
    let stats = pool.stats();
    assert_eq!(
        stats.largest_free_block,
        64 * KIB,
        "streams keep their blocks apart"
    );
    assert!((stats.fragmentation - 0.5).abs() < 1e-9);
    let whole = pool.allocate(c, 128 * KIB, 256).unwrap();
    assert_eq!(up.requests(), vec![128 * KIB], "no growth");
    // Construction; b's cross-shard free, marked at once in a's shard; then, the maximum
    // reached, the merge: one device-wide synchronisation, naming neither a nor b.
    assert_eq!(
        order.events(),
        vec![
            OrderEvent::SyncAll,
            OrderEvent::Mark(b.id()),
            OrderEvent::SyncAll
        ]
    );
    free(&pool, c, whole, 128 * KIB);
    pool.check_invariants().unwrap();
}

#[test]
fn at_the_maximum_a_stream_takes_free_memory_inside_another_streams_slab() {
    let up = ScriptedUpstream::new();
    let (pool, order) = pool_with(up.clone(), PoolOptions::new(MIB).maximum(MIB).shards(4));
    let (a, b) = (stream(0), stream(1));
    // a's shard takes two 512 KiB slabs; the second is half used.
    let x = pool.allocate(a, 512 * KIB, 256).unwrap();
    let y = pool.allocate(a, 256 * KIB, 256).unwrap();
    let y2 = pool.allocate(a, 256 * KIB, 256).unwrap();
    free(&pool, a, y2, 256 * KIB);
    assert_eq!(pool.stats().slabs, 2);
    // b finds nothing of its own, the global core empty and the maximum reached: after one
    // synchronisation, it takes the free half of a's slab, which stays in a's shard.
    let z = pool.allocate(b, 256 * KIB, 256).unwrap();
    assert_eq!(z, y2);
    assert_eq!(up.requests(), vec![MIB], "no growth");
    assert_eq!(order.events(), vec![OrderEvent::SyncAll; 2]);
    // Nothing is left: a typed error (after gathering once more).
    assert!(pool.allocate(b, 256, 256).unwrap_err().is_out_of_memory());
    // Freed on b, it goes back to a's shard, sealed by a mark on b.
    free(&pool, b, z, 256 * KIB);
    assert_eq!(
        order.events()[2..],
        [OrderEvent::SyncAll, OrderEvent::Mark(b.id())]
    );
    free(&pool, a, x, 512 * KIB);
    free(&pool, a, y, 256 * KIB);
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().bytes_in_use, 0);
}

#[test]
fn growth_doubles_the_shard_and_halves_on_failure() {
    let up = ScriptedUpstream::new();
    let (pool, _) = pool_with(up.clone(), PoolOptions::new(MIB));
    let s = stream(0);
    let a = pool.allocate(s, 3 * MIB, 256).unwrap();
    let b = pool.allocate(s, 3 * MIB, 256).unwrap();
    // The shard takes the larger of the request and what it holds (the 1 MiB initial chunk
    // is too small for either request).
    assert_eq!(up.requests(), vec![MIB, 3 * MIB, 3 * MIB]);
    // The upstream now refuses more than 3 MiB: the shard's 6 MiB fails, then 3 MiB fits.
    up.limit
        .store(3 * MIB, std::sync::atomic::Ordering::Relaxed);
    let c = pool.allocate(s, 2 * MIB, 256).unwrap();
    assert_eq!(&up.requests()[3..], &[6 * MIB, 3 * MIB]);
    assert_eq!(pool.stats().pool_size, 10 * MIB);
    for (p, n) in [(a, 3 * MIB), (b, 3 * MIB), (c, 2 * MIB)] {
        free(&pool, s, p, n);
    }
    pool.check_invariants().unwrap();
}

#[test]
fn an_exhausted_upstream_or_maximum_gives_a_typed_oom_naming_the_state() {
    let up = ScriptedUpstream::with_limit(MIB);
    let (pool, _) = pool_with(up, PoolOptions::new(MIB).maximum(3 * MIB));
    let s = stream(0);
    let p = pool.allocate(s, 512 * KIB, 256).unwrap();
    let err = pool.allocate(s, 2 * MIB, 256).unwrap_err();
    match &err {
        Error::OutOfMemory { bytes, detail, .. } => {
            assert_eq!(*bytes, 2 * MIB);
            assert!(detail.contains("upstream could not supply"), "{detail}");
            assert!(
                detail.contains(&format!("{}", MIB)),
                "pool size in: {detail}"
            );
        }
        e => panic!("expected OutOfMemory, got {e}"),
    }
    let err = pool.allocate(s, 4 * MIB, 256).unwrap_err();
    assert!(matches!(&err, Error::OutOfMemory { detail, .. } if detail.contains("maximum")));
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().bytes_in_use, 512 * KIB);
    free(&pool, s, p, 512 * KIB);
}

#[test]
fn release_returns_empty_chunks_to_the_upstream() {
    let up = ScriptedUpstream::new();
    let (pool, _) = pool_with(up.clone(), PoolOptions::new(MIB));
    let (a, b) = (stream(0), stream(1));
    let keep = pool.allocate(a, 1000, 256).unwrap();
    let big = pool.allocate(a, 4 * MIB, 256).unwrap();
    let x = pool.allocate(b, 1000, 256).unwrap();
    free(&pool, a, big, 4 * MIB);
    free(&pool, b, x, 1000);
    // a's shard grew the pool by 4 MiB; b's shard took a slab of the initial chunk.
    assert_eq!(up.requests(), vec![MIB, 4 * MIB]);
    assert_eq!(up.host.allocation_count(), 2);
    // The chunk holding `keep` (and b's slab) stays; the 4 MiB one goes back.
    assert_eq!(pool.release().unwrap(), 4 * MIB);
    assert_eq!(up.host.allocation_count(), 1);
    assert_eq!(pool.stats().pool_size, MIB);
    free(&pool, a, keep, 1000);
    assert_eq!(pool.release().unwrap(), MIB);
    assert_eq!(up.host.allocation_count(), 0);
    pool.check_invariants().unwrap();
}

#[test]
fn bad_input_gets_typed_errors_and_leaves_every_resource_intact() {
    let host = HostMemoryResource::new();
    let pool = PoolMemoryResource::new(host.clone(), PoolOptions::new(MIB)).unwrap();
    let fixed = FixedSizeMemoryResource::new(host.clone(), FixedSizeOptions::new(4096)).unwrap();
    let arena = ArenaMemoryResource::new(host.clone(), ArenaOptions::default()).unwrap();
    type Check<'a> = &'a dyn Fn() -> Result<(), String>;
    let resources: [(&dyn MemoryResource, Check<'_>); 3] = [
        (&pool, &|| pool.check_invariants()),
        (&fixed, &|| fixed.check_invariants()),
        (&arena, &|| arena.check_invariants()),
    ];
    let s = stream(0);
    for (mr, check) in resources {
        assert!(matches!(mr.allocate(s, 0, 256), Err(Error::ZeroSize)));
        assert!(matches!(
            mr.allocate(s, 64, 3),
            Err(Error::InvalidAlignment(3))
        ));
        assert!(matches!(
            mr.allocate(s, usize::MAX, 256),
            Err(Error::SizeOverflow { .. })
        ));
        let p = mr.allocate(s, 100, 256).unwrap();
        let mut local = [0u8; 512];
        let foreign = NonNull::new(local.as_mut_ptr()).unwrap();
        // SAFETY: an invalid free on purpose; the resource must refuse it untouched.
        let e = unsafe { mr.deallocate(s, foreign, 100, 256) }.unwrap_err();
        assert!(matches!(e, Error::UnknownPointer { .. }), "{mr:?}: {e}");
        // SAFETY: an interior pointer of a live block.
        let inner = unsafe { NonNull::new_unchecked(p.as_ptr().add(16)) };
        // SAFETY: refused before any use (interior pointer).
        let e = unsafe { mr.deallocate(s, inner, 100, 256) }.unwrap_err();
        assert!(matches!(e, Error::UnknownPointer { .. }), "{mr:?}: {e}");
        check().unwrap();
        // SAFETY: the one valid free of `p`; the second is refused as a double free.
        unsafe { mr.deallocate(s, p, 100, 256) }.unwrap();
        // SAFETY: see above.
        let e = unsafe { mr.deallocate(s, p, 100, 256) }.unwrap_err();
        assert!(matches!(e, Error::DoubleFree { .. }), "{mr:?}: {e}");
        check().unwrap();
        // Still fully usable.
        let q = mr.allocate(s, 100, 256).unwrap();
        free(mr, s, q, 100);
        check().unwrap();
    }
    let e = pool.allocate(s, 10, 256).unwrap();
    // SAFETY: a wrong size on purpose; refused before any state changes.
    let mismatch = unsafe { pool.deallocate(s, e, 11, 256) }.unwrap_err();
    assert!(matches!(
        mismatch,
        Error::SizeMismatch {
            allocated: 10,
            freed: 11,
            ..
        }
    ));
    free(&pool, s, e, 10);
    assert_eq!(pool.stats().bytes_in_use, 0);
    assert_eq!(fixed.stats().blocks_in_use, 0);
    assert_eq!(arena.stats().bytes_in_use, 0);
}

#[test]
fn fixed_size_refuses_what_it_cannot_serve_and_hands_streams_over_once() {
    let order = Arc::new(RecordingOrder::new());
    let opts = FixedSizeOptions::new(1000)
        .blocks_per_refill(4)
        .max_refills(2)
        .order(order.clone());
    let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
    let (a, b) = (stream(0), stream(1));
    assert!(matches!(
        mr.allocate(a, 1001, 256),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        mr.allocate(a, 10, 512),
        Err(Error::Unsupported(_))
    ));
    let blocks: Vec<_> = (0..8).map(|_| mr.allocate(a, 1000, 256).unwrap()).collect();
    let oom = mr.allocate(a, 1000, 256).unwrap_err();
    assert!(matches!(&oom, Error::OutOfMemory { detail, .. } if detail.contains("refills")));
    for &p in &blocks {
        free(&mr, a, p, 1000);
    }
    assert!(order.events().is_empty(), "frees record nothing");
    // b takes all of a's blocks with one synchronisation (a was never marked: 8 frees), then
    // serves 8 requests without another.
    let again: Vec<_> = (0..8).map(|_| mr.allocate(b, 1000, 256).unwrap()).collect();
    assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
    mr.check_invariants().unwrap();
    for p in again {
        free(&mr, b, p, 1000);
    }
    assert_eq!(mr.stats().slabs, 2);
    mr.check_invariants().unwrap();
}

#[test]
fn fixed_size_hands_sealed_blocks_over_with_one_wait_on_the_last_mark() {
    let order = Arc::new(RecordingOrder::new());
    let n = MARK_EVERY as usize;
    let opts = FixedSizeOptions::new(512)
        .blocks_per_refill(MARK_EVERY)
        .max_refills(1)
        .order(order.clone());
    let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
    let (a, b) = (stream(0), stream(1));
    let blocks: Vec<_> = (0..n).map(|_| mr.allocate(a, 512, 256).unwrap()).collect();
    // b runs short (every block is live): from now on, frees on a are worth a mark.
    let short = mr.allocate(b, 512, 256).unwrap_err();
    assert!(short.is_out_of_memory(), "{short}");
    assert!(order.events().is_empty());
    for &p in &blocks {
        free(&mr, a, p, 512);
    }
    assert_eq!(order.events(), vec![OrderEvent::Mark(a.id())]);
    let again: Vec<_> = (0..n).map(|_| mr.allocate(b, 512, 256).unwrap()).collect();
    assert_eq!(
        order.events(),
        vec![
            OrderEvent::Mark(a.id()),
            OrderEvent::Wait {
                waiter: b.id(),
                signaller: a.id()
            }
        ]
    );
    assert!(
        mr.allocate(b, 512, 256).is_err(),
        "one refill, all handed out"
    );
    mr.check_invariants().unwrap();
    for p in again {
        free(&mr, b, p, 512);
    }
    mr.check_invariants().unwrap();
    assert_eq!(mr.stats().blocks_in_use, 0);
}

#[test]
fn arena_returns_empty_superblocks_and_routes_large_requests_globally() {
    let host = HostMemoryResource::new();
    let opts = ArenaOptions {
        superblock_size: MIB,
        arenas: 1,
        ..Default::default()
    };
    let mr = ArenaMemoryResource::new(host.clone(), opts).unwrap();
    let s = stream(0);
    // Fill three superblocks with 200 KiB blocks (5 per superblock).
    let small: Vec<_> = (0..15)
        .map(|_| mr.allocate(s, 200 * KIB, 256).unwrap())
        .collect();
    assert_eq!(mr.stats().superblocks, 3);
    let large = mr.allocate(s, 600 * KIB, 256).unwrap();
    assert_eq!(
        mr.stats().superblocks,
        3,
        "large requests bypass the arenas"
    );
    assert_eq!(mr.stats().bytes_in_use, 15 * 200 * KIB + 600 * KIB);
    for p in small {
        free(&mr, s, p, 200 * KIB);
    }
    assert_eq!(
        mr.stats().superblocks,
        1,
        "one spare is kept, the rest go back"
    );
    free(&mr, s, large, 600 * KIB);
    assert_eq!(mr.stats().bytes_in_use, 0);
    mr.check_invariants().unwrap();
    // A block freed by another thread goes back to the arena that carved it.
    let p = mr.allocate(s, 1000, 256).unwrap().as_ptr() as usize;
    let mr2 = mr.clone();
    std::thread::spawn(move || free(&mr2, s, NonNull::new(p as *mut u8).unwrap(), 1000))
        .join()
        .unwrap();
    assert_eq!(mr.stats().bytes_in_use, 0);
    mr.check_invariants().unwrap();
}

/// Regression: a small arena block freed with the superblock's size was routed to the global
/// arena, which took it for the superblock itself and freed that while the arena still carved
/// from it. A wrong size must be refused with the arena left intact.
#[test]
fn arena_refuses_a_small_block_freed_as_a_superblock() {
    let opts = ArenaOptions {
        superblock_size: 64 * KIB,
        arenas: 1,
        ..Default::default()
    };
    let mr = ArenaMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
    let s = stream(0);
    let p = mr.allocate(s, 1000, 256).unwrap();
    let q = mr.allocate(s, 1000, 256).unwrap();
    // At the superblock's start and inside it, with its size and with another large one: the
    // arena's own refusal, naming the size it holds.
    for (block, wrong) in [(p, 64 * KIB), (p, 100 * KIB), (q, 64 * KIB), (q, 100 * KIB)] {
        // SAFETY: the wrong size on purpose; refused before anything changes.
        let r = unsafe { mr.deallocate(s, block, wrong, 256) };
        assert!(
            matches!(r, Err(Error::SizeMismatch { allocated: 1000, freed, .. }) if freed == wrong),
            "freeing a 1000-byte block as {wrong}: {r:?}"
        );
        mr.check_invariants().unwrap();
        assert_eq!(mr.stats().superblocks, 1);
    }
    let large = mr.allocate(s, 64 * KIB, 256).unwrap();
    let (a, l) = (p.as_ptr() as usize, large.as_ptr() as usize);
    assert!(
        l + 64 * KIB <= a || a + 1000 <= l,
        "the superblock was handed out again while its blocks live"
    );
    free(&mr, s, large, 64 * KIB);
    free(&mr, s, q, 1000);
    free(&mr, s, p, 1000);
    assert_eq!(mr.stats().bytes_in_use, 0);
    mr.check_invariants().unwrap();
}

#[test]
fn free_memory_split_among_streams_is_merged_after_one_synchronisation_before_growing() {
    let up = ScriptedUpstream::new();
    let (pool, order) = pool_with(up.clone(), PoolOptions::new(MIB).shards(1));
    let (a, b) = (stream(0), stream(1));
    // One slab of the whole chunk, then four neighbours in it, freed alternately on a and b:
    // all of it is free, but in blocks of two streams that merge only with their own
    // stream's.
    let whole = pool.allocate(a, MIB, 256).unwrap();
    free(&pool, a, whole, MIB);
    let blocks: Vec<_> = (0..4)
        .map(|_| pool.allocate(a, 256 * KIB, 256).unwrap())
        .collect();
    for (i, &p) in blocks.iter().enumerate() {
        free(&pool, if i % 2 == 0 { a } else { b }, p, 256 * KIB);
    }
    let before = order.events().len();
    // Half the shard (all of it) is free and nothing fits: one synchronisation, a merge, and
    // the request is served from the chunk; the upstream is not asked for more.
    let big = pool.allocate(a, 768 * KIB, 256).unwrap();
    assert_eq!(up.requests(), vec![MIB], "no growth");
    assert_eq!(&order.events()[before..], &[OrderEvent::SyncAll]);
    pool.check_invariants().unwrap();
    free(&pool, a, big, 768 * KIB);
    assert_eq!(pool.stats().bytes_in_use, 0);
    // Free memory that is already merged is not synchronised for again: a request that does
    // not fit grows the pool at once.
    let before = order.events().len();
    let whole = pool.allocate(a, MIB, 256).unwrap();
    free(&pool, a, whole, MIB);
    let (x, y) = (
        pool.allocate(a, 256 * KIB, 256).unwrap(),
        pool.allocate(a, 512 * KIB, 256).unwrap(),
    );
    free(&pool, a, x, 256 * KIB);
    let synced =
        |events: &[OrderEvent]| events.iter().filter(|e| **e == OrderEvent::SyncAll).count();
    let z = pool.allocate(a, 512 * KIB, 256).unwrap();
    assert_eq!(up.requests().len(), 2, "grew once");
    assert_eq!(synced(&order.events()[before..]), 0);
    for (p, n) in [(y, 512 * KIB), (z, 512 * KIB)] {
        free(&pool, a, p, n);
    }
    pool.check_invariants().unwrap();
}

/// An arena stream that finds only blocks freed on another stream takes a new superblock while
/// less than half the arena is free; from half free on, it merges after one synchronisation
/// and reuses them instead (the arena's memory bound).
#[test]
fn arena_merges_after_one_synchronisation_once_half_free_and_grows_before() {
    for (freed, syncs, superblocks) in [(2, 0, 2), (4, 1, 1)] {
        let order = Arc::new(RecordingOrder::new());
        let global = PoolOptions::new(0).order(order.clone() as Arc<dyn StreamOrder>);
        let opts = ArenaOptions {
            superblock_size: MIB,
            arenas: 1,
            global,
        };
        let mr = ArenaMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
        let (a, b) = (stream(1), stream(2));
        // One superblock: five 200 KiB blocks on `a`, some freed on `b` (one stays live, so
        // the superblock stays with the arena).
        let mut blocks: Vec<_> = (0..5)
            .map(|_| mr.allocate(a, 200 * KIB, 256).unwrap())
            .collect();
        for p in blocks.drain(5 - freed..) {
            free(&mr, b, p, 200 * KIB);
        }
        assert_eq!(mr.stats().superblocks, 1);
        let p = mr.allocate(a, 200 * KIB, 256).unwrap();
        let events = order.events();
        let n = events.iter().filter(|e| **e == OrderEvent::SyncAll).count();
        assert_eq!(
            (n, mr.stats().superblocks),
            (syncs, superblocks),
            "{events:?}"
        );
        free(&mr, a, p, 200 * KIB);
        for p in blocks {
            free(&mr, a, p, 200 * KIB);
        }
        assert_eq!(mr.stats().bytes_in_use, 0);
        mr.check_invariants().unwrap();
    }
}

/// Past 512 MiB a shard stops doubling: it grows by 512 MiB (or by the request), so the pool
/// reserves at most that much beyond what it needs instead of up to as much again.
#[test]
fn growth_stops_doubling_at_512_mib() {
    let sim = carve::SimulatedMemoryResource::new(64 << 30).unwrap();
    let pool = PoolMemoryResource::new(
        sim.clone(),
        PoolOptions::new(0).order(Arc::new(carve::resource::HostOrder)),
    )
    .unwrap();
    let s = stream(0);
    let mut live = Vec::new();
    for _ in 0..40 {
        live.push(pool.allocate(s, 100 * MIB, 256).unwrap());
        let (reserved, used) = (sim.usage().used, 100 * MIB * live.len());
        assert!(
            reserved <= used + 512 * MIB,
            "{reserved} reserved for {used} in use"
        );
    }
    // Doubling alone would have reached 8 GiB for these 4000 MiB.
    assert!(sim.usage().peak <= 4512 * MIB, "{:?}", sim.usage());
    // A request above the step still takes one slab of its own size.
    let big = pool.allocate(s, 2048 * MIB, 256).unwrap();
    assert!(sim.usage().used <= 100 * MIB * 40 + 2048 * MIB + 512 * MIB);
    free(&pool, s, big, 2048 * MIB);
    for p in live {
        free(&pool, s, p, 100 * MIB);
    }
    pool.check_invariants().unwrap();
}
