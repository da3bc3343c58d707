use super::*;
use crate::resource::engine::coalescing::node::GRAIN;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::engine::stream_order::{HostOrder, OrderEvent, RecordingOrder};
use crate::stream::StreamRef;

const A: StreamRef<'static> = StreamRef::simulated(1);
const B: StreamRef<'static> = StreamRef::simulated(2);

fn core_with(size: usize) -> PoolCore {
    let mut c = PoolCore::default();
    c.add_chunk(1 << 20, size, Some(A.id()));
    c
}

#[test]
fn splits_and_coalesces_back_to_one_block() {
    let mut c = core_with(4096);
    let p: Vec<_> = (0..4)
        .map(|_| c.take(A.id(), 1000, GRAIN).unwrap())
        .collect();
    assert_eq!(c.in_use(), 4096);
    assert!(c.take(A.id(), 1, GRAIN).is_none());
    for i in [1, 3, 0] {
        c.free("t", A.id(), p[i].as_ptr() as usize, 1000).unwrap();
        c.check_invariants().unwrap();
    }
    let last = c.free("t", A.id(), p[2].as_ptr() as usize, 1000).unwrap();
    assert_eq!(last.empty.map(|e| e.size), Some(4096));
    assert_eq!(c.largest_free(), 4096);
    assert!(c.remove_chunk(1 << 20));
    c.check_invariants().unwrap();
    assert_eq!(c.pool_size(), 0);
}

#[test]
fn honours_large_alignment_and_keeps_the_padding() {
    let mut c = core_with(16 * GRAIN);
    let small = c.take(A.id(), 1, GRAIN).unwrap();
    let big = c.take(A.id(), 100, 2048).unwrap();
    assert_eq!(big.as_ptr() as usize % 2048, 0);
    c.check_invariants().unwrap();
    c.free("t", A.id(), big.as_ptr() as usize, 100).unwrap();
    c.free("t", A.id(), small.as_ptr() as usize, 1).unwrap();
    assert_eq!(c.largest_free(), 16 * GRAIN);
}

#[test]
fn other_streams_blocks_are_merged_only_through_the_order() {
    let mut c = core_with(2 * GRAIN);
    let x = c.take(A.id(), GRAIN, GRAIN).unwrap();
    let y = c.take(A.id(), GRAIN, GRAIN).unwrap();
    c.free("t", A.id(), x.as_ptr() as usize, GRAIN).unwrap();
    c.free("t", B.id(), y.as_ptr() as usize, GRAIN).unwrap();
    c.check_invariants().unwrap();
    let s = StreamRef::simulated(3);
    assert!(c.take(s.id(), 2 * GRAIN, GRAIN).is_none());
    let order = RecordingOrder::new();
    let p = allocate_from(
        &mut c,
        &order,
        OnStream::new(s),
        2 * GRAIN,
        GRAIN,
        Reach::Synchronize,
        None,
    )
    .unwrap();
    assert!(p.is_some());
    assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
    c.check_invariants().unwrap();
}

#[test]
fn sealed_blocks_cross_streams_with_one_wait_and_fresh_ones_never_do() {
    let mut c = core_with(4 * GRAIN);
    let order = RecordingOrder::new();
    let x = c.take(A.id(), GRAIN, GRAIN).unwrap();
    let _keep = c.take(A.id(), GRAIN, GRAIN).unwrap();
    free_into(
        &mut c,
        &order,
        "t",
        OnStream::new(A),
        x.as_ptr() as usize,
        GRAIN,
        false,
    )
    .unwrap();
    // Fresh on A: B may not wait on A's (older) mark for it.
    assert!(c.sealed_fit_elsewhere(B.id(), GRAIN, GRAIN).is_none());
    order.mark(A).unwrap();
    c.seal(A.id());
    let p = allocate_from(
        &mut c,
        &order,
        OnStream::new(B),
        GRAIN,
        GRAIN,
        Reach::Synchronize,
        None,
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        order.events(),
        vec![
            OrderEvent::Mark(A.id()),
            OrderEvent::Wait {
                waiter: B.id(),
                signaller: A.id()
            }
        ]
    );
    c.check_invariants().unwrap();
    c.free("t", B.id(), p.as_ptr() as usize, GRAIN).unwrap();
    c.check_invariants().unwrap();
}

#[test]
fn a_stream_is_marked_once_per_mark_every_frees_and_only_under_demand() {
    let mut c = core_with(1 << 20);
    let order = RecordingOrder::new();
    let cycle = |c: &mut PoolCore| {
        for _ in 0..MARK_EVERY {
            let p = c.take(A.id(), 300, GRAIN).unwrap();
            free_into(
                c,
                &order,
                "t",
                OnStream::new(A),
                p.as_ptr() as usize,
                300,
                false,
            )
            .unwrap();
        }
    };
    cycle(&mut c);
    assert_eq!(order.events(), vec![], "no stream wants A's blocks");
    // B runs short (A's blocks are fresh: reaching them takes a synchronisation).
    let p = allocate_from(
        &mut c,
        &order,
        OnStream::new(B),
        300,
        GRAIN,
        Reach::Synchronize,
        None,
    )
    .unwrap()
    .unwrap();
    assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
    cycle(&mut c);
    cycle(&mut c);
    assert_eq!(
        order.events(),
        vec![OrderEvent::SyncAll, OrderEvent::Mark(A.id())],
        "one mark per shortage"
    );
    c.free("t", B.id(), p.as_ptr() as usize, 300).unwrap();
    c.check_invariants().unwrap();
}

/// A holds two blocks and B one; B has allocated, so A's frees are marked at once when the
/// core marks every free.
fn shared_core(every: bool) -> (PoolCore, [usize; 2]) {
    let mut c = PoolCore::marking_every_free(every);
    c.add_chunk(1 << 20, 2 * GRAIN, Some(A.id()));
    c.add_chunk(1 << 21, GRAIN, Some(B.id()));
    let order = RecordingOrder::new();
    let mut take = |s| {
        let p = allocate_from(
            &mut c,
            &order,
            OnStream::new(s),
            GRAIN,
            GRAIN,
            Reach::Events,
            None,
        );
        p.unwrap().unwrap().as_ptr() as usize
    };
    let x = [take(A), take(A)];
    take(B);
    (c, x)
}

#[test]
fn marking_every_free_hands_a_block_over_once_the_device_is_past_it() {
    let (mut c, [x, _]) = shared_core(true);
    let order = RecordingOrder::new();
    free_into(&mut c, &order, "t", OnStream::new(A), x, GRAIN, false).unwrap();
    assert_eq!(order.events(), vec![OrderEvent::Mark(A.id())]);
    let p = allocate_from(
        &mut c,
        &order,
        OnStream::new(B),
        GRAIN,
        GRAIN,
        Reach::Events,
        None,
    )
    .unwrap();
    assert_eq!(p.map(|p| p.as_ptr() as usize), Some(x));
    assert_eq!(
        order.events(),
        vec![OrderEvent::Mark(A.id()), OrderEvent::Query(A.id())],
        "no wait, no synchronisation"
    );
    c.check_invariants().unwrap();

    // Off (the default), the same free is not marked and B cannot reach the block.
    let (mut c, [x, _]) = shared_core(false);
    let order = RecordingOrder::new();
    free_into(&mut c, &order, "t", OnStream::new(A), x, GRAIN, false).unwrap();
    let p = allocate_from(
        &mut c,
        &order,
        OnStream::new(B),
        GRAIN,
        GRAIN,
        Reach::Events,
        None,
    )
    .unwrap();
    assert!(p.is_none());
    assert_eq!(order.events(), vec![]);
}

#[test]
fn a_mark_the_device_has_not_passed_costs_a_wait_and_is_not_asked_again_at_once() {
    let (mut c, [x, y]) = shared_core(true);
    let order = RecordingOrder::pending();
    let wait = OrderEvent::Wait {
        waiter: B.id(),
        signaller: A.id(),
    };
    for (p, expected) in [
        (
            x,
            vec![OrderEvent::Mark(A.id()), OrderEvent::Query(A.id()), wait],
        ),
        // Within QUERY_EVERY allocations of the answer "not yet": no query.
        (y, vec![OrderEvent::Mark(A.id()), wait]),
    ] {
        let seen = order.events().len();
        free_into(&mut c, &order, "t", OnStream::new(A), p, GRAIN, false).unwrap();
        let q = allocate_from(
            &mut c,
            &order,
            OnStream::new(B),
            GRAIN,
            GRAIN,
            Reach::Events,
            None,
        )
        .unwrap();
        assert_eq!(q.map(|q| q.as_ptr() as usize), Some(p));
        assert_eq!(order.events()[seen..], expected);
        c.check_invariants().unwrap();
    }
}

#[test]
fn refuses_foreign_pointers_and_double_frees() {
    let mut c = core_with(4 * GRAIN);
    let p = c.take(A.id(), 10, GRAIN).unwrap().as_ptr() as usize;
    assert!(matches!(
        c.free("t", A.id(), 0x10, 10),
        Err(Error::UnknownPointer { .. })
    ));
    assert!(matches!(
        c.free("t", A.id(), p, 11),
        Err(Error::SizeMismatch { .. })
    ));
    c.free("t", A.id(), p, 10).unwrap();
    assert!(matches!(
        c.free("t", A.id(), p, 10),
        Err(Error::DoubleFree { .. })
    ));
    c.check_invariants().unwrap();
}

/// Random allocations and frees on three streams in one small chunk, through every path
/// (own blocks, waits, merges): invariants hold after each step and live blocks never
/// overlap.
#[test]
fn random_multi_stream_sequences_keep_every_invariant() {
    use rand::rngs::SmallRng;
    use rand::{RngExt, SeedableRng};
    let mut rng = SmallRng::seed_from_u64(7);
    for round in 0..600 {
        let mut c = PoolCore::marking_every_free(round % 2 == 1);
        c.add_chunk(1 << 30, 64 * GRAIN, None);
        let mut live: Vec<(usize, usize, usize)> = vec![];
        for _ in 0..60 {
            let s = StreamRef::simulated(rng.random_range(0..3));
            if rng.random_bool(0.6) {
                let bytes = rng.random_range(1..8 * GRAIN);
                let align = GRAIN << rng.random_range(0..3);
                if let Some(p) = allocate_from(
                    &mut c,
                    &HostOrder,
                    OnStream::new(s),
                    bytes,
                    align,
                    Reach::Synchronize,
                    None,
                )
                .unwrap()
                {
                    let a = p.as_ptr() as usize;
                    assert_eq!(a % align, 0);
                    let end = a + bytes;
                    assert!(live.iter().all(|&(b, n, _)| end <= b || b + n <= a));
                    live.push((a, bytes, align));
                }
            } else if !live.is_empty() {
                let (p, bytes, _) = live.swap_remove(rng.random_range(0..live.len()));
                free_into(&mut c, &HostOrder, "t", OnStream::new(s), p, bytes, false).unwrap();
            }
            c.check_invariants().unwrap();
        }
    }
}
