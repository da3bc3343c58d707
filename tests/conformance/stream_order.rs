//! Stream order: a block freed on one stream reaches another only after the free.

use std::ptr::NonNull;

use carve::{Error, MemoryResource};

use super::model::{ordered_after_free, FreedRanges, Live};
use super::shared::{assert_usage, fills, free_all};
use super::subject::{note, Env, Order, Subject, STREAMS};
use crate::common::rng::XorShift64Star as Rng;

/// Stream ordering, as the environment checks it.
pub fn stream_order<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    env.stream_order(name, make);
}

/// Stream ordering on the CPU. For a [`Order::Recorded`] resource: fill it on stream A until it
/// runs out (or for a while), free everything on A, then take it all on stream B, and then mix
/// allocations and frees over several streams. Every block handed to a stream other than the one
/// that freed it must be ordered after that free in the log ([`ordered_after_free`]); at least
/// one such reuse must happen once the resource ran out. For [`Order::AtOnce`], a block freed on
/// A is simply usable on B.
///
/// Requests are whole blocks (powers of two from 256 bytes, or a fixed-size resource's block
/// size), so no block carries slack past its request: bytes the test never saw requested would
/// keep the stream of an older free in its bookkeeping.
pub fn recorded_stream_order<R: MemoryResource, E: Env>(
    name: &str,
    env: &E,
    make: &dyn Fn() -> Subject<R>,
) {
    let s = make();
    let order = match &s.order {
        Order::Recorded(o) => o.clone(),
        Order::AtOnce(why) => {
            note(name, &format!("frees take effect at once: {why}"));
            let p = s.mr.allocate(env.stream(1), 1000, 256).unwrap();
            // SAFETY: just allocated; freed once.
            unsafe { s.mr.deallocate(env.stream(1), p, 1000, 256) }.unwrap();
            let mut live = Live::new(fills(&s));
            let q = s.mr.allocate(env.stream(2), 1000, 256).unwrap();
            live.add(name, q, 1000, 256);
            free_all(name, env, &s, &mut live, 2);
            return;
        }
        Order::Unstated => panic!(
            "{name}: the list entry does not say how the resource orders streams \
             (.recorded(order) or .frees_at_once(why))"
        ),
    };
    let before = s.usage_now();
    let fixed = s.max_bytes < 1 << 20;
    let bytes = if fixed { s.max_bytes } else { 1024 };
    let (a, b) = (env.stream(1), env.stream(2));
    let mut freed = FreedRanges::default();
    let mut reuses = 0;
    let check = |p: NonNull<u8>, len: usize, user, freed: &mut FreedRanges| -> usize {
        let events = order.events();
        let mut n = 0;
        for (freer, at) in freed.reused(p.as_ptr() as usize, len) {
            if freer == user {
                continue;
            }
            n += 1;
            assert!(
                ordered_after_free(&events[at..], freer, user),
                "{name}: {p:?}+{len}, freed on stream {freer:#x}, was handed to stream {user:#x} with no \
                 ordering after the free; order log since: {:?}",
                &events[at..]
            );
        }
        n
    };

    let mut blocks = Vec::new();
    let mut ran_out = false;
    while blocks.len() < 8192 {
        match s.mr.allocate(a, bytes, 256) {
            Ok(p) => {
                reuses += check(p, bytes, a.id(), &mut freed);
                blocks.push(p);
            }
            Err(Error::OutOfMemory { .. }) => {
                ran_out = true;
                break;
            }
            Err(e) => panic!("{name}: filling on stream A: {e}"),
        }
    }
    for &p in &blocks {
        let at = order.events().len();
        // SAFETY: allocated above, freed once.
        unsafe { s.mr.deallocate(a, p, bytes, 256) }.unwrap();
        freed.freed(p.as_ptr() as usize, bytes, a.id(), at);
    }
    let n = blocks.len();
    blocks.clear();
    for k in 0..n {
        let p = s.mr.allocate(b, bytes, 256).unwrap_or_else(|e| {
            panic!("{name}: stream B could not take block {k} of the {n} stream A freed: {e}")
        });
        reuses += check(p, bytes, b.id(), &mut freed);
        blocks.push(p);
    }
    for p in blocks.drain(..) {
        let at = order.events().len();
        // SAFETY: allocated above, freed once.
        unsafe { s.mr.deallocate(b, p, bytes, 256) }.unwrap();
        freed.freed(p.as_ptr() as usize, bytes, b.id(), at);
    }
    if ran_out {
        assert!(
            reuses > 0,
            "{name}: ran out on stream A, yet B never reused A's memory"
        );
    } else {
        note(
            name,
            "did not run out on stream A: cross-stream reuse is not forced",
        );
    }

    let mut rng = Rng::new(0x0123);
    let mut live: Vec<(NonNull<u8>, usize)> = Vec::new();
    for _ in 0..3000 {
        let st = env.stream(rng.range(1, STREAMS - 1));
        if live.is_empty() || rng.range(0, 1) == 0 {
            let len = if fixed { bytes } else { 256 << rng.range(0, 6) };
            match s.mr.allocate(st, len, 256) {
                Ok(p) => {
                    reuses += check(p, len, st.id(), &mut freed);
                    live.push((p, len));
                }
                Err(Error::OutOfMemory { .. }) => {}
                Err(e) => panic!("{name}: mixed allocate({len}): {e}"),
            }
        } else {
            let (p, len) = live.swap_remove(rng.range(0, live.len() - 1));
            let at = order.events().len();
            // SAFETY: a live block, freed once.
            unsafe { s.mr.deallocate(st, p, len, 256) }.unwrap();
            freed.freed(p.as_ptr() as usize, len, st.id(), at);
        }
    }
    for (p, len) in live {
        // SAFETY: live blocks, freed once.
        unsafe { s.mr.deallocate(env.stream(1), p, len, 256) }.unwrap();
    }
    note(
        name,
        &format!("{reuses} cross-stream reuses, each ordered after its free"),
    );
    assert_usage(name, &s, before, "after the stream-order checks");
    s.assert_invariants(name, "after the stream-order checks");
}
