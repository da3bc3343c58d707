//! loom models of the fixed-size free list: every interleaving of 2-3 threads.
//! Run: `RUSTFLAGS="--cfg carve_loom" cargo test --release --lib loom`

use std::ptr::NonNull;

use loom::thread;

use super::stack::{Links, TaggedStack, NIL};
use super::{FixedSizeMemoryResource, FixedSizeOptions};
use crate::resource::engine::stream_order::HostOrder;
use crate::resource::memory_resource::MemoryResource;
use crate::resource::source::host::HostMemoryResource;
use crate::stream::StreamRef;
use crate::sync::atomic::AtomicU32;
use crate::sync::Arc;

struct Nodes(Vec<AtomicU32>);
impl Links for Nodes {
    fn next(&self, i: u32) -> &AtomicU32 {
        &self.0[i as usize]
    }
}

fn drain(s: &TaggedStack, links: &Nodes) -> Vec<u32> {
    let mut v = Vec::new();
    while let Some(i) = s.pop(links) {
        v.push(i);
    }
    v.sort_unstable();
    v
}

/// Two threads pop and push back concurrently: no index is lost or duplicated, and both pops
/// return distinct indices (ABA would hand one out twice).
#[test]
fn concurrent_pop_push_keeps_every_index_once() {
    loom::model(|| {
        let links = Arc::new(Nodes((0..3).map(|_| AtomicU32::new(NIL)).collect()));
        let stack = Arc::new(TaggedStack::new());
        for i in 0..3 {
            stack.push(&*links, i);
        }
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let (l, s) = (links.clone(), stack.clone());
                thread::spawn(move || {
                    let got = s.pop(&*l).expect("3 indices for 2 threads");
                    s.push(&*l, got);
                    got
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(drain(&stack, &links), vec![0, 1, 2]);
    });
}

/// The ABA schedule: one thread pops A then B and pushes A back while another is mid-pop.
#[test]
fn aba_cannot_install_a_stale_next() {
    loom::model(|| {
        let links = Arc::new(Nodes((0..3).map(|_| AtomicU32::new(NIL)).collect()));
        let stack = Arc::new(TaggedStack::new());
        for i in [2, 1, 0] {
            stack.push(&*links, i);
        }
        let (l, s) = (links.clone(), stack.clone());
        let t = thread::spawn(move || s.pop(&*l));
        let a = stack.pop(&*links);
        let b = stack.pop(&*links);
        if let Some(a) = a {
            stack.push(&*links, a);
        }
        let other = t.join().unwrap();
        let mut held: Vec<u32> = [other, b].into_iter().flatten().collect();
        held.extend(drain(&stack, &links));
        held.sort_unstable();
        assert_eq!(held, vec![0, 1, 2]);
    });
}

fn small_resource(per_refill: u32) -> FixedSizeMemoryResource<HostMemoryResource> {
    small_resource_with(per_refill, 4)
}

/// At most `refills` refills. Models that run past one refill inside the model depend on where
/// the system allocator puts slabs, so models with two threads take one refill, made up front.
fn small_resource_with(
    per_refill: u32,
    refills: usize,
) -> FixedSizeMemoryResource<HostMemoryResource> {
    let opts = FixedSizeOptions::new(256)
        .blocks_per_refill(per_refill)
        .max_refills(refills)
        .order(std::sync::Arc::new(HostOrder));
    FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap()
}

/// Allocation racing with refill: both threads find the stack empty; one refills. Neither
/// block is handed out twice, nothing leaks, and at most one extra slab is fetched.
#[test]
fn alloc_races_refill_without_leak_or_double_handout() {
    loom::model(|| {
        let mr = small_resource(2);
        let s = StreamRef::simulated(1);
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let mr = mr.clone();
                thread::spawn(move || mr.allocate(s, 100, 256).unwrap().as_ptr() as usize)
            })
            .collect();
        let ptrs: Vec<usize> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_ne!(ptrs[0], ptrs[1]);
        let stats = mr.stats();
        assert_eq!(stats.blocks_in_use, 2);
        assert!(stats.slabs <= 2, "{stats:?}");
        mr.check_invariants().unwrap();
        for p in ptrs {
            // SAFETY: from this resource, freed once.
            unsafe { mr.deallocate(s, NonNull::new(p as *mut u8).unwrap(), 100, 256) }.unwrap();
        }
        assert_eq!(mr.stats().blocks_in_use, 0);
        mr.check_invariants().unwrap();
    });
}

/// Alloc/free on two streams while the second steals the first's stack: blocks stay unique.
#[test]
fn alloc_free_across_streams_with_stealing() {
    loom::model(|| {
        // Two blocks, one slab: b must take a's spare, and then p once it is freed.
        let mr = small_resource_with(2, 1);
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let p = mr.allocate(a, 256, 256).unwrap();
        let mr2 = mr.clone();
        let t = thread::spawn(move || {
            // SAFETY: allocated above on `a`, freed once.
            unsafe { mr2.deallocate(a, p, 256, 256) }.unwrap();
        });
        let q = mr.allocate(b, 256, 256).unwrap();
        t.join().unwrap();
        let r = mr.allocate(b, 256, 256).unwrap();
        assert_ne!(q, r);
        assert_eq!(mr.stats().blocks_in_use, 2);
        mr.check_invariants().unwrap();
    });
}

/// Sealing races with stealing: one thread frees two blocks on `a` (the second free seals them
/// under a mark if `b` ran short by then) while another allocates twice on `b` with no refill
/// left (taking a's sealed stack or gathering its fresh blocks). Every block is handed out once and none is lost.
#[test]
fn sealing_races_with_stealing_without_loss_or_double_handout() {
    loom::model(|| {
        // One slab of 4 blocks, and no second refill: b must take a's blocks.
        let mr = small_resource_with(4, 1);
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let p = mr.allocate(a, 256, 256).unwrap();
        let q = mr.allocate(a, 256, 256).unwrap();
        let mr2 = mr.clone();
        let t = thread::spawn(move || {
            for x in [p, q] {
                // SAFETY: allocated above on `a`, freed once.
                unsafe { mr2.deallocate(a, x, 256, 256) }.unwrap();
            }
        });
        let r = mr.allocate(b, 256, 256).unwrap();
        let s = mr.allocate(b, 256, 256).unwrap();
        t.join().unwrap();
        assert_ne!(r, s);
        let stats = mr.stats();
        assert_eq!(stats.blocks_in_use, 2);
        assert_eq!(stats.slabs, 1, "{stats:?}");
        mr.check_invariants().unwrap();
    });
}

/// Two threads claim slots for the same two streams in opposite orders: each stream gets one
/// slot that both threads agree on, the streams get different slots, and a third stream finds
/// none left.
#[test]
fn slot_claims_race_without_sharing_or_splitting() {
    loom::model(|| {
        let mr = small_resource(1);
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let addr = |mr: &FixedSizeMemoryResource<HostMemoryResource>, s| {
            mr.inner.slot_of(s).map(|c| c.slot as *const _ as usize)
        };
        let mr2 = mr.clone();
        let t = thread::spawn(move || (addr(&mr2, b), addr(&mr2, a)));
        let (a1, b1) = (addr(&mr, a), addr(&mr, b));
        let (b2, a2) = t.join().unwrap();
        assert!(a1.is_some() && b1.is_some());
        assert_eq!((a1, b1), (a2, b2));
        assert_ne!(a1, b1);
        assert_eq!(addr(&mr, StreamRef::simulated(3)), None);
    });
}

/// Both slots are claimed and empty, and no refill is left; one thread frees a block on `a`
/// while a third stream `c` allocates and so takes over a slot, maybe `a`'s. The free lands in
/// `a`'s slot before the take-over, or sees the new owner and goes elsewhere: `c` gets `a`'s
/// block only after an ordering call (or finds none yet), nothing is lost, nothing is handed
/// out twice.
#[test]
fn slot_take_over_races_a_free_on_the_old_stream() {
    use crate::resource::engine::stream_order::{CheckedOrder, OrderFaults};
    // The allocation runs the whole slow path: bound preemptions to keep the model finite.
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 100_000;
    builder.preemption_bound = Some(3);
    builder.check(|| {
        let order = CheckedOrder::new(OrderFaults::default());
        // One slab (a second one's place in the slab lookup would depend on the system
        // allocator): `a` takes one block, `b` the other after one device-wide sync.
        let opts = FixedSizeOptions::new(256)
            .blocks_per_refill(2)
            .max_refills(1)
            .order(order.clone());
        let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
        let checked = Arc::new(order.check(mr.clone()));
        let (a, b, c) = (
            StreamRef::simulated(1),
            StreamRef::simulated(2),
            StreamRef::simulated(3),
        );
        let p = checked.allocate(a, 256, 256).unwrap();
        let q = checked.allocate(b, 256, 256).unwrap();
        let p_addr = p.as_ptr() as usize;
        let freer = checked.clone();
        let t = thread::spawn(move || {
            let p = NonNull::new(p_addr as *mut u8).unwrap();
            // SAFETY: allocated above on `a`, freed once.
            unsafe { freer.deallocate(a, p, 256, 256) }.unwrap();
        });
        let r = checked.allocate(c, 256, 256);
        t.join().unwrap();
        assert_eq!(order.violations(), Vec::<String>::new());
        match r {
            Ok(r) => {
                assert_eq!(r.as_ptr() as usize, p_addr);
                assert_eq!(mr.stats().blocks_in_use, 2);
            }
            Err(e) => {
                assert!(e.is_out_of_memory(), "{e}");
                assert_eq!(mr.stats().blocks_in_use, 1);
            }
        }
        mr.check_invariants().unwrap();
        let _ = q;
    });
}
