//! Teardown of the virtual-memory resources after a failed device synchronisation: queued work
//! may still use the pages, so nothing is unmapped or released, and the failure is recorded.
//!
//! One test function: the deferred-error slot is process-wide, so tests in this binary must not
//! run concurrently.

use std::sync::Arc;

use carve::adaptor::FaultPattern;
use carve::resource::{
    CheckedOrder, ExpandableOptions, OrderFaults, SimulatedBacking, VirtualOptions,
};
use carve::{
    deferred_error_count, take_deferred_error, ExpandableMemoryResource, MemoryResource, StreamRef,
    VirtualMemoryResource,
};

const PAGE: usize = 2 << 20;
const A: StreamRef<'static> = StreamRef::simulated(1);

/// Every ordering call fails from now on.
fn fail_all(order: &CheckedOrder) {
    order.set_faults(OrderFaults {
        fail: FaultPattern::EveryNth(1),
        ..OrderFaults::default()
    });
}

/// Allocates `bytes` on `A` and frees half of the blocks: pages live and pages free.
fn use_some<R: MemoryResource>(r: &R, bytes: usize) {
    let blocks: Vec<_> = (0..4).map(|_| r.allocate(A, bytes, 256).unwrap()).collect();
    for p in blocks.into_iter().step_by(2) {
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { r.deallocate(A, p, bytes, 256) }.unwrap();
    }
}

/// What the backing holds: chunks, mappings, reservations.
fn held(b: &SimulatedBacking) -> (usize, usize, usize) {
    (b.live_chunks(), b.live_mappings(), b.live_reservations())
}

#[test]
fn a_failed_synchronisation_at_drop_leaks_everything_and_records_one_error() {
    let _ = take_deferred_error();

    // The virtual-memory resource.
    let backing = Arc::new(SimulatedBacking::new(64 * PAGE, PAGE).unwrap());
    let order = CheckedOrder::new(OrderFaults::default());
    let options = VirtualOptions::expandable()
        .maximum(32 * PAGE)
        .order(order.clone());
    let r = VirtualMemoryResource::new(backing.clone(), options).unwrap();
    use_some(&r, 3 * PAGE / 2);
    let before = held(&backing);
    assert!(before.0 > 0 && before.1 > 0 && before.2 == 1, "{before:?}");
    let counters = backing.counters();
    let errors = deferred_error_count();
    fail_all(&order);
    drop(r);
    assert_eq!(
        held(&backing),
        before,
        "nothing unmapped, released or unreserved"
    );
    assert_eq!(
        backing.counters(),
        counters,
        "no backing call after the failed wait"
    );
    assert_eq!(deferred_error_count(), errors + 1, "one error recorded");
    let e = take_deferred_error().expect("recorded");
    assert!(e.context.contains("VirtualMemoryResource drop"), "{e}");
    assert!(e.to_string().contains("synchronize_all"), "{e}");

    // The expandable pool: both ranges leak, one error each.
    let backing = Arc::new(SimulatedBacking::new(64 * PAGE, PAGE).unwrap());
    let order = CheckedOrder::new(OrderFaults::default());
    let options = ExpandableOptions {
        maximum: Some(64 * PAGE),
        order: Some(order.clone()),
        ..ExpandableOptions::default()
    };
    let r = ExpandableMemoryResource::new(backing.clone(), options).unwrap();
    use_some(&r, 1000);
    use_some(&r, 3 * PAGE);
    let s = r.stats();
    assert!(s.small.mapped > 0 && s.large.mapped > 0, "{s:?}");
    let before = held(&backing);
    let counters = backing.counters();
    let errors = deferred_error_count();
    fail_all(&order);
    drop(r);
    assert_eq!(
        held(&backing),
        before,
        "nothing unmapped, released or unreserved"
    );
    assert_eq!(
        backing.counters(),
        counters,
        "no backing call after the failed waits"
    );
    assert_eq!(deferred_error_count(), errors + 2, "one error per range");
    let e = take_deferred_error().expect("recorded");
    assert!(e.context.contains("VirtualMemoryResource drop"), "{e}");
}
