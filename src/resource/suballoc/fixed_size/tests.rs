//! Slot claiming: each stream gets one slot, found again at once; streams beyond the slots
//! take over slots that hold no block, or park their frees.

use std::ptr::NonNull;

use super::{FixedSizeMemoryResource, FixedSizeOptions, STREAM_SLOTS};
use crate::resource::memory_resource::MemoryResource;
use crate::resource::source::host::HostMemoryResource;
use crate::stream::StreamRef;

fn resource() -> FixedSizeMemoryResource<HostMemoryResource> {
    let opts = FixedSizeOptions::new(256).blocks_per_refill(4);
    FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap()
}

fn slot_addr(mr: &FixedSizeMemoryResource<HostMemoryResource>, s: StreamRef<'_>) -> Option<usize> {
    mr.inner.slot_of(s).map(|c| c.slot as *const _ as usize)
}

#[test]
fn every_stream_keeps_one_slot_until_the_slots_run_out() {
    let mr = resource();
    let streams: Vec<_> = (1..=STREAM_SLOTS + 1).map(StreamRef::simulated).collect();
    let first: Vec<_> = streams.iter().map(|&s| slot_addr(&mr, s)).collect();
    assert!(first[..STREAM_SLOTS].iter().all(Option::is_some));
    assert_eq!(first[STREAM_SLOTS], None, "more streams than slots");
    let mut distinct: Vec<_> = first.iter().flatten().collect();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), STREAM_SLOTS, "two streams share a slot");
    let again: Vec<_> = streams.iter().map(|&s| slot_addr(&mr, s)).collect();
    assert_eq!(again, first, "a stream found another slot");
}

#[test]
fn threads_claiming_the_same_streams_agree_on_their_slots() {
    let mr = resource();
    let streams: Vec<_> = (0..32).map(|i| StreamRef::simulated(100 + i)).collect();
    let seen: Vec<Vec<Option<usize>>> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..4)
            .map(|t| {
                let (mr, streams) = (&mr, &streams);
                // Each thread claims in another order, so claims race.
                scope.spawn(move || {
                    let mut got = vec![None; streams.len()];
                    for k in 0..streams.len() {
                        let i = (k * (2 * t + 1) + t) % streams.len();
                        got[i] = slot_addr(mr, streams[i]);
                    }
                    got
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(seen[0].iter().all(Option::is_some));
    for other in &seen[1..] {
        assert_eq!(other, &seen[0]);
    }
    let mut distinct = seen[0].clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), streams.len());
}

#[test]
fn streams_beyond_the_slots_still_allocate_and_free() {
    let mr = resource();
    let streams: Vec<_> = (1..=STREAM_SLOTS + 6).map(StreamRef::simulated).collect();
    let blocks: Vec<(StreamRef<'_>, NonNull<u8>)> = streams
        .iter()
        .map(|&s| (s, mr.allocate(s, 200, 256).unwrap()))
        .collect();
    assert_eq!(mr.stats().blocks_in_use, streams.len());
    mr.check_invariants().unwrap();
    for (s, p) in blocks {
        // SAFETY: allocated above with 200 bytes, freed once.
        unsafe { mr.deallocate(s, p, 200, 256) }.unwrap();
    }
    assert_eq!(mr.stats().blocks_in_use, 0);
    mr.check_invariants().unwrap();
    // Every free block is reachable again (own stacks, other streams' after one
    // synchronisation, parked ones too): a new stream takes them all without a refill.
    let total = mr.stats().total_blocks;
    let s = StreamRef::simulated(STREAM_SLOTS + 100);
    let again: Vec<_> = (0..total)
        .map(|_| mr.allocate(s, 200, 256).unwrap())
        .collect();
    assert_eq!(
        mr.stats().total_blocks,
        total,
        "no refill while blocks are free"
    );
    mr.check_invariants().unwrap();
    for p in again {
        // SAFETY: as above.
        unsafe { mr.deallocate(s, p, 200, 256) }.unwrap();
    }
    mr.check_invariants().unwrap();
}

/// Once every slot is claimed, a new stream takes over the slot of a stream whose stacks hold
/// no block; that stream finds no slot until it takes one over in turn.
#[test]
fn a_new_stream_takes_over_a_slot_whose_stacks_are_empty() {
    let opts = FixedSizeOptions::new(256).blocks_per_refill(1);
    let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
    let streams: Vec<_> = (1..=STREAM_SLOTS).map(StreamRef::simulated).collect();
    let held: Vec<_> = streams
        .iter()
        .map(|&s| (s, mr.allocate(s, 256, 256).unwrap()))
        .collect();
    let new = StreamRef::simulated(STREAM_SLOTS + 1);
    assert_eq!(slot_addr(&mr, new), None, "every slot is claimed");
    let p = mr.allocate(new, 256, 256).unwrap();
    let taken = slot_addr(&mr, new).expect("took a slot over");
    let losers: Vec<_> = streams
        .iter()
        .filter(|&&s| slot_addr(&mr, s).is_none())
        .collect();
    assert_eq!(losers.len(), 1, "exactly one stream lost its slot");
    // The stream that lost its slot frees into a slot it takes over (every stack is empty),
    // not into the parked list.
    let (s, q) = held.iter().copied().find(|(s, _)| s == losers[0]).unwrap();
    // SAFETY: allocated above, freed once.
    unsafe { mr.deallocate(s, q, 256, 256) }.unwrap();
    assert!(slot_addr(&mr, s).is_some());
    assert!(mr.inner.parked.is_empty());
    if slot_addr(&mr, s) == Some(taken) {
        assert_eq!(slot_addr(&mr, new), None, "two streams share a slot");
    }
    mr.check_invariants().unwrap();
    // SAFETY: as above.
    unsafe { mr.deallocate(new, p, 256, 256) }.unwrap();
    for (s2, b) in held.into_iter().filter(|&(s2, _)| s2 != s) {
        // SAFETY: as above.
        unsafe { mr.deallocate(s2, b, 256, 256) }.unwrap();
    }
    mr.check_invariants().unwrap();
    assert_eq!(mr.stats().blocks_in_use, 0);
}

/// A stream that runs dry while another holds many free blocks takes a share of them (as many
/// as it has in use, at least a refill's worth) after one device-wide synchronisation; the
/// other stream, still using blocks, keeps the rest on its own stacks rather than every stream
/// allocating through the shared one.
#[test]
fn a_short_stream_takes_a_share_and_a_busy_stream_keeps_the_rest() {
    use crate::resource::engine::stream_order::{CountingOrder, HostOrder};
    use std::sync::Arc;
    let order = Arc::new(CountingOrder::new(Arc::new(HostOrder)));
    let opts = FixedSizeOptions::new(256)
        .blocks_per_refill(8)
        .order(order.clone());
    let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
    let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
    let mut held: Vec<_> = (0..64).map(|_| mr.allocate(a, 256, 256).unwrap()).collect();
    for p in held.drain(4..) {
        // SAFETY: allocated above on `mr`, freed once.
        unsafe { mr.deallocate(a, p, 256, 256).unwrap() };
    }
    let p = mr.allocate(b, 256, 256).unwrap();
    assert_eq!(order.counts().device_synchronizations, 1);
    assert_eq!(
        mr.stats().slabs,
        8,
        "a slab was taken while 60 blocks were free"
    );
    let inner = &*mr.inner;
    let count = |s: &super::TaggedStack| s.snapshot(inner, 64).len();
    let slot = |s| inner.slot_of(s).unwrap().slot;
    let kept = count(&slot(a).fresh) + count(&slot(a).sealed);
    let taken = count(&slot(b).fresh) + count(&slot(b).sealed);
    assert_eq!(
        (kept, taken, count(&inner.ready)),
        (52, 7, 0),
        "(blocks stream a kept, stream b took, on the shared stack)"
    );
    // SAFETY: as above.
    unsafe { mr.deallocate(b, p, 256, 256).unwrap() };
    for p in held {
        // SAFETY: as above.
        unsafe { mr.deallocate(a, p, 256, 256).unwrap() };
    }
    mr.check_invariants().unwrap();
}
