//! Slot claiming: each stream gets one slot, found again at once; streams beyond the slots
//! still allocate and free (through the shared ready stack).

use std::ptr::NonNull;

use super::{FixedSizeMemoryResource, FixedSizeOptions, STREAM_SLOTS};
use crate::resource::{HostMemoryResource, MemoryResource};
use crate::stream::StreamRef;

fn resource() -> FixedSizeMemoryResource<HostMemoryResource> {
    let opts = FixedSizeOptions::new(256).blocks_per_refill(4);
    FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap()
}

fn slot_addr(mr: &FixedSizeMemoryResource<HostMemoryResource>, s: StreamRef<'_>) -> Option<usize> {
    mr.inner.slot_of(s).map(|slot| slot as *const _ as usize)
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
    let mut freed_by_slotless: Vec<usize> = blocks[STREAM_SLOTS..]
        .iter()
        .map(|(_, p)| p.as_ptr() as usize)
        .collect();
    freed_by_slotless.sort_unstable();
    for (s, p) in blocks {
        // SAFETY: allocated above with 200 bytes, freed once.
        unsafe { mr.deallocate(s, p, 200, 256) }.unwrap();
    }
    assert_eq!(mr.stats().blocks_in_use, 0);
    mr.check_invariants().unwrap();
    // Blocks freed on slotless streams (after a wait on that stream) are free to any stream.
    let slotless: Vec<usize> = freed_by_slotless;
    let total = mr.stats().total_blocks;
    let s = StreamRef::simulated(STREAM_SLOTS + 3);
    let again: Vec<_> = (0..slotless.len())
        .map(|_| mr.allocate(s, 200, 256).unwrap())
        .collect();
    assert_eq!(
        mr.stats().total_blocks,
        total,
        "no refill while they are free"
    );
    let mut got: Vec<usize> = again.iter().map(|p| p.as_ptr() as usize).collect();
    got.sort_unstable();
    assert_eq!(got, slotless);
    for p in again {
        // SAFETY: as above.
        unsafe { mr.deallocate(s, p, 200, 256) }.unwrap();
    }
    mr.check_invariants().unwrap();
}
