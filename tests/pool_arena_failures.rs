//! The coalescing pool and the arena when their upstream or their stream order fails: a chunk
//! whose upstream free fails stays in the books, teardown after a failed synchronisation leaks
//! (and records it) rather than return memory queued work may still use, and a failure
//! callback that frees into the arena does not deadlock it.
//!
//! The deferred-error slot is process-wide: every test here takes [`serial`] so that counts
//! of deferred errors are this test's own.

use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use carve::adaptor::{
    FailureCallbackResourceAdaptor, FaultInjectingResource, FaultOptions, FaultPattern,
};
use carve::resource::{ArenaOptions, CheckedOrder, OrderFaults, PoolOptions, StreamOrder};
use carve::{
    deferred_error_count, take_deferred_error, ArenaMemoryResource, HostMemoryResource,
    MemoryResource, PoolMemoryResource, StreamRef,
};

const KIB: usize = 1024;
const MIB: usize = 1 << 20;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let guard = LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    take_deferred_error();
    guard
}

fn s(i: usize) -> StreamRef<'static> {
    StreamRef::simulated(1 + i)
}

fn free<M: MemoryResource + ?Sized>(mr: &M, st: StreamRef<'_>, p: NonNull<u8>, bytes: usize) {
    // SAFETY: every caller passes a live block of `mr` allocated with `bytes`, freed once.
    unsafe { mr.deallocate(st, p, bytes, 256) }.unwrap();
}

fn failing_frees() -> FaultOptions {
    FaultOptions {
        frees: FaultPattern::EveryNth(1),
        ..FaultOptions::default()
    }
}

#[test]
fn a_pool_chunk_whose_upstream_free_fails_stays_in_the_books() {
    let _g = serial();
    let host = HostMemoryResource::new();
    let faults = FaultInjectingResource::new(host.clone(), FaultOptions::default());
    let pool = PoolMemoryResource::new(faults.clone(), PoolOptions::new(0).shards(2)).unwrap();
    let a = pool.allocate(s(0), 100 * KIB, 256).unwrap();
    let b = pool.allocate(s(1), 3 * MIB, 256).unwrap();
    free(&pool, s(0), a, 100 * KIB);
    free(&pool, s(1), b, 3 * MIB);
    let held = pool.stats().pool_size;
    assert!(held > 0 && held == host.allocated_bytes());

    faults.set_options(failing_frees());
    pool.release().expect_err("the upstream refused every free");
    assert!(faults.stats().injected_free_failures >= 1);
    pool.check_invariants().unwrap();
    let stats = pool.stats();
    assert_eq!(
        (stats.pool_size, stats.chunks),
        (host.allocated_bytes(), host.allocation_count()),
        "every chunk the upstream still holds is still in the pool's books"
    );
    // Still usable: the chunks serve requests.
    let p = pool.allocate(s(2), 64 * KIB, 256).unwrap();
    free(&pool, s(2), p, 64 * KIB);
    assert_eq!(
        host.allocated_bytes(),
        held,
        "no growth: the kept chunks served it"
    );

    faults.set_options(FaultOptions::default());
    assert_eq!(pool.release().unwrap(), held);
    assert_eq!(host.allocated_bytes(), 0);
    pool.check_invariants().unwrap();
    drop((pool, faults));
    assert_eq!(host.allocated_bytes(), 0);
    assert!(take_deferred_error().is_none());
}

#[test]
fn an_arena_superblock_whose_upstream_free_fails_stays_in_the_books() {
    let _g = serial();
    let host = HostMemoryResource::new();
    let faults = FaultInjectingResource::new(host.clone(), FaultOptions::default());
    let opts = ArenaOptions {
        superblock_size: MIB,
        arenas: 1,
        ..ArenaOptions::default()
    };
    let arena = ArenaMemoryResource::new(faults.clone(), opts).unwrap();
    // Two superblocks' worth of small blocks, and one large block from the global arena.
    let small: Vec<_> = (0..8)
        .map(|_| arena.allocate(s(0), 256 * KIB, 256).unwrap())
        .collect();
    let large = arena.allocate(s(0), 2 * MIB, 256).unwrap();
    for p in small {
        free(&arena, s(0), p, 256 * KIB);
    }
    free(&arena, s(0), large, 2 * MIB);
    let held = host.allocated_bytes();
    assert!(held >= 4 * MIB);

    faults.set_options(failing_frees());
    arena
        .release()
        .expect_err("the upstream refused every free");
    arena.check_invariants().unwrap();
    assert_eq!(arena.stats().global.pool_size, host.allocated_bytes());
    assert_eq!(arena.stats().bytes_in_use, 0);
    let p = arena.allocate(s(1), 1000, 256).unwrap();
    free(&arena, s(1), p, 1000);
    assert_eq!(host.allocated_bytes(), held);

    faults.set_options(FaultOptions::default());
    assert_eq!(arena.release().unwrap(), held);
    assert_eq!(host.allocated_bytes(), 0);
    arena.check_invariants().unwrap();
    drop((arena, faults));
    assert_eq!(host.allocated_bytes(), 0);
    assert!(take_deferred_error().is_none());
}

/// Blocks may still be in use by queued work when the synchronisation fails: returning them
/// would let the upstream hand them out again. They leak, and the failure is recorded.
#[test]
fn teardown_after_a_failed_synchronisation_leaks_and_records_it() {
    let _g = serial();
    for arena in [false, true] {
        let host = HostMemoryResource::new();
        let order = CheckedOrder::new(OrderFaults::default());
        let up = order.upstream(host.clone());
        let opts = PoolOptions::new(MIB).order(order.clone() as Arc<dyn StreamOrder>);
        let mr: Box<dyn MemoryResource> = if arena {
            let opts = ArenaOptions {
                superblock_size: MIB,
                arenas: 2,
                global: opts,
            };
            Box::new(ArenaMemoryResource::new(up, opts).unwrap())
        } else {
            Box::new(PoolMemoryResource::new(up, opts).unwrap())
        };
        let p = mr.allocate(s(0), 4 * KIB, 256).unwrap();
        let q = mr.allocate(s(1), 3 * MIB, 256).unwrap();
        free(&*mr, s(1), p, 4 * KIB);
        free(&*mr, s(0), q, 3 * MIB);
        let held = host.allocated_bytes();
        assert!(held >= 4 * MIB);

        order.set_faults(OrderFaults {
            fail: FaultPattern::EveryNth(1),
            ..OrderFaults::default()
        });
        let before = deferred_error_count();
        drop(mr);
        assert_eq!(
            host.allocated_bytes(),
            held,
            "arena {arena}: the upstream saw frees after a failed synchronisation"
        );
        assert_eq!(deferred_error_count(), before + 1, "arena {arena}");
        let e = take_deferred_error().expect("recorded");
        assert!(e.context.contains("PoolMemoryResource drop"), "{e}");
        assert!(order.violations().is_empty(), "{:?}", order.violations());
    }
}

type Stash = Arc<Mutex<Option<(Arc<dyn MemoryResource>, Vec<(usize, usize)>)>>>;

/// The upstream runs out of memory while the arena asks it for a superblock; the failure
/// callback frees a block of that same arena, then retries. Run on a thread with a timeout, so
/// a deadlock fails the test instead of hanging the suite.
#[test]
fn a_failure_callback_that_frees_into_the_arena_does_not_deadlock() {
    let _g = serial();
    let host = HostMemoryResource::new();
    let faults = FaultInjectingResource::new(host.clone(), FaultOptions::default());
    let stash: Stash = Arc::default();
    let in_callback = stash.clone();
    let callback = FailureCallbackResourceAdaptor::new(faults.clone(), move |_bytes| {
        let mut slot = in_callback.lock().unwrap();
        let Some((arena, blocks)) = slot.as_mut() else {
            return false;
        };
        let Some((addr, bytes)) = blocks.pop() else {
            return false;
        };
        let arena = arena.clone();
        drop(slot);
        let p = NonNull::new(addr as *mut u8).unwrap();
        // SAFETY: a live block of the arena with this size, stashed by the test, freed once.
        unsafe { arena.deallocate(s(0), p, bytes, 256) }.is_ok()
    });
    let opts = ArenaOptions {
        superblock_size: MIB,
        arenas: 1,
        ..ArenaOptions::default()
    };
    let arena = ArenaMemoryResource::new(callback, opts).unwrap();
    // Fill the first superblock, and stash one of its blocks for the callback.
    let mut live: Vec<_> = (0..4)
        .map(|_| arena.allocate(s(0), 256 * KIB, 256).unwrap())
        .collect();
    let stashed = live.pop().unwrap();
    *stash.lock().unwrap() = Some((
        Arc::new(arena.clone()) as Arc<dyn MemoryResource>,
        vec![(stashed.as_ptr() as usize, 256 * KIB)],
    ));
    // The next upstream allocation (for the second superblock) fails once.
    let next = faults.stats().allocations + 1;
    faults.set_options(FaultOptions {
        allocations: FaultPattern::Nth(next),
        ..FaultOptions::default()
    });

    let (tx, rx) = mpsc::channel();
    let a2 = arena.clone();
    std::thread::spawn(move || {
        let r = a2
            .allocate(s(0), 256 * KIB, 256)
            .map(|p| p.as_ptr() as usize);
        drop(a2);
        let _ = tx.send(r);
    });
    let got = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the arena deadlocked: its failure callback freed into it")
        .unwrap();
    assert_eq!(faults.stats().injected_allocation_failures, 1);
    assert!(
        stash.lock().unwrap().as_ref().unwrap().1.is_empty(),
        "the callback freed"
    );
    *stash.lock().unwrap() = None;
    arena.check_invariants().unwrap();
    free(
        &arena,
        s(0),
        NonNull::new(got as *mut u8).unwrap(),
        256 * KIB,
    );
    for p in live {
        free(&arena, s(0), p, 256 * KIB);
    }
    assert_eq!(arena.stats().bytes_in_use, 0);
    drop((arena, faults));
    assert_eq!(host.allocated_bytes(), 0);
}
