//! The segment callback over simulated backings: it hears of exactly the chunks mapped and
//! unmapped, in order, before a block on them is handed out.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use super::expandable::{ExpandableMemoryResource, ExpandableOptions};
use super::*;

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
const A: StreamRef<'static> = StreamRef::simulated(1);

type Log = Arc<Mutex<Vec<SegmentEvent>>>;

fn logger() -> (Log, SegmentCallback) {
    let log: Log = Arc::default();
    let l = log.clone();
    (log, Arc::new(move |e| l.lock().unwrap().push(e)))
}

fn take(log: &Log) -> Vec<SegmentEvent> {
    std::mem::take(&mut *log.lock().unwrap())
}

fn ev(addr: usize, size: usize, change: SegmentChange) -> SegmentEvent {
    SegmentEvent { addr, size, change }
}

fn resource(expandable: bool, capacity: usize, cb: Option<SegmentCallback>) -> Vm {
    let backing = Arc::new(SimulatedBacking::new(capacity, PAGE).unwrap());
    let mut o = if expandable {
        VirtualOptions::expandable()
    } else {
        VirtualOptions::new()
    };
    o.on_segment = cb;
    VirtualMemoryResource::new(backing, o.maximum(capacity)).unwrap()
}

type Vm = VirtualMemoryResource<Arc<SimulatedBacking>>;

fn alloc<R: MemoryResource>(r: &R, bytes: usize) -> usize {
    r.allocate(A, bytes, 256).unwrap().as_ptr() as usize
}

fn free<R: MemoryResource>(r: &R, p: usize, bytes: usize) {
    // SAFETY: simulated memory is never touched; the block came from `r` with `bytes`.
    unsafe { r.deallocate(A, NonNull::new(p as *mut u8).unwrap(), bytes, 256) }.unwrap()
}

/// Applies `events` to the set of mapped chunk addresses, checking that each maps an unmapped
/// chunk or unmaps a mapped one.
fn apply(set: &mut BTreeSet<usize>, events: &[SegmentEvent], size: usize) {
    for e in events {
        assert_eq!(e.size, size, "{e:?}");
        match e.change {
            SegmentChange::Mapped => assert!(set.insert(e.addr), "mapped twice: {e:?}"),
            SegmentChange::Unmapped => assert!(set.remove(&e.addr), "never mapped: {e:?}"),
        }
    }
}

fn mapped_now(r: &Vm) -> BTreeSet<usize> {
    let st = lock(&r.inner.state);
    let set = st.pages.mapped_segments(SegmentChange::Mapped);
    set.map(|e| e.addr).collect()
}

#[test]
fn the_callback_sees_each_chunk_mapped_and_each_trimmed() {
    let (log, cb) = logger();
    let r = resource(false, 64 * MIB, Some(cb));
    let a = alloc(&r, 3 * MIB);
    assert_eq!(
        take(&log),
        [
            ev(a, PAGE, SegmentChange::Mapped),
            ev(a + PAGE, PAGE, SegmentChange::Mapped)
        ]
    );
    let b = alloc(&r, 1000);
    assert_eq!(take(&log), [ev(b, PAGE, SegmentChange::Mapped)]);
    free(&r, a, 3 * MIB);
    assert!(take(&log).is_empty(), "a free unmaps nothing");
    // The free pages serve the next block: nothing mapped.
    let c = alloc(&r, PAGE);
    assert!(take(&log).is_empty());
    assert_eq!(r.stats().maps, 3);
    free(&r, c, PAGE);
    free(&r, b, 1000);
    assert_eq!(r.trim().unwrap(), 3 * PAGE);
    let mut gone: Vec<usize> = take(&log)
        .into_iter()
        .map(|e| {
            assert_eq!((e.size, e.change), (PAGE, SegmentChange::Unmapped));
            e.addr
        })
        .collect();
    gone.sort();
    let mut want = vec![a, a + PAGE, b];
    want.sort();
    assert_eq!(gone, want);
    assert_eq!(r.stats().unmaps, 3);
}

/// Chunks that move are announced unmapped where they were, then mapped where they go.
#[test]
fn moved_chunks_are_unmapped_then_mapped() {
    let (log, cb) = logger();
    let r = resource(true, 16 * MIB, Some(cb));
    let blocks: Vec<usize> = (0..8).map(|_| alloc(&r, PAGE)).collect();
    let mut set = BTreeSet::new();
    apply(&mut set, &take(&log), PAGE);
    assert_eq!(set.len(), 8);
    for &p in blocks.iter().step_by(2) {
        free(&r, p, PAGE);
    }
    let big = alloc(&r, 8 * MIB);
    let events = take(&log);
    assert_eq!(r.stats().chunks_moved, 4);
    assert_eq!(events.len(), 8, "{events:?}");
    // Unmapped as each moves; mapped once access to the new run is granted.
    let changes: Vec<_> = events.iter().map(|e| e.change).collect();
    assert_eq!(changes[..4], [SegmentChange::Unmapped; 4]);
    assert_eq!(changes[4..], [SegmentChange::Mapped; 4]);
    apply(&mut set, &events, PAGE);
    assert_eq!(set, mapped_now(&r));
    assert!((0..4).all(|k| set.contains(&(big + k * PAGE))));
}

#[test]
fn a_new_callback_hears_of_chunks_already_mapped_and_none_hears_after_removal() {
    let r = resource(true, 32 * MIB, None);
    let a = alloc(&r, 5 * MIB);
    let (log, cb) = logger();
    r.set_segment_callback(Some(cb));
    let mut set = BTreeSet::new();
    apply(&mut set, &take(&log), PAGE);
    assert_eq!(set, (0..3).map(|k| a + k * PAGE).collect());
    r.set_segment_callback(None);
    let _b = alloc(&r, 5 * MIB);
    assert!(take(&log).is_empty());
}

#[test]
fn dropping_announces_every_mapped_chunk_unmapped() {
    let (log, cb) = logger();
    let r = resource(true, 32 * MIB, Some(cb));
    let _a = alloc(&r, 5 * MIB);
    let mut set = BTreeSet::new();
    apply(&mut set, &take(&log), PAGE);
    let backing = r.backing().clone();
    drop(r);
    apply(&mut set, &take(&log), PAGE);
    assert!(set.is_empty());
    assert_eq!(backing.counters().physical, 0);
}

#[test]
fn a_panicking_callback_is_counted_and_the_resource_stays_whole() {
    let before = crate::deferred::deferred_error_count();
    let cb: SegmentCallback = Arc::new(|_| panic!("the callback fails"));
    let r = resource(true, 32 * MIB, Some(cb));
    let a = alloc(&r, 5 * MIB);
    assert_eq!(r.segment_callback_panics(), 3);
    assert!(crate::deferred::deferred_error_count() >= before + 3);
    r.check_invariants().unwrap();
    free(&r, a, 5 * MIB);
    assert_eq!(r.trim().unwrap(), 3 * PAGE);
    assert_eq!(r.segment_callback_panics(), 6);
    r.check_invariants().unwrap();
    let _b = alloc(&r, 1000);
    r.check_invariants().unwrap();
}

/// A callback that allocates from its own resource does not deadlock: the events its
/// allocation causes are delivered by the loop that runs it, after it returns.
#[test]
fn a_callback_may_allocate_from_its_resource() {
    let r = resource(false, 32 * MIB, None);
    let (log, inner) = logger();
    let nested: Arc<Mutex<Option<usize>>> = Arc::default();
    let (r2, n2) = (r.clone(), nested.clone());
    let cb: SegmentCallback = Arc::new(move |e| {
        inner(e);
        let mut n = n2.lock().unwrap();
        if n.is_none() {
            *n = Some(alloc(&r2, PAGE));
        }
    });
    r.set_segment_callback(Some(cb));
    let a = alloc(&r, PAGE);
    let b = nested.lock().unwrap().expect("allocated in the callback");
    assert_eq!(
        take(&log),
        [
            ev(a, PAGE, SegmentChange::Mapped),
            ev(b, PAGE, SegmentChange::Mapped)
        ]
    );
    r.set_segment_callback(None); // the callback holds a clone of `r`: break the cycle
}

#[test]
fn the_expandable_pool_reports_both_ranges() {
    let (log, cb) = logger();
    let options = ExpandableOptions {
        on_segment: Some(cb),
        ..ExpandableOptions::default()
    };
    let r = ExpandableMemoryResource::simulated(256 * MIB, options).unwrap();
    let small = alloc(&r, 4096);
    let large = alloc(&r, 3 * MIB);
    let events = take(&log);
    assert_eq!(events.len(), 2, "{events:?}");
    assert!(events.contains(&ev(small & !(PAGE - 1), PAGE, SegmentChange::Mapped)));
    assert!(events.contains(&ev(large, 32 * MIB, SegmentChange::Mapped)));
    free(&r, small, 4096);
    free(&r, large, 3 * MIB);
    r.trim().unwrap();
    let gone = take(&log);
    assert_eq!(gone.len(), 2);
    assert!(gone.iter().all(|e| e.change == SegmentChange::Unmapped));
}

/// Random allocations, frees and trims in both modes: the chunks the callback believes mapped
/// are always the page table's, and cover every live block.
#[test]
fn random_sequences_keep_the_callback_in_step() {
    use rand::rngs::SmallRng;
    use rand::{RngExt, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(35);
    for round in 0..16 {
        let (log, cb) = logger();
        let r = resource(round % 2 == 0, 48 * MIB, Some(cb));
        let (mut set, mut live) = (BTreeSet::new(), Vec::<(usize, usize)>::new());
        for _ in 0..200 {
            let roll = rng.random_range(0..100);
            if roll < 55 {
                let bytes = if rng.random_bool(0.8) {
                    rng.random_range(1..64 << 10)
                } else {
                    rng.random_range(1..12 * MIB)
                };
                match r.allocate(A, bytes, 256) {
                    Ok(p) => live.push((p.as_ptr() as usize, bytes)),
                    Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                }
            } else if roll < 97 && !live.is_empty() {
                let (p, bytes) = live.swap_remove(rng.random_range(0..live.len()));
                free(&r, p, bytes);
            } else {
                r.trim().unwrap();
            }
            apply(&mut set, &take(&log), PAGE);
            assert_eq!(set, mapped_now(&r));
            for &(p, bytes) in &live {
                let first = (p - r.base()) / PAGE;
                let last = (p + bytes - 1 - r.base()) / PAGE;
                assert!((first..=last).all(|i| set.contains(&(r.base() + i * PAGE))));
            }
        }
    }
}

/// Threads allocating at once: each block is on chunks the callback has heard of by the time
/// its allocation returns.
#[test]
fn threads_see_their_chunks_announced_before_their_blocks() {
    let set: Arc<Mutex<BTreeSet<usize>>> = Arc::default();
    let s = set.clone();
    let cb: SegmentCallback = Arc::new(move |e| {
        let mut s = s.lock().unwrap();
        match e.change {
            SegmentChange::Mapped => assert!(s.insert(e.addr)),
            SegmentChange::Unmapped => assert!(s.remove(&e.addr)),
        }
    });
    let r = resource(true, 64 * MIB, Some(cb));
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let (r, set) = (&r, &set);
            scope.spawn(move || {
                let stream = StreamRef::simulated(t + 1);
                for k in 0..200usize {
                    let bytes = 1 + (k * 7919 + t * 104729) % (3 * MIB);
                    let Ok(p) = r.allocate(stream, bytes, 256) else {
                        continue;
                    };
                    let p = p.as_ptr() as usize;
                    {
                        let set = set.lock().unwrap();
                        let first = (p - r.base()) / PAGE;
                        let last = (p + bytes - 1 - r.base()) / PAGE;
                        assert!((first..=last).all(|i| set.contains(&(r.base() + i * PAGE))));
                    }
                    let q = NonNull::new(p as *mut u8).unwrap();
                    // SAFETY: simulated memory; the block came from `r` with `bytes`.
                    unsafe { r.deallocate(stream, q, bytes, 256) }.unwrap();
                    if k % 50 == 49 {
                        r.trim().unwrap();
                    }
                }
            });
        }
    });
    assert_eq!(*set.lock().unwrap(), mapped_now(&r));
    assert_eq!(r.segment_callback_panics(), 0);
}
