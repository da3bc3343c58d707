//! The virtual-memory resource and the expandable pool under a failing and panicking stream
//! order ([`CheckedOrder`]), with trims interleaved, on three threads: no block is lost, nothing
//! hangs, the invariants hold, and every block that changes streams follows a successful
//! ordering call that covers its free. Simulated memory: no GPU.

mod common;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use carve::adaptor::FaultPattern;
use carve::resource::{
    CheckedOrder, CheckedResource, ExpandableOptions, OrderFaults, SimulatedBacking, VirtualOptions,
};
use carve::{Error, ExpandableMemoryResource, MemoryResource, StreamRef, VirtualMemoryResource};
use common::rng::{seeded, RngExt};

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;

/// What a subject exposes beyond [`MemoryResource`].
trait Subject: MemoryResource + Sync {
    fn trim(&self) -> carve::Result<usize>;
    fn check(&self) -> Result<(), String>;
    /// (live blocks, bytes held in chunks by the backing)
    fn held(&self) -> (usize, usize);
    /// (chunks moved, device-wide synchronisations)
    fn moves(&self) -> (u64, u64);
}

impl Subject for VirtualMemoryResource<Arc<SimulatedBacking>> {
    fn trim(&self) -> carve::Result<usize> {
        VirtualMemoryResource::trim(self)
    }
    fn check(&self) -> Result<(), String> {
        self.check_invariants()
    }
    fn held(&self) -> (usize, usize) {
        (self.stats().live_blocks, self.backing().counters().physical)
    }
    fn moves(&self) -> (u64, u64) {
        let s = self.stats();
        (s.chunks_moved, s.synchronizations)
    }
}

impl Subject for ExpandableMemoryResource<SimulatedBacking> {
    fn trim(&self) -> carve::Result<usize> {
        ExpandableMemoryResource::trim(self)
    }
    fn check(&self) -> Result<(), String> {
        self.check_invariants()
    }
    fn held(&self) -> (usize, usize) {
        let s = self.stats();
        (s.live_blocks(), s.physical)
    }
    fn moves(&self) -> (u64, u64) {
        let s = self.stats();
        (
            s.small.chunks_moved + s.large.chunks_moved,
            s.small.synchronizations + s.large.synchronizations,
        )
    }
}

fn virtual_memory(
    order: &Arc<CheckedOrder>,
    expandable: bool,
) -> VirtualMemoryResource<Arc<SimulatedBacking>> {
    let backing = Arc::new(SimulatedBacking::new(64 * PAGE, PAGE).unwrap());
    let options = if expandable {
        VirtualOptions::expandable()
    } else {
        VirtualOptions::new()
    };
    let options = options.maximum(32 * PAGE).order(order.clone());
    VirtualMemoryResource::new(backing, options).unwrap()
}

fn expandable_pool(order: &Arc<CheckedOrder>) -> ExpandableMemoryResource<SimulatedBacking> {
    let options = ExpandableOptions {
        maximum: Some(64 * PAGE),
        order: Some(order.clone()),
        ..ExpandableOptions::default()
    };
    ExpandableMemoryResource::simulated(128 * PAGE, options).unwrap()
}

fn alloc(r: &dyn MemoryResource, s: StreamRef<'_>, bytes: usize) -> usize {
    r.allocate(s, bytes, 256).unwrap().as_ptr() as usize
}

/// # Safety
/// `p` came from `r` with `bytes` and is freed once.
unsafe fn free(
    r: &dyn MemoryResource,
    s: StreamRef<'_>,
    p: usize,
    bytes: usize,
) -> carve::Result<()> {
    // SAFETY: the caller's contract.
    unsafe { r.deallocate(s, NonNull::new(p as *mut u8).unwrap(), bytes, 256) }
}

/// Fills the maximum with `count` blocks of `bytes` on stream 1, frees the first, and asks for
/// `bytes` on stream 2: the only memory left is the freed block's page, so the block changes
/// streams (`in_place`), and must do so after a covering ordering call, or its chunk moves to
/// where stream 2's block lies, after a device-wide synchronisation.
fn crossing<R: Subject>(
    name: &str,
    order: &Arc<CheckedOrder>,
    r: R,
    (bytes, count): (usize, usize),
    in_place: bool,
) {
    let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
    let r = order.check(r);
    let blocks: Vec<usize> = (0..count).map(|_| alloc(&r, a, bytes)).collect();
    // SAFETY: allocated above, freed once.
    unsafe { free(&r, a, blocks[0], bytes) }.unwrap();
    let before = r.inner().moves();
    let y = alloc(&r, b, bytes);
    if in_place {
        assert_eq!(y, blocks[0], "{name}: the freed block changes streams");
        assert!(
            order.counts().crossings >= 1,
            "{name}: {:?}",
            order.counts()
        );
    } else {
        let (moved, synced) = r.inner().moves();
        assert_eq!(moved, before.0 + 1, "{name}: the freed block's chunk moves");
        assert!(
            synced > before.1,
            "{name}: after a device-wide synchronisation"
        );
    }
    assert!(
        order.violations().is_empty(),
        "{name}: {:?}",
        order.violations()
    );
    r.inner().check().unwrap();
}

#[test]
fn a_block_changes_streams_only_after_a_covering_ordering_call() {
    let order = CheckedOrder::new(OrderFaults::default());
    let r = virtual_memory(&order, false);
    crossing("virtual", &order, r, (PAGE, 32), false);
    let order = CheckedOrder::new(OrderFaults::default());
    let r = virtual_memory(&order, true);
    crossing("expandable range", &order, r, (PAGE, 32), true);
    let order = CheckedOrder::new(OrderFaults::default());
    let r = expandable_pool(&order);
    crossing("expandable pool", &order, r, (16 * PAGE, 4), true);
}

/// A block some thread holds, and its size.
type Blocks = Mutex<Vec<(usize, usize)>>;

/// Frees `p` on `s`. A panic in the order leaves the free done: a second free is refused as one.
fn free_checked(r: &dyn MemoryResource, s: StreamRef<'_>, p: usize, bytes: usize) {
    // SAFETY: every block in `Blocks` came from `r` with its size and is freed once here.
    match catch_unwind(AssertUnwindSafe(|| unsafe { free(r, s, p, bytes) })) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("free of {p:#x} (+{bytes}) failed: {e}"),
        Err(_) => {
            // SAFETY: probing: the first free was booked, so this one must be refused.
            let again = catch_unwind(AssertUnwindSafe(|| unsafe { free(r, s, p, bytes) }));
            match again {
                Ok(Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. })) => {}
                Ok(r) => panic!("a free whose order panicked was not done: {r:?}"),
                Err(_) => panic!("a free whose order panicked was not done: it panicked again"),
            }
        }
    }
}

/// Three threads on streams 1, 2, 3 allocate, free blocks any of them allocated (so blocks
/// change streams), and trim, while the order fails and panics on chosen calls.
fn stress<R: Subject>(name: &str, order: &Arc<CheckedOrder>, r: R, sizes: &[usize]) {
    let r: CheckedResource<R> = order.check(r);
    let held: Blocks = Mutex::new(Vec::new());
    let lock = || held.lock().unwrap_or_else(PoisonError::into_inner);
    let (mut allocs, mut refusals) = (0u64, 0u64);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (1..=3u64)
            .map(|t| {
                let (r, lock) = (&r, &lock);
                scope.spawn(move || {
                    let s = StreamRef::simulated(t as usize);
                    let (mut ok, mut refused) = (0u64, 0u64);
                    let mut rng = seeded(t.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                    for step in 0..1500u64 {
                        let x: u64 = rng.random();
                        match x % 8 {
                            0..=3 => {
                                let bytes = sizes[(x >> 8) as usize % sizes.len()];
                                let got =
                                    catch_unwind(AssertUnwindSafe(|| r.allocate(s, bytes, 256)));
                                match got {
                                    Ok(Ok(p)) => {
                                        ok += 1;
                                        lock().push((p.as_ptr() as usize, bytes));
                                    }
                                    Ok(Err(_)) | Err(_) => refused += 1,
                                }
                            }
                            4..=6 => {
                                let taken = {
                                    let mut h = lock();
                                    let n = h.len();
                                    (n > 0).then(|| h.swap_remove((x >> 8) as usize % n))
                                };
                                if let Some((p, bytes)) = taken {
                                    free_checked(r, s, p, bytes);
                                }
                            }
                            _ => {
                                let _ = catch_unwind(AssertUnwindSafe(|| r.inner().trim()));
                            }
                        }
                        if step % 100 == 0 {
                            r.inner()
                                .check()
                                .unwrap_or_else(|e| panic!("step {step}: {e}"));
                        }
                    }
                    (ok, refused)
                })
            })
            .collect();
        for w in workers {
            let (ok, refused) = w.join().expect("a worker failed");
            allocs += ok;
            refusals += refused;
        }
    });
    order.set_faults(OrderFaults::default());
    let s = StreamRef::simulated(1);
    for (p, bytes) in std::mem::take(&mut *lock()) {
        free_checked(&r, s, p, bytes);
    }
    r.inner().check().unwrap();
    assert_eq!(r.inner().held().0, 0, "{name}: every block came back");
    r.inner().trim().unwrap();
    assert_eq!(
        r.inner().held(),
        (0, 0),
        "{name}: no chunk is left after a trim"
    );
    let c = order.counts();
    assert!(
        allocs > 100 && refusals > 0,
        "{name}: {allocs} allocations, {refusals} refused"
    );
    assert!(c.failed > 0 && c.panicked > 0, "{name}: {c:?}");
    assert!(c.crossings > 0, "{name}: blocks changed streams: {c:?}");
    assert!(
        order.violations().is_empty(),
        "{name}: {:?}",
        order.violations()
    );
}

fn faults(seed: u64) -> OrderFaults {
    OrderFaults {
        fail: FaultPattern::Random {
            fraction: 0.15,
            seed,
        },
        panic: FaultPattern::Random {
            fraction: 0.05,
            seed: seed ^ 0x5555,
        },
        pending: false,
    }
}

#[test]
fn virtual_memory_survives_a_failing_and_panicking_order_on_three_threads() {
    let sizes = [PAGE, 2 * PAGE, 3 * PAGE];
    for seed in 1..=3 {
        let order = CheckedOrder::new(faults(seed));
        stress("virtual", &order, virtual_memory(&order, false), &sizes);
    }
}

#[test]
fn an_expandable_range_survives_a_failing_and_panicking_order_on_three_threads() {
    let sizes = [1000, 300 * 1024, PAGE + 1, 3 * PAGE];
    for seed in 1..=3 {
        let order = CheckedOrder::new(faults(seed));
        stress(
            "expandable range",
            &order,
            virtual_memory(&order, true),
            &sizes,
        );
    }
}

#[test]
fn the_expandable_pool_survives_a_failing_and_panicking_order_on_three_threads() {
    let sizes = [1000, 64 * 1024, 2 * MIB, 20 * MIB];
    for seed in 1..=3 {
        let order = CheckedOrder::new(faults(seed));
        stress("expandable pool", &order, expandable_pool(&order), &sizes);
    }
}
