//! Failures in `Drop` are not lost: the first is kept for `carve::take_deferred_error`.
//!
//! One test function: the deferred-error slot is process-wide, so tests in this binary must not
//! run concurrently.

use carve::adaptor::{FaultInjectingResource, FaultOptions, FaultPattern};
use carve::resource::{HostBuffer, PoolOptions};
use carve::{deferred_error_count, take_deferred_error, HostMemoryResource, PoolMemoryResource};

#[test]
fn drop_failures_are_recorded_and_taken_once() {
    assert!(take_deferred_error().is_none(), "nothing failed yet");
    let before = deferred_error_count();

    // A pool whose upstream refuses the free of its chunk when the pool is dropped.
    let faults = FaultInjectingResource::new(
        HostMemoryResource::new(),
        FaultOptions {
            frees: FaultPattern::Nth(1),
            ..FaultOptions::default()
        },
    );
    let pool = PoolMemoryResource::new(faults.clone(), PoolOptions::new(1 << 16)).unwrap();
    drop(pool);
    assert_eq!(faults.stats().injected_free_failures, 1);
    let e = take_deferred_error().expect("the refused free was recorded");
    assert!(e.context.contains("PoolMemoryResource drop"), "{e}");
    assert!(e.to_string().contains("injected failure of free #1"), "{e}");
    assert!(take_deferred_error().is_none(), "taken once");
    assert_eq!(deferred_error_count(), before + 1);

    // A host buffer whose free is refused on drop; only the first of two failures is kept.
    faults.set_options(FaultOptions {
        frees: FaultPattern::EveryNth(1),
        ..FaultOptions::default()
    });
    let a = HostBuffer::<u32, _>::zeroed(&faults, 16).unwrap();
    let b = HostBuffer::<u32, _>::zeroed(&faults, 16).unwrap();
    drop(a);
    drop(b);
    assert_eq!(deferred_error_count(), before + 3);
    let e = take_deferred_error().expect("recorded");
    assert!(e.context.contains("HostBuffer drop"), "{e}");
    assert!(
        e.to_string().contains("free #2"),
        "the first of the two: {e}"
    );
    assert!(take_deferred_error().is_none());
}
