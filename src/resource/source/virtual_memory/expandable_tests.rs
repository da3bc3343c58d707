//! The expandable pool's headroom, over simulated memory.

use std::ptr::NonNull;

use super::*;

const MIB: usize = 1 << 20;
const MAIN: StreamRef<'static> = StreamRef::simulated(1);

fn pool(capacity: usize, headroom: f64) -> ExpandableMemoryResource<SimulatedBacking> {
    let options = ExpandableOptions {
        headroom: Some(headroom),
        ..ExpandableOptions::default()
    };
    ExpandableMemoryResource::simulated(capacity, options).unwrap()
}

fn take<B: PhysicalBacking>(r: &ExpandableMemoryResource<B>, s: StreamRef<'_>, n: usize) -> usize {
    r.allocate(s, n, 256).unwrap().as_ptr() as usize
}

fn give<B: PhysicalBacking>(r: &ExpandableMemoryResource<B>, s: StreamRef<'_>, p: usize, n: usize) {
    // SAFETY: simulated memory is never touched; the block came from `r` with `n` bytes.
    unsafe { r.deallocate(s, NonNull::new(p as *mut u8).unwrap(), n, 256) }.unwrap()
}

/// Four 32 MiB blocks on the main stream, the first and third freed: two free pages apart.
fn two_free_pages_apart<B: PhysicalBacking>(r: &ExpandableMemoryResource<B>) -> [usize; 2] {
    let p: Vec<usize> = (0..4).map(|_| take(r, MAIN, 32 * MIB)).collect();
    give(r, MAIN, p[0], 32 * MIB);
    give(r, MAIN, p[2], 32 * MIB);
    [p[1], p[3]]
}

#[test]
fn without_headroom_free_pages_move() {
    let r = pool(256 * MIB, 0.0);
    let live = two_free_pages_apart(&r);
    let big = take(&r, MAIN, 64 * MIB);
    let s = r.stats();
    assert_eq!((s.large.chunks_created, s.large.chunks_moved), (4, 2));
    assert_eq!(s.peak_physical, 128 * MIB);
    for (p, n) in [(live[0], 32 * MIB), (live[1], 32 * MIB), (big, 64 * MIB)] {
        give(&r, MAIN, p, n);
    }
    r.check_invariants().unwrap();
}

#[test]
fn headroom_creates_chunks_instead_of_moving_free_pages() {
    // The most bytes live is 128 MiB: half of it again may be created.
    let r = pool(256 * MIB, 0.5);
    let _live = two_free_pages_apart(&r);
    let _big = take(&r, MAIN, 64 * MIB);
    let s = r.stats();
    assert_eq!((s.large.chunks_created, s.large.chunks_moved), (6, 0));
    assert_eq!((s.physical, s.large.free_mapped), (192 * MIB, 64 * MIB));
    assert!(s.physical as f64 <= 1.5 * 128.0 * MIB as f64);
    // Past the headroom, free pages move again.
    let _more = take(&r, MAIN, 64 * MIB);
    let s = r.stats();
    assert_eq!((s.large.chunks_created, s.large.chunks_moved), (6, 2));
    assert_eq!(s.physical, 192 * MIB);
    r.check_invariants().unwrap();
}

#[test]
fn headroom_past_what_the_device_holds_falls_back_to_moving() {
    // The pool is told of 256 MiB but the memory behind it holds 128 MiB.
    let backing = SimulatedBacking::new(128 * MIB, 2 * MIB).unwrap();
    let options = ExpandableOptions {
        maximum: Some(256 * MIB),
        headroom: Some(1.0),
        ..ExpandableOptions::default()
    };
    let r = ExpandableMemoryResource::new(backing, options).unwrap();
    let _live = two_free_pages_apart(&r);
    let _big = take(&r, MAIN, 64 * MIB);
    let s = r.stats();
    assert_eq!((s.large.chunks_moved, s.physical), (2, 128 * MIB));
    r.check_invariants().unwrap();
}

#[test]
fn headroom_must_be_a_fraction() {
    for h in [-0.01, 1.01, f64::NAN, f64::INFINITY] {
        let options = ExpandableOptions {
            headroom: Some(h),
            ..ExpandableOptions::default()
        };
        let e = ExpandableMemoryResource::simulated(64 * MIB, options).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{h}: {e}");
    }
}

#[test]
#[cfg(unix)]
fn export_finds_blocks_of_either_range_and_refuses_foreign_pointers() {
    let r = pool(256 * MIB, 0.05);
    let small = take(&r, MAIN, 4096);
    let large = take(&r, MAIN, 8 * MIB);
    // The simulated backing exports nothing: a block of either range reaches it.
    for p in [small, large] {
        let e = r.export_chunk(NonNull::new(p as *mut u8).unwrap());
        assert!(matches!(e, Err(Error::Unsupported(_))), "{e:?}");
    }
    let e = r.export_chunk(NonNull::new((large + 256 * MIB) as *mut u8).unwrap());
    assert!(matches!(e, Err(Error::UnknownPointer { .. })), "{e:?}");
    give(&r, MAIN, small, 4096);
    give(&r, MAIN, large, 8 * MIB);
}
