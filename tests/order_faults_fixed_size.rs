//! The fixed-size resource and binning over it under a failing or panicking `StreamOrder`
//! (`CheckedOrder`): no block crosses streams without a covering ordering call, none is lost,
//! nothing hangs, held memory stays within its stated bound, and streams beyond the slot table
//! do not pay a synchronisation per free.
//!
//! Only `fixed_size_drop_after_a_failed_synchronisation_leaks_and_records` lets a teardown fail;
//! every other test clears its faults before dropping, so the process-wide deferred-error slot
//! sees that one test alone.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use carve::adaptor::FaultPattern;
use carve::resource::{Bin, CheckedOrder, CheckedResource, FixedSizeOptions, OrderFaults};
use carve::{
    BinningMemoryResource, Error, FixedSizeMemoryResource, HostMemoryResource, MemoryResource,
    SharedResource, StreamRef,
};
use common::rng::{seeded, RngExt};

type Fixed = FixedSizeMemoryResource<CheckedResource<HostMemoryResource>>;

fn s(i: usize) -> StreamRef<'static> {
    StreamRef::simulated(i)
}

/// A fixed-size resource of `block`-byte blocks over checked host memory, ordered by `order`.
fn fixed(order: &Arc<CheckedOrder>, host: &HostMemoryResource, opts: FixedSizeOptions) -> Fixed {
    let opts = opts.order(order.clone());
    FixedSizeMemoryResource::new(order.upstream(host.clone()), opts).unwrap()
}

fn free<M: MemoryResource>(mr: &M, stream: StreamRef<'_>, p: NonNull<u8>, bytes: usize) {
    // SAFETY: every caller passes a live block of `mr` of `bytes` bytes, freed once.
    unsafe { mr.deallocate(stream, p, bytes, 256) }.unwrap();
}

fn fail_every_call() -> OrderFaults {
    OrderFaults {
        fail: FaultPattern::EveryNth(1),
        ..OrderFaults::default()
    }
}

/// Runs `f` on a thread and fails the test if it does not finish within `secs`.
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => {
            h.join().unwrap();
            v
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("hung for {secs} s"),
        Err(mpsc::RecvTimeoutError::Disconnected) => match h.join() {
            Err(e) => std::panic::resume_unwind(e),
            Ok(()) => unreachable!("the thread sent nothing and did not panic"),
        },
    }
}

/// A stream that runs dry gathers the other streams' fresh blocks after one device-wide
/// synchronisation. When that synchronisation fails, none of them may reach it, then or later.
#[test]
fn fixed_size_gather_after_a_failed_synchronisation_hands_nothing_across() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let mr = order.check(fixed(
        &order,
        &host,
        FixedSizeOptions::new(256)
            .blocks_per_refill(4)
            .max_refills(1),
    ));
    let (a, b) = (s(1), s(2));
    let blocks: Vec<_> = (0..4).map(|_| mr.allocate(a, 256, 256).unwrap()).collect();
    for &p in &blocks {
        free(&mr, a, p, 256);
    }
    order.set_faults(fail_every_call());
    let e = mr.allocate(b, 256, 256).unwrap_err();
    assert!(matches!(e, Error::Driver { .. }), "{e}");
    order.set_faults(OrderFaults::default());
    let again: Vec<_> = (0..4).map(|_| mr.allocate(b, 256, 256).unwrap()).collect();
    assert_eq!(order.violations(), Vec::<String>::new());
    mr.inner().check_invariants().unwrap();
    for p in again {
        free(&mr, b, p, 256);
    }
    mr.inner().check_invariants().unwrap();
    drop(mr);
    assert_eq!(host.allocated_bytes(), 0);
}

/// Fills every stream slot with a stream that holds one free block and three live ones, so that
/// one more stream has no slot and must refill (its spare blocks then need a synchronisation).
fn fill_slots(mr: &CheckedResource<Fixed>, slots: usize) -> Vec<(StreamRef<'static>, NonNull<u8>)> {
    let mut live = Vec::new();
    for i in 1..=slots {
        let ps: Vec<_> = (0..4)
            .map(|_| mr.allocate(s(i), 256, 256).unwrap())
            .collect();
        free(mr, s(i), ps[0], 256);
        live.extend(ps[1..].iter().map(|&p| (s(i), p)));
    }
    live
}

/// A refill for a stream without a slot synchronises that stream before its spare blocks go to
/// every stream; when that fails, the new slab must not be lost.
#[test]
fn fixed_size_refill_for_a_slotless_stream_loses_no_slab_when_its_synchronisation_fails() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let mr = order.check(fixed(
        &order,
        &host,
        FixedSizeOptions::new(256).blocks_per_refill(2),
    ));
    let live = fill_slots(&mr, 64);
    assert_eq!(order.counts().calls, 0, "{:?}", order.counts());
    let extra = s(1000);
    order.set_faults(fail_every_call());
    let e = mr.allocate(extra, 256, 256).unwrap_err();
    assert!(matches!(e, Error::Driver { .. }), "{e}");
    mr.inner().check_invariants().unwrap();
    order.set_faults(OrderFaults::default());
    let p = mr.allocate(extra, 256, 256).unwrap();
    let q = mr.allocate(extra, 256, 256).unwrap();
    mr.inner().check_invariants().unwrap();
    for b in [p, q] {
        free(&mr, extra, b, 256);
    }
    for (st, b) in live {
        free(&mr, st, b, 256);
    }
    assert_eq!(order.violations(), Vec::<String>::new());
    mr.inner().check_invariants().unwrap();
    assert_eq!(mr.inner().stats().blocks_in_use, 0);
    drop(mr);
    assert_eq!(host.allocated_bytes(), 0, "a slab was lost");
}

/// Teardown after a failed device-wide synchronisation: queued work may still use the slabs, so
/// they stay with the resource's upstream (leaked) and the error is recorded.
#[test]
fn fixed_size_drop_after_a_failed_synchronisation_leaks_and_records() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let mr = fixed(
        &order,
        &host,
        FixedSizeOptions::new(256).blocks_per_refill(4),
    );
    let p = mr.allocate(s(1), 256, 256).unwrap();
    free(&mr, s(1), p, 256);
    let held = host.allocated_bytes();
    assert!(held > 0);
    let before = carve::deferred_error_count();
    order.set_faults(fail_every_call());
    drop(mr);
    assert_eq!(
        host.allocated_bytes(),
        held,
        "slabs returned after a failed sync"
    );
    assert_eq!(carve::deferred_error_count(), before + 1);
    let e = carve::take_deferred_error().expect("recorded");
    assert!(e.context.contains("FixedSizeMemoryResource drop"), "{e}");
}

/// The 64th free on a stream seals its fresh blocks under a mark once some stream ran short. A
/// `StreamOrder` that panics there must leave the resource whole and usable.
#[test]
fn fixed_size_survives_a_panicking_mark_while_sealing() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let mr = order.check(fixed(
        &order,
        &host,
        FixedSizeOptions::new(256)
            .blocks_per_refill(64)
            .max_refills(1),
    ));
    let (a, b) = (s(1), s(2));
    let mut blocks: Vec<_> = (0..64).map(|_| mr.allocate(a, 256, 256).unwrap()).collect();
    assert!(mr.allocate(b, 256, 256).unwrap_err().is_out_of_memory());
    order.set_faults(OrderFaults {
        panic: FaultPattern::EveryNth(1),
        ..OrderFaults::default()
    });
    let mut panicked = 0;
    while let Some(p) = blocks.pop() {
        // SAFETY: a live block of `mr`, freed once (a free that unwinds has freed it).
        let r = catch_unwind(AssertUnwindSafe(|| unsafe {
            mr.deallocate(a, p, 256, 256)
        }));
        if r.is_err() {
            panicked += 1;
            order.set_faults(OrderFaults::default());
        }
    }
    assert_eq!(panicked, 1, "the seal's mark panicked once");
    mr.inner().check_invariants().unwrap();
    assert_eq!(mr.inner().stats().blocks_in_use, 0);
    // Every block is reachable again: b takes all 64 (one refill, spent) without hanging.
    let mr = Arc::new(mr);
    let m = mr.clone();
    let got = within(20, move || {
        (0..64)
            .map(|_| m.allocate(b, 256, 256).map(|p| p.as_ptr() as usize))
            .collect::<Result<Vec<_>, _>>()
    })
    .unwrap();
    let mut distinct = got.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), 64, "a block was handed out twice");
    assert_eq!(order.violations(), Vec::<String>::new());
    for p in got {
        free(&*mr, b, NonNull::new(p as *mut u8).unwrap(), 256);
    }
    mr.inner().check_invariants().unwrap();
}

/// Blocks allocated on one stream and freed on another: held memory stays within the stated
/// bound, `(2 × peak blocks in use + 2 × blocks per refill) × stride`, with no violation.
#[test]
fn fixed_size_alloc_on_one_stream_free_on_another_stays_bounded() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let per = 4;
    let mr = order.check(fixed(
        &order,
        &host,
        FixedSizeOptions::new(256).blocks_per_refill(per),
    ));
    let (a, b) = (s(1), s(2));
    let mut window = std::collections::VecDeque::new();
    let mut peak = 0;
    for _ in 0..20_000 {
        window.push_back(mr.allocate(a, 256, 256).unwrap());
        peak = peak.max(window.len());
        if window.len() > 8 {
            free(&mr, b, window.pop_front().unwrap(), 256);
        }
    }
    let bound = (2 * peak + 2 * per as usize) * 256;
    let held = mr.inner().stats().upstream_bytes;
    assert!(
        held <= bound,
        "holds {held} bytes for a peak of {peak} blocks (bound {bound})"
    );
    assert_eq!(order.violations(), Vec::<String>::new());
    for p in window {
        free(&mr, b, p, 256);
    }
    mr.inner().check_invariants().unwrap();
}

/// 100 streams, one after another, each allocate and free a few blocks: streams beyond the 64
/// slots reuse the slots of streams whose blocks all went back, rather than synchronising on
/// every free.
#[test]
fn fixed_size_streams_beyond_the_slot_table_do_not_synchronise_on_every_free() {
    let order = CheckedOrder::new(OrderFaults::default());
    let host = HostMemoryResource::new();
    let mr = order.check(fixed(
        &order,
        &host,
        FixedSizeOptions::new(256).blocks_per_refill(64),
    ));
    let mut calls_at = Vec::new();
    for i in 1..=100 {
        calls_at.push(order.counts().calls);
        for _ in 0..4 {
            let ps: Vec<_> = (0..2)
                .map(|_| mr.allocate(s(i), 256, 256).unwrap())
                .collect();
            for p in ps {
                free(&mr, s(i), p, 256);
            }
        }
    }
    let beyond = order.counts().calls - calls_at[64];
    // 36 streams × 8 frees: a synchronisation per free would be 288 calls.
    assert!(
        beyond <= 4,
        "{beyond} ordering calls for 36 streams beyond the slots ({:?})",
        order.counts()
    );
    assert_eq!(order.violations(), Vec::<String>::new());
    mr.inner().check_invariants().unwrap();
    assert!(mr.inner().stats().upstream_bytes <= (2 * 2 + 2 * 64) * 256);
}

/// What one thread of the three-thread runs does with a result it cannot trust.
enum Outcome<T> {
    Done(T),
    Failed,
    Panicked,
}

fn attempt<T>(f: impl FnOnce() -> carve::Result<T>) -> Outcome<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Outcome::Done(v),
        Ok(Err(e)) => {
            assert!(
                matches!(e, Error::Driver { .. } | Error::OutOfMemory { .. }),
                "an injected fault surfaced as {e}"
            );
            Outcome::Failed
        }
        Err(_) => Outcome::Panicked,
    }
}

/// Three threads on their own streams allocate, free, and hand blocks to each other to free on
/// their streams, while the order fails and panics at random. A free that fails leaves the
/// block with its owner, who frees it again later; one that unwinds has freed it. At the end (faults off) everything is
/// freed: nothing is lost, nothing was handed out twice or across streams unordered.
///
/// `sizes` fill whole blocks: the checker tracks byte ranges, so a block freed whole and taken
/// again for fewer bytes would leave the rest recorded as freed by the old stream.
fn three_threads<M: MemoryResource + Sync>(
    mr: &M,
    order: &Arc<CheckedOrder>,
    sizes: &[usize],
    seed: u64,
) {
    order.set_faults(OrderFaults {
        fail: FaultPattern::Random {
            fraction: 0.2,
            seed,
        },
        panic: FaultPattern::Random {
            fraction: 0.1,
            seed: seed ^ 0xdead,
        },
        pending: false,
    });
    // Blocks as (address, bytes): owned by one thread at a time.
    let mailbox: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());
    let ptr = |a: usize| NonNull::new(a as *mut u8).unwrap();
    let leftovers: Vec<Vec<(usize, usize)>> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..3)
            .map(|t| {
                let mailbox = &mailbox;
                scope.spawn(move || {
                    let st = s(10 + t);
                    let mut rng = seeded(seed + t as u64);
                    let mut mine: Vec<(usize, usize)> = Vec::new();
                    for _ in 0..3000 {
                        match rng.random_range(0..10) {
                            0..=4 => {
                                let n = sizes[rng.random_range(0..sizes.len())];
                                if let Outcome::Done(p) = attempt(|| mr.allocate(st, n, 256)) {
                                    // SAFETY: a live host block of at least `n` bytes.
                                    unsafe { p.as_ptr().write_bytes(t as u8, n) };
                                    mine.push((p.as_ptr() as usize, n));
                                }
                            }
                            5..=7 if !mine.is_empty() => {
                                let (a, n) = mine.swap_remove(rng.random_range(0..mine.len()));
                                // SAFETY: ours, live; one that fails stays ours.
                                match attempt(|| unsafe { mr.deallocate(st, ptr(a), n, 256) }) {
                                    Outcome::Done(()) | Outcome::Panicked => {}
                                    Outcome::Failed => mine.push((a, n)),
                                }
                            }
                            8 if !mine.is_empty() => {
                                let b = mine.swap_remove(rng.random_range(0..mine.len()));
                                mailbox.lock().unwrap().push(b);
                            }
                            _ => {
                                let got = mailbox.lock().unwrap().pop();
                                mine.extend(got);
                            }
                        }
                    }
                    mine
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    order.set_faults(OrderFaults::default());
    let rest = leftovers
        .into_iter()
        .flatten()
        .chain(mailbox.into_inner().unwrap());
    for (a, n) in rest {
        free(mr, s(10), ptr(a), n);
    }
    let c = order.counts();
    assert!(
        c.failed > 0 && c.panicked > 0,
        "faults were injected: {c:?}"
    );
    assert_eq!(order.violations(), Vec::<String>::new());
}

#[test]
fn fixed_size_three_threads_under_failing_and_panicking_order() {
    for seed in 0..4 {
        let order = CheckedOrder::new(OrderFaults::default());
        let host = HostMemoryResource::new();
        let mr = order.check(fixed(
            &order,
            &host,
            FixedSizeOptions::new(1000)
                .blocks_per_refill(8)
                .max_refills(6),
        ));
        let mr = Arc::new(mr);
        let (m, o) = (mr.clone(), order.clone());
        within(60, move || three_threads(&*m, &o, &[1000], seed));
        mr.inner().check_invariants().unwrap();
        assert_eq!(mr.inner().stats().blocks_in_use, 0);
        drop(mr);
        assert_eq!(host.allocated_bytes(), 0, "seed {seed}: a slab was lost");
    }
}

#[test]
fn binning_three_threads_under_failing_and_panicking_order() {
    for seed in 0..4 {
        let order = CheckedOrder::new(OrderFaults::default());
        let host = HostMemoryResource::new();
        let bins: Vec<(usize, Fixed)> = [256, 1024, 4096]
            .into_iter()
            .map(|size| {
                let opts = FixedSizeOptions::new(size)
                    .blocks_per_refill(4)
                    .max_refills(8);
                (size, fixed(&order, &host, opts))
            })
            .collect();
        let binning = BinningMemoryResource::with_bins(
            order.upstream(host.clone()),
            bins.iter()
                .map(|(size, f)| Bin {
                    size: *size,
                    resource: Arc::new(f.clone()) as SharedResource,
                })
                .collect(),
        )
        .unwrap();
        let mr = Arc::new(order.check(binning));
        let (m, o) = (mr.clone(), order.clone());
        within(60, move || three_threads(&*m, &o, &[256, 1024, 4096], seed));
        for (size, f) in &bins {
            f.check_invariants()
                .unwrap_or_else(|e| panic!("bin {size}: {e}"));
            assert_eq!(f.stats().blocks_in_use, 0, "bin {size}");
        }
        drop((mr, bins));
        assert_eq!(host.allocated_bytes(), 0, "seed {seed}: a slab was lost");
    }
}
