//! The pool and the arena under a [`CheckedOrder`] whose calls fail and panic, with
//! `release()` interleaved, from three threads that free each other's blocks on their own
//! streams. Every call may fail or unwind while faults are on; afterwards: no block is lost
//! (everything frees, the resource holds no live bytes, and after drop the host upstream holds
//! nothing unless a leak was recorded as a deferred error), there is no hang (each run has a
//! timeout), the invariants hold, and no block changed streams without a covering ordering
//! call.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, Once, PoisonError};
use std::time::Duration;

use carve::adaptor::FaultPattern;
use carve::resource::{
    ArenaOptions, CheckedOrder, CheckedResource, OrderFaults, PoolOptions, StreamOrder,
};
use carve::{
    deferred_error_count, take_deferred_error, ArenaMemoryResource, HostMemoryResource,
    MemoryResource, PoolMemoryResource, StreamRef,
};
use common::rng::{seeded, RngExt};

const THREADS: usize = 3;
const STEPS: usize = 1500;
const KIB: usize = 1024;

fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    static QUIET: Once = Once::new();
    QUIET.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let injected = info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with("injected panic"));
            if !injected {
                default(info);
            }
        }));
    });
    LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What a test resource offers besides allocating.
trait UnderTest: MemoryResource + Send + Sync {
    fn release(&self) -> carve::Result<usize>;
    fn check(&self) -> Result<(), String>;
    fn live_bytes(&self) -> usize;
}

impl<R: MemoryResource> UnderTest for PoolMemoryResource<R> {
    fn release(&self) -> carve::Result<usize> {
        PoolMemoryResource::release(self)
    }
    fn check(&self) -> Result<(), String> {
        self.check_invariants()
    }
    fn live_bytes(&self) -> usize {
        self.stats().bytes_in_use
    }
}

impl<T: UnderTest> UnderTest for CheckedResource<T> {
    fn release(&self) -> carve::Result<usize> {
        self.inner().release()
    }
    fn check(&self) -> Result<(), String> {
        self.inner().check()
    }
    fn live_bytes(&self) -> usize {
        self.inner().live_bytes()
    }
}

impl<R: MemoryResource> UnderTest for ArenaMemoryResource<R> {
    fn release(&self) -> carve::Result<usize> {
        ArenaMemoryResource::release(self)
    }
    fn check(&self) -> Result<(), String> {
        self.check_invariants()
    }
    fn live_bytes(&self) -> usize {
        self.stats().bytes_in_use
    }
}

/// Frees a block. A free that unwinds out of the stream order has taken effect (the block is
/// freed before any ordering call), so it is not retried: retrying could free a block another
/// thread was given since. The final count of live bytes tells whether a block was lost.
fn free_once(mr: &dyn MemoryResource, s: StreamRef<'_>, addr: usize, bytes: usize) {
    let p = NonNull::new(addr as *mut u8).unwrap();
    // SAFETY: a live block of `mr` allocated with `bytes`, freed once.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe {
        mr.deallocate(s, p, bytes, 256)
    }));
    if let Ok(Err(e)) = r {
        panic!("a free failed: {e}");
    }
}

fn run(mr: Arc<dyn UnderTest>, order: Arc<CheckedOrder>, seed: u64) {
    let handoff: Vec<Mutex<Vec<(usize, usize)>>> =
        (0..THREADS).map(|_| Mutex::new(Vec::new())).collect();
    let mut left: Vec<(usize, usize)> = Vec::new();
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (mr, handoff) = (&*mr, &handoff);
                scope.spawn(move || {
                    let s = StreamRef::simulated(1 + t);
                    let mut mine: Vec<(usize, usize)> = Vec::new();
                    let mut rng = seeded(seed ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    for _ in 0..STEPS {
                        let x: u64 = rng.random();
                        match x % 16 {
                            0 => {
                                let _ = catch_unwind(AssertUnwindSafe(|| mr.release()));
                            }
                            1..=8 => {
                                // Small blocks, and now and then one above the arena's quarter
                                // superblock (the global arena's).
                                let bytes = if x % 97 == 0 {
                                    300 * KIB
                                } else {
                                    256 * (1 + (x >> 8) as usize % 64)
                                };
                                if let Ok(Ok(p)) =
                                    catch_unwind(AssertUnwindSafe(|| mr.allocate(s, bytes, 256)))
                                {
                                    mine.push((p.as_ptr() as usize, bytes));
                                }
                            }
                            9..=11 if !mine.is_empty() => {
                                let i = (x >> 20) as usize % mine.len();
                                let b = mine.swap_remove(i);
                                handoff[(t + 1) % THREADS].lock().unwrap().push(b);
                            }
                            _ if !mine.is_empty() => {
                                let i = (x >> 20) as usize % mine.len();
                                let (addr, bytes) = mine.swap_remove(i);
                                free_once(mr, s, addr, bytes);
                            }
                            _ => {}
                        }
                        let theirs: Vec<_> = handoff[t].lock().unwrap().drain(..).collect();
                        for (addr, bytes) in theirs {
                            free_once(mr, s, addr, bytes);
                        }
                        if let Err(e) = mr.check() {
                            panic!("invariants: {e}");
                        }
                    }
                    mine
                })
            })
            .collect();
        for w in workers {
            left.extend(w.join().unwrap());
        }
    });
    order.set_faults(OrderFaults::default());
    for q in &handoff {
        left.extend(q.lock().unwrap().drain(..));
    }
    for (addr, bytes) in left {
        free_once(&*mr, StreamRef::simulated(9), addr, bytes);
    }
    mr.check().unwrap();
    assert_eq!(mr.live_bytes(), 0, "a block was lost");
    mr.release().unwrap();
    mr.check().unwrap();
    assert!(order.violations().is_empty(), "{:?}", order.violations());
}

fn faults(seed: u64) -> OrderFaults {
    OrderFaults {
        fail: FaultPattern::Random {
            fraction: 0.2,
            seed,
        },
        panic: FaultPattern::Random {
            fraction: 0.1,
            seed: seed ^ 0xdead_beef,
        },
        pending: seed % 2 == 0,
    }
}

/// Builds a resource under a faulting order, runs [`run`] on a thread, and fails (instead of
/// hanging) if it does not finish in time; then drops it and checks the upstream.
fn check_resource(
    name: &str,
    build: impl Fn(CheckedResourceHost, Arc<CheckedOrder>) -> Arc<dyn UnderTest>,
) {
    let _g = serial();
    for seed in 1..=4u64 {
        take_deferred_error();
        let host = HostMemoryResource::new();
        let order = CheckedOrder::new(OrderFaults::default());
        let mr = build(order.upstream(host.clone()), order.clone());
        order.set_faults(faults(seed));
        let checked: Arc<dyn UnderTest> = mr.clone();
        let (tx, rx) = mpsc::channel();
        let o = order.clone();
        std::thread::spawn(move || {
            let r = catch_unwind(AssertUnwindSafe(|| run(checked, o, seed)));
            let _ = tx.send(r.map_err(|e| {
                e.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            }));
        });
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => panic!("{name}, seed {seed}: {msg}"),
            Err(_) => panic!("{name}, seed {seed}: hung"),
        }
        let counts = order.counts();
        assert!(counts.failed > 0 && counts.panicked > 0, "{counts:?}");
        let before = deferred_error_count();
        drop(mr);
        if deferred_error_count() == before {
            assert_eq!(
                host.allocated_bytes(),
                0,
                "{name}, seed {seed}: upstream bytes"
            );
        }
    }
}

type CheckedResourceHost = CheckedResource<HostMemoryResource>;

#[test]
fn pool_survives_failing_and_panicking_stream_orders() {
    check_resource("pool", |up, order| {
        let opts = PoolOptions::new(0)
            .shards(2)
            .order(order.clone() as Arc<dyn StreamOrder>);
        Arc::new(order.check(PoolMemoryResource::new(up, opts).unwrap()))
    });
}

/// Two arenas of 1 MiB superblocks over a global arena of two shards, ordered by `order`.
fn two_arenas(order: Arc<dyn StreamOrder>) -> ArenaOptions {
    ArenaOptions {
        superblock_size: 1 << 20,
        arenas: 2,
        global: PoolOptions::new(0).shards(2).order(order),
    }
}

#[test]
fn arena_survives_failing_and_panicking_stream_orders() {
    check_resource("arena", |up, order| {
        let opts = two_arenas(order.clone());
        Arc::new(order.check(ArenaMemoryResource::new(up, opts).unwrap()))
    });
}

/// An order whose marks panic while `armed` (every other call succeeds).
#[derive(Debug, Default)]
struct PanickingMarks {
    armed: std::sync::atomic::AtomicBool,
}

impl StreamOrder for PanickingMarks {
    fn mark(&self, _stream: StreamRef<'_>) -> carve::Result<()> {
        if self.armed.load(std::sync::atomic::Ordering::Relaxed) {
            panic!("{}", String::from("injected panic: mark"));
        }
        Ok(())
    }
    fn wait_for_mark(
        &self,
        _waiter: StreamRef<'_>,
        _signaller: carve::StreamId,
    ) -> carve::Result<()> {
        Ok(())
    }
    fn synchronize_all(&self) -> carve::Result<()> {
        Ok(())
    }
    fn synchronize(&self, _stream: StreamRef<'_>) -> carve::Result<()> {
        Ok(())
    }
}

/// Allocates and frees one small block of `mr` on simulated stream `stream`, from a new thread
/// (which takes the next arena ticket).
fn block_on_new_thread(mr: ArenaMemoryResource<HostMemoryResource>, stream: usize) {
    std::thread::spawn(move || {
        let s = StreamRef::simulated(stream);
        let p = mr.allocate(s, 256, 256).unwrap();
        // SAFETY: allocated just above with these arguments.
        unsafe { mr.deallocate(s, p, 256, 256) }.unwrap();
    })
    .join()
    .unwrap();
}

/// `release()` takes every arena's empty superblocks out of the arenas, then gives them back to
/// the global arena one by one. A free there that unwinds (its mark panics after the free took
/// effect) must leave the superblocks not yet given back in the books: they count as neither
/// lost nor live, and the next release returns them.
#[test]
fn arena_release_that_unwinds_loses_no_superblock() {
    let _g = serial();
    for round in 0..32usize {
        let order = Arc::new(PanickingMarks::default());
        let host = HostMemoryResource::new();
        let opts = two_arenas(order.clone());
        let mr = ArenaMemoryResource::new(host.clone(), opts).unwrap();
        // Threads take arenas by a process-wide ticket: a thread that takes one elsewhere in
        // odd rounds swaps which arena the first superblock lands in, and with it whether the
        // superblock that `release` gives back first is one freed on its own global shard or
        // on another's (which marks, and panics).
        if round % 2 == 1 {
            let scratch =
                ArenaMemoryResource::new(HostMemoryResource::new(), ArenaOptions::default())
                    .unwrap();
            block_on_new_thread(scratch, 1);
        }
        // Then one spare superblock in each arena, from new threads until both hold one.
        for t in 0..16 {
            if mr.stats().superblocks == 2 {
                break;
            }
            block_on_new_thread(mr.clone(), 1 + (round * 7 + t) % 5);
        }
        assert_eq!(mr.stats().superblocks, 2, "round {round}: set-up");
        order
            .armed
            .store(true, std::sync::atomic::Ordering::Relaxed);
        let r = catch_unwind(AssertUnwindSafe(|| mr.release()));
        assert!(r.is_err(), "round {round}: a mark should have panicked");
        order
            .armed
            .store(false, std::sync::atomic::Ordering::Relaxed);
        mr.check_invariants().unwrap();
        assert_eq!(
            mr.stats().bytes_in_use,
            0,
            "round {round}: a superblock was lost"
        );
        mr.release().unwrap();
        assert_eq!(mr.global().stats().bytes_in_use, 0, "round {round}");
        drop(mr);
        assert_eq!(host.allocated_bytes(), 0, "round {round}: upstream bytes");
    }
}
