use std::sync::Arc;

use super::expandable::{ExpandableMemoryResource, ExpandableOptions};
use super::*;
use crate::resource::engine::stream_order::{OrderEvent, RecordingOrder};

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
const A: StreamRef<'static> = StreamRef::simulated(1);
const B: StreamRef<'static> = StreamRef::simulated(2);

fn expandable(capacity: usize) -> VirtualMemoryResource<Arc<SimulatedBacking>> {
    let backing = Arc::new(SimulatedBacking::new(capacity, PAGE).unwrap());
    VirtualMemoryResource::new(backing, VirtualOptions::expandable().maximum(capacity)).unwrap()
}

fn alloc<P: PhysicalBacking>(
    r: &VirtualMemoryResource<P>,
    s: StreamRef<'_>,
    bytes: usize,
) -> usize {
    r.allocate(s, bytes, 256).unwrap().as_ptr() as usize
}

fn free<P: PhysicalBacking>(
    r: &VirtualMemoryResource<P>,
    s: StreamRef<'_>,
    p: usize,
    bytes: usize,
) {
    // SAFETY: simulated memory is never touched; the block came from `r` with `bytes`.
    unsafe { r.deallocate(s, NonNull::new(p as *mut u8).unwrap(), bytes, 256) }.unwrap()
}

#[test]
fn maps_pages_on_demand_and_trims_them() {
    let r = expandable(64 * MIB);
    let a = alloc(&r, A, 1000);
    let b = alloc(&r, A, 3 * MIB);
    assert!(a >= r.base() && b >= r.base());
    let s = r.stats();
    assert!(s.mapped >= 4 * MIB && s.mapped <= 6 * MIB, "{s:?}");
    assert_eq!(s.mapped, r.backing().counters().physical);
    r.check_invariants().unwrap();
    free(&r, A, b, 3 * MIB);
    free(&r, A, a, 1000);
    let s = r.stats();
    assert_eq!(
        s.free_mapped, s.mapped,
        "every page is free but still mapped"
    );
    assert_eq!(r.trim().unwrap(), s.mapped);
    assert_eq!(r.stats().mapped, 0);
    assert_eq!(r.backing().counters().physical, 0);
    r.check_invariants().unwrap();
}

/// Free pages scattered through the range serve a request larger than any hole: their chunks
/// move, and the physical memory never exceeds the capacity.
#[test]
fn a_large_request_reuses_scattered_free_pages() {
    let r = expandable(64 * MIB);
    let blocks: Vec<usize> = (0..32).map(|_| alloc(&r, A, PAGE)).collect();
    assert_eq!(r.stats().mapped, 64 * MIB);
    for &p in blocks.iter().step_by(2) {
        free(&r, A, p, PAGE);
    }
    let big = alloc(&r, A, 32 * MIB);
    let s = r.stats();
    assert_eq!(s.mapped, 64 * MIB, "{s:?}");
    assert_eq!(s.chunks_moved, 16);
    assert_eq!(r.backing().counters().peak_physical, 64 * MIB);
    assert!(big >= r.base() + 64 * MIB, "placed past the live blocks");
    r.check_invariants().unwrap();
    // Nothing left to move or create: a typed error, and nothing changed.
    let e = r.allocate(A, PAGE, 256).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    assert_eq!(r.stats().live_blocks, 17);
    r.check_invariants().unwrap();
}

/// An expandable resource of at most 6 MiB (three pages) over simulated memory, with the
/// ordering requests it makes recorded.
fn expandable_recorded() -> (
    VirtualMemoryResource<Arc<SimulatedBacking>>,
    Arc<RecordingOrder>,
) {
    let backing = Arc::new(SimulatedBacking::new(8 * MIB, PAGE).unwrap());
    let order = Arc::new(RecordingOrder::new());
    let r = VirtualMemoryResource::new(
        backing,
        VirtualOptions::expandable()
            .maximum(6 * MIB)
            .order(order.clone()),
    )
    .unwrap();
    (r, order)
}

/// The free page was freed on the allocating stream, and no other stream holds free blocks:
/// waiting for that stream covers the page's last use, so the device (and another thread's
/// graph capture) is left alone.
#[test]
fn moving_a_chunk_freed_on_the_same_stream_waits_for_that_stream_alone() {
    let (r, order) = expandable_recorded();
    let a = alloc(&r, A, PAGE);
    let _b = alloc(&r, A, PAGE);
    free(&r, A, a, PAGE);
    assert_eq!(order.events(), vec![]);
    // The freed page is in A's hands; a larger block elsewhere needs its chunk.
    let _c = alloc(&r, A, 2 * PAGE - 256);
    assert_eq!(order.events(), vec![OrderEvent::Sync(A.id())]);
    let s = r.stats();
    assert_eq!(
        (
            s.chunks_moved,
            s.synchronizations,
            s.stream_synchronizations
        ),
        (1, 0, 1)
    );
    r.check_invariants().unwrap();
}

/// As above, but another stream holds a free block too: the move waits for the whole device.
#[test]
fn moving_a_chunk_while_another_stream_holds_free_blocks_waits_for_the_device() {
    let (r, order) = expandable_recorded();
    let a = alloc(&r, A, PAGE);
    let b = alloc(&r, B, 256);
    let _keep = alloc(&r, A, PAGE);
    free(&r, A, a, PAGE);
    free(&r, B, b, 256);
    let seen = order.events().len();
    let _c = alloc(&r, A, 2 * PAGE - 256);
    assert!(
        order.events()[seen..].contains(&OrderEvent::SyncAll),
        "{:?}",
        order.events()
    );
    assert!(!order.events().contains(&OrderEvent::Sync(A.id())));
    r.check_invariants().unwrap();
}

#[test]
fn whole_chunk_blocks_free_their_pages_at_once() {
    let backing = Arc::new(SimulatedBacking::new(16 * MIB, PAGE).unwrap());
    let r = VirtualMemoryResource::new(backing, VirtualOptions::new().maximum(16 * MIB)).unwrap();
    let a = alloc(&r, A, 1);
    let b = alloc(&r, A, PAGE + 1);
    assert_eq!(a % PAGE, 0);
    assert_eq!(b % PAGE, 0);
    assert_eq!(r.stats().mapped, 3 * PAGE);
    free(&r, A, a, 1);
    assert_eq!(r.stats().free_mapped, PAGE);
    r.check_invariants().unwrap();
    free(&r, A, b, PAGE + 1);
    assert_eq!(r.trim().unwrap(), 3 * PAGE);
}

#[test]
fn bad_requests_and_frees_are_typed_errors() {
    let r = expandable(8 * MIB);
    assert!(matches!(r.allocate(A, 0, 256), Err(Error::ZeroSize)));
    assert!(matches!(
        r.allocate(A, 8, 3),
        Err(Error::InvalidAlignment(3))
    ));
    assert!(matches!(
        r.allocate(A, usize::MAX - 5, 256),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(r.allocate(A, 9 * MIB, 256).unwrap_err().is_out_of_memory());
    let p = alloc(&r, A, 300);
    let nn = |a: usize| NonNull::new(a as *mut u8).unwrap();
    // SAFETY: simulated memory; each refused call leaves the state as it was.
    unsafe {
        assert!(matches!(
            r.deallocate(A, nn(p + 256), 300, 256),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            r.deallocate(A, nn(p), 301, 256),
            Err(Error::SizeMismatch { .. })
        ));
        r.deallocate(A, nn(p), 300, 256).unwrap();
        assert!(matches!(
            r.deallocate(A, nn(p), 300, 256),
            Err(Error::DoubleFree { .. })
        ));
    }
    r.check_invariants().unwrap();
    assert!(VirtualMemoryResource::new(
        SimulatedBacking::new(8 * MIB, PAGE).unwrap(),
        VirtualOptions::new()
    )
    .is_err());
    assert!(
        VirtualMemoryResource::simulated(8 * MIB, VirtualOptions::new().chunk_size(3 * MIB))
            .is_err()
    );
}

#[test]
fn the_range_grows_in_place_past_its_first_extent() {
    let r = expandable(1 << 30);
    let first = alloc(&r, A, 256);
    let mut held = vec![];
    for _ in 0..40 {
        held.push(alloc(&r, A, 20 * MIB));
    }
    let s = r.stats();
    assert!(s.extent > 32 * PAGE, "grew: {s:?}");
    assert!(held.iter().all(|&p| p > first && p < r.base() + s.reserved));
    r.check_invariants().unwrap();
    for p in held {
        free(&r, A, p, 20 * MIB);
    }
    free(&r, A, first, 256);
    r.check_invariants().unwrap();
}

#[test]
fn dropping_returns_every_chunk_and_the_reservation() {
    let backing = Arc::new(SimulatedBacking::new(32 * MIB, PAGE).unwrap());
    {
        let r = VirtualMemoryResource::new(
            backing.clone(),
            VirtualOptions::expandable().maximum(32 * MIB),
        )
        .unwrap();
        let _leaked_by_the_client = alloc(&r, A, 5 * MIB);
        let p = alloc(&r, B, MIB);
        free(&r, B, p, MIB);
    }
    let c = backing.counters();
    assert_eq!(c.physical, 0);
    assert_eq!(c.creates, c.releases);
    assert_eq!(backing.live_mappings(), 0);
}

/// Random allocations and frees on three streams: the index and the page table agree after
/// every step, live blocks never overlap, and the physical memory never passes the maximum.
#[test]
fn random_sequences_keep_every_invariant() {
    use rand::rngs::SmallRng;
    use rand::{RngExt, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(11);
    for round in 0..40 {
        let expandable_mode = round % 2 == 0;
        let backing = Arc::new(SimulatedBacking::new(48 * MIB, PAGE).unwrap());
        let options = if expandable_mode {
            VirtualOptions::expandable()
        } else {
            VirtualOptions::new()
        };
        let r = VirtualMemoryResource::new(backing.clone(), options.maximum(48 * MIB)).unwrap();
        let mut live: Vec<(usize, usize)> = vec![];
        for _ in 0..300 {
            let s = StreamRef::simulated(rng.random_range(0..3));
            if rng.random_bool(0.55) {
                let bytes = if rng.random_bool(0.8) {
                    rng.random_range(1..64 << 10)
                } else {
                    rng.random_range(1..12 * MIB)
                };
                match r.allocate(s, bytes, 256) {
                    Ok(p) => {
                        let a = p.as_ptr() as usize;
                        assert!(live.iter().all(|&(b, n)| a + bytes <= b || b + n <= a));
                        live.push((a, bytes));
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
            } else if !live.is_empty() {
                let (p, bytes) = live.swap_remove(rng.random_range(0..live.len()));
                free(&r, s, p, bytes);
            }
            r.check_invariants().unwrap();
            let c = backing.counters();
            assert!(c.physical <= 48 * MIB);
            assert_eq!(c.physical, r.stats().mapped);
        }
        if rng.random_bool(0.5) {
            r.trim().unwrap();
            r.check_invariants().unwrap();
        }
    }
}

mod expandable_pool {
    use super::*;

    fn pool(capacity: usize) -> ExpandableMemoryResource<SimulatedBacking> {
        ExpandableMemoryResource::simulated(capacity, ExpandableOptions::default()).unwrap()
    }

    fn take(r: &ExpandableMemoryResource<SimulatedBacking>, bytes: usize) -> usize {
        r.allocate(A, bytes, 256).unwrap().as_ptr() as usize
    }

    fn give(r: &ExpandableMemoryResource<SimulatedBacking>, p: usize, bytes: usize) {
        // SAFETY: simulated memory; the block came from `r` with `bytes`.
        unsafe { r.deallocate(A, NonNull::new(p as *mut u8).unwrap(), bytes, 256) }.unwrap()
    }

    #[test]
    fn small_and_large_requests_use_their_own_pages() {
        let r = pool(256 * MIB);
        let small: Vec<usize> = (0..64).map(|_| take(&r, 4096)).collect();
        let large = take(&r, 3 * MIB);
        let s = r.stats();
        assert_eq!(s.small.mapped, PAGE, "64 small blocks share one 2 MiB page");
        assert_eq!(s.large.mapped, 32 * MIB, "one large page");
        assert_eq!(s.physical, PAGE + 32 * MIB);
        assert_eq!(s.peak_physical, s.physical);
        r.check_invariants().unwrap();
        give(&r, large, 3 * MIB);
        for p in small {
            give(&r, p, 4096);
        }
        assert_eq!(r.trim().unwrap(), PAGE + 32 * MIB);
        assert_eq!(r.stats().physical, 0);
        r.check_invariants().unwrap();
    }

    /// The driver calls counted three ways agree: by the simulated driver, by the counting
    /// backing both ranges share, and by each range's page table.
    #[test]
    fn driver_calls_are_counted_once_each() {
        use rand::rngs::SmallRng;
        use rand::{RngExt, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(5);
        let r = pool(160 * MIB);
        let mut live: Vec<(usize, usize)> = vec![];
        for step in 0..2000 {
            if rng.random_bool(0.55) {
                let bytes = if rng.random_bool(0.5) {
                    rng.random_range(1..MIB)
                } else {
                    rng.random_range(MIB..40 * MIB)
                };
                match r.allocate(A, bytes, 256) {
                    Ok(p) => live.push((p.as_ptr() as usize, bytes)),
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
            } else if !live.is_empty() {
                let (p, bytes) = live.swap_remove(rng.random_range(0..live.len()));
                give(&r, p, bytes);
            }
            if step % 500 == 499 {
                r.trim().unwrap();
            }
        }
        for (p, bytes) in live {
            give(&r, p, bytes);
        }
        r.trim().unwrap();
        // Two free 32 MiB pages apart, and a 64 MiB request: both chunks move.
        let pages: Vec<usize> = (0..4).map(|_| take(&r, 32 * MIB)).collect();
        give(&r, pages[0], 32 * MIB);
        give(&r, pages[2], 32 * MIB);
        let big = take(&r, 64 * MIB);
        assert_eq!(r.stats().large.free_mapped, 0);
        give(&r, big, 64 * MIB);
        r.check_invariants().unwrap();
        let s = r.stats();
        let (sm, lg) = (s.small, s.large);
        // The simulated driver keeps no times.
        let counted = BackingCounters {
            time: CallTimes::default(),
            ..s.calls
        };
        assert_eq!(counted, r.backing().counters(), "counting backing = driver");
        assert!(
            lg.chunks_moved > 0 && sm.chunks_released + lg.chunks_released > 0,
            "{s:?}"
        );
        assert_eq!(s.calls.creates, sm.chunks_created + lg.chunks_created);
        assert_eq!(s.calls.releases, sm.chunks_released + lg.chunks_released);
        assert_eq!(s.calls.maps, sm.maps + lg.maps);
        assert_eq!(s.calls.unmaps, sm.unmaps + lg.unmaps);
        assert_eq!(s.calls.access_grants, sm.access_grants + lg.access_grants);
        for v in [sm, lg] {
            assert_eq!(
                v.maps,
                v.chunks_created + v.chunks_moved,
                "a map per create or move"
            );
            assert_eq!(v.unmaps, v.chunks_moved + v.chunks_released);
            assert!(v.access_grants <= v.maps);
        }
    }

    #[test]
    fn the_other_ranges_free_pages_are_released_when_memory_runs_out() {
        let r = pool(64 * MIB);
        let small: Vec<usize> = (0..32).map(|_| take(&r, MIB)).collect();
        for p in small {
            give(&r, p, MIB);
        }
        assert_eq!(r.stats().small.free_mapped, 32 * MIB);
        // 64 MiB of large pages need the small range's free 32 MiB back.
        let big = take(&r, 64 * MIB);
        let s = r.stats();
        assert_eq!((s.small.mapped, s.large.mapped), (0, 64 * MIB));
        assert!(s.peak_physical <= 64 * MIB);
        assert!(r.allocate(A, 256, 256).unwrap_err().is_out_of_memory());
        give(&r, big, 64 * MIB);
        r.check_invariants().unwrap();
    }
}

/// Over real host pages with a tight maximum, so chunks move all the time: every live block
/// keeps its bytes through every move, and the index and page table agree.
#[cfg(target_os = "linux")]
#[test]
fn moved_pages_never_disturb_live_blocks() {
    use rand::rngs::SmallRng;
    use rand::{RngExt, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(5);
    for expandable_mode in [true, false] {
        let options = if expandable_mode {
            VirtualOptions::expandable()
        } else {
            VirtualOptions::new()
        };
        let r = VirtualMemoryResource::new(
            super::HostBacking::new(4096).unwrap(),
            options.maximum(1 << 20).chunk_size(16 << 10),
        )
        .unwrap();
        let mut live: Vec<(usize, usize, u8)> = vec![];
        for step in 0..600 {
            if live.is_empty() || rng.random_bool(0.5) {
                let bytes = rng.random_range(1..100 << 10);
                match r.allocate(A, bytes, 256) {
                    Ok(p) => {
                        let tag = (step % 251) as u8;
                        // SAFETY: a fresh host-accessible block of `bytes` bytes.
                        unsafe { std::ptr::write_bytes(p.as_ptr(), tag, bytes) };
                        live.push((p.as_ptr() as usize, bytes, tag));
                    }
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
            } else {
                let (p, bytes, _) = live.swap_remove(rng.random_range(0..live.len()));
                free(&r, A, p, bytes);
            }
            for &(p, bytes, tag) in &live {
                // SAFETY: a live block of `bytes` host-accessible bytes.
                let data = unsafe { std::slice::from_raw_parts(p as *const u8, bytes) };
                assert!(data.iter().all(|&b| b == tag), "block {p:#x} changed");
            }
            r.check_invariants().unwrap();
        }
        assert!(r.stats().chunks_moved > 0, "{:?}", r.stats());
        for (p, bytes, _) in live {
            free(&r, A, p, bytes);
        }
        r.trim().unwrap();
        assert_eq!(r.stats().mapped, 0);
    }
}

/// Simulated memory whose access grants are counted and can be made to fail.
#[derive(Debug)]
struct Grants {
    inner: SimulatedBacking,
    calls: std::sync::atomic::AtomicUsize,
    fail: std::sync::atomic::AtomicBool,
}

// SAFETY: delegation to the simulated backing; a failing grant grants nothing.
unsafe impl PhysicalBacking for Grants {
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn properties(&self) -> Properties {
        self.inner.properties()
    }
    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.inner.reserve(size, align)
    }
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.inner.free_reservation(va, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        self.inner.create(size)
    }
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.inner.release(handle, size) }
    }
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.inner.map(va, size, handle) }
    }
    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        if self.fail.load(Relaxed) {
            return Err(Error::Unsupported("no access today".into()));
        }
        // SAFETY: forwarded.
        unsafe { self.inner.set_access(va, size) }
    }
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.inner.unmap(va, size) }
    }
}

#[test]
fn access_is_granted_once_per_run_and_a_refusal_maps_nothing() {
    use std::sync::atomic::Ordering::Relaxed;
    let backing = Arc::new(Grants {
        inner: SimulatedBacking::new(64 * MIB, PAGE).unwrap(),
        calls: 0.into(),
        fail: false.into(),
    });
    let r = VirtualMemoryResource::new(
        backing.clone(),
        VirtualOptions::expandable().maximum(64 * MIB),
    )
    .unwrap();
    let a = alloc(&r, A, 5 * PAGE);
    assert_eq!(r.stats().mapped, 5 * PAGE);
    assert_eq!(backing.calls.load(Relaxed), 1, "five pages, one grant");
    backing.fail.store(true, Relaxed);
    let e = r.allocate(A, 3 * PAGE, 256).unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert_eq!(
        r.stats().mapped,
        5 * PAGE,
        "the pages mapped for it were taken back"
    );
    assert_eq!(backing.inner.counters().physical, 5 * PAGE);
    r.check_invariants().unwrap();
    backing.fail.store(false, Relaxed);
    let b = alloc(&r, A, 3 * PAGE);
    free(&r, A, b, 3 * PAGE);
    free(&r, A, a, 5 * PAGE);
    r.check_invariants().unwrap();
}
