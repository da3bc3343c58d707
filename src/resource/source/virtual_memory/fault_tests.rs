//! What the resource does when its backing refuses an unmap or a release, and which stream
//! order it takes by default.

use std::sync::Arc;

use super::expandable::{ExpandableMemoryResource, ExpandableOptions};
use super::*;
use crate::resource::engine::stream_order::HostOrder;
use crate::resource::FaultPattern;

const PAGE: usize = 2 << 20;
const A: StreamRef<'static> = StreamRef::simulated(1);

/// Simulated chunks that claim to be device memory, naming no device.
#[derive(Debug)]
struct DeviceClaim(SimulatedBacking);

// SAFETY: delegation to the simulated backing; its memory is never dereferenced by these tests.
unsafe impl PhysicalBacking for DeviceClaim {
    fn granularity(&self) -> usize {
        self.0.granularity()
    }
    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.0.reserve(size, align)
    }
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.0.free_reservation(va, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        self.0.create(size)
    }
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.0.release(handle, size) }
    }
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.0.map(va, size, handle) }
    }
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.0.unmap(va, size) }
    }
}

fn claim() -> DeviceClaim {
    DeviceClaim(SimulatedBacking::new(64 * PAGE, PAGE).unwrap())
}

/// Memory that kernels touch is never ordered as host memory: with no order given, the order
/// is events on the backing's device, and a backing of device memory that names no device is
/// refused rather than left unordered.
#[test]
fn device_memory_with_no_order_given_is_never_ordered_as_host_memory() {
    let options = || VirtualOptions::new().maximum(16 * PAGE);
    let e = VirtualMemoryResource::new(claim(), options()).unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("stream order")),
        "{e}"
    );
    let e = ExpandableMemoryResource::new(
        claim(),
        ExpandableOptions {
            maximum: Some(16 * PAGE),
            ..ExpandableOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(&e, Error::InvalidArgument(m) if m.contains("stream order")),
        "{e}"
    );
    // An order given explicitly is taken as it is; host and simulated memory need none.
    VirtualMemoryResource::new(claim(), options().order(Arc::new(HostOrder))).unwrap();
    let backing = SimulatedBacking::new(64 * PAGE, PAGE).unwrap();
    VirtualMemoryResource::new(backing, options()).unwrap();
}

/// Whole-chunk blocks: `n` pages mapped, then all free.
fn free_pages(
    n: usize,
) -> (
    Arc<SimulatedBacking>,
    VirtualMemoryResource<Arc<SimulatedBacking>>,
) {
    let backing = Arc::new(SimulatedBacking::new(64 * PAGE, PAGE).unwrap());
    let r = VirtualMemoryResource::new(backing.clone(), VirtualOptions::new().maximum(16 * PAGE))
        .unwrap();
    let blocks: Vec<_> = (0..n).map(|_| r.allocate(A, PAGE, 256).unwrap()).collect();
    for p in blocks {
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { r.deallocate(A, p, PAGE, 256) }.unwrap();
    }
    assert_eq!(r.stats().free_mapped, n * PAGE);
    (backing, r)
}

/// A trim whose release of a chunk fails keeps the chunk: it still counts against the
/// maximum, and the next trim returns it.
#[test]
fn a_chunk_whose_release_fails_in_trim_stays_held_and_the_next_trim_returns_it() {
    let (backing, r) = free_pages(3);
    backing.set_faults(BackingFaults {
        releases: FaultPattern::Nth(2),
        ..BackingFaults::default()
    });
    let e = r.trim().unwrap_err();
    assert!(matches!(e, Error::Driver { .. }), "{e}");
    r.check_invariants().unwrap();
    let s = r.stats();
    assert_eq!(
        s.mapped + s.unreleased,
        backing.counters().physical,
        "every chunk the backing holds is in the books: {s:?}"
    );
    assert!(s.unreleased + s.free_mapped > 0, "{s:?}");
    backing.set_faults(BackingFaults::default());
    r.trim().unwrap();
    assert_eq!(backing.live_chunks(), 0, "the refused chunk was released");
    assert_eq!(backing.counters().physical, 0);
    let s = r.stats();
    assert_eq!((s.mapped, s.unreleased), (0, 0), "{s:?}");
    r.check_invariants().unwrap();
}

/// A trim whose unmap fails leaves the page mapped and free, for the next trim.
#[test]
fn a_page_whose_unmap_fails_in_trim_stays_mapped_and_free() {
    let (backing, r) = free_pages(3);
    backing.set_faults(BackingFaults {
        unmaps: FaultPattern::Nth(2),
        ..BackingFaults::default()
    });
    r.trim().unwrap_err();
    r.check_invariants().unwrap();
    let s = r.stats();
    assert_eq!(s.mapped, backing.counters().physical, "{s:?}");
    assert_eq!(s.free_mapped, s.mapped);
    backing.set_faults(BackingFaults::default());
    r.trim().unwrap();
    assert_eq!(backing.live_chunks(), 0);
    assert_eq!(backing.live_mappings(), 0);
}

/// Chunks whose release failed are released at drop, with the reservation.
#[test]
fn a_chunk_whose_release_failed_is_released_at_drop() {
    let (backing, r) = free_pages(2);
    backing.set_faults(BackingFaults {
        releases: FaultPattern::Nth(1),
        ..BackingFaults::default()
    });
    r.trim().unwrap_err();
    backing.set_faults(BackingFaults::default());
    drop(r);
    assert_eq!(backing.live_chunks(), 0);
    assert_eq!(backing.live_mappings(), 0);
    assert_eq!(backing.live_reservations(), 0);
}

/// Chunks whose release failed still count against the maximum: the memory held stays
/// bounded.
#[test]
fn chunks_whose_release_failed_count_against_the_maximum() {
    let (backing, r) = free_pages(3);
    backing.set_faults(BackingFaults {
        releases: FaultPattern::EveryNth(1),
        ..BackingFaults::default()
    });
    r.trim().unwrap_err();
    r.trim().unwrap_err();
    let mut blocks = Vec::new();
    while let Ok(p) = r.allocate(A, PAGE, 256) {
        blocks.push(p);
    }
    let s = r.stats();
    assert!(
        backing.counters().physical <= s.maximum,
        "{} bytes held, maximum {}: {s:?}",
        backing.counters().physical,
        s.maximum
    );
    r.check_invariants().unwrap();
    for p in blocks {
        // SAFETY: allocated above, freed once.
        unsafe { r.deallocate(A, p, PAGE, 256) }.unwrap();
    }
}
