//! The checks. Each takes the resource's name (for messages), the environment, and a factory
//! that builds a fresh [`Subject`] per call.

use std::ptr::NonNull;
use std::sync::Mutex;

use carve::{Error, MemoryResource};

use super::model::{ordered_after_free, FreedRanges, Live};
use super::{note, Detect, Env, Order, Subject, Usage, STREAMS};
use crate::common::rng::XorShift64Star as Rng;

/// Sizes every check tries, capped by the resource's `max_bytes`.
const SIZES: [usize; 8] = [1, 8, 255, 256, 1000, 3000, 4096, 10_000];

/// A size far beyond any machine, but one that passes the request checks.
const HUGE: usize = 1 << 50;

fn sizes<R>(s: &Subject<R>) -> impl Iterator<Item = usize> + '_ {
    SIZES.into_iter().filter(|&b| b <= s.max_bytes)
}

/// log2 of the largest alignment to try: the resource's maximum, at most `2^cap`.
fn align_log<R>(s: &Subject<R>, cap: usize) -> usize {
    ((usize::BITS - 1 - s.max_align.leading_zeros()) as usize).min(cap)
}

fn fills<R: MemoryResource>(s: &Subject<R>) -> bool {
    s.mr.properties().host_accessible
}

/// Frees every block of `live` on stream `i`, checking tags.
fn free_all<R: MemoryResource, E: Env>(
    name: &str,
    env: &E,
    s: &Subject<R>,
    live: &mut Live,
    i: usize,
) {
    while let Some(b) = live.take(name, 0) {
        // SAFETY: a live block of `s.mr` with these arguments, freed once.
        unsafe { s.mr.deallocate(env.stream(i), b.ptr, b.bytes, b.align) }
            .unwrap_or_else(|e| panic!("{name}: freeing {:?}+{}: {e}", b.ptr, b.bytes));
    }
}

fn assert_usage<R: MemoryResource>(name: &str, s: &Subject<R>, want: Option<Usage>, when: &str) {
    assert_eq!(s.usage_now(), want, "{name}: statistics changed {when}");
}

/// One allocation and free, to show the resource still works after whatever came before.
fn still_works<R: MemoryResource, E: Env>(name: &str, env: &E, s: &Subject<R>) {
    let p =
        s.mr.allocate(env.stream(0), 256, 256)
            .unwrap_or_else(|e| panic!("{name}: a plain allocation failed afterwards: {e}"));
    // SAFETY: just allocated with these arguments.
    unsafe { s.mr.deallocate(env.stream(0), p, 256, 256) }
        .unwrap_or_else(|e| panic!("{name}: a plain free failed afterwards: {e}"));
}

/// Every power-of-two alignment up to the resource's maximum (or 64 KiB) is honoured for every
/// size, blocks never overlap, bad alignments are `InvalidAlignment`, and alignments past the
/// maximum are `Unsupported`.
pub fn alignment<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let st = env.stream(0);
    for bad in [0, 3, 48, 1000, usize::MAX] {
        match s.mr.allocate(st, 64, bad) {
            Err(Error::InvalidAlignment(a)) => assert_eq!(a, bad, "{name}"),
            other => panic!("{name}: alignment {bad}: expected InvalidAlignment, got {other:?}"),
        }
    }
    let top = s.max_align.min(1 << 16);
    let mut align = 1;
    while align <= top {
        let mut live = Live::new(fills(&s));
        for bytes in sizes(&s) {
            let p =
                s.mr.allocate(st, bytes, align)
                    .unwrap_or_else(|e| panic!("{name}: allocate({bytes}, align {align}): {e}"));
            live.add(name, p, bytes, align);
        }
        free_all(name, env, &s, &mut live, 0);
        align *= 2;
    }
    if s.max_align < usize::MAX / 2 {
        match s.mr.allocate(st, 64, s.max_align * 2) {
            Err(Error::Unsupported(_)) => {}
            other => panic!(
                "{name}: alignment {} is past the stated maximum {}: expected Unsupported, \
                 got {other:?}",
                s.max_align * 2,
                s.max_align
            ),
        }
    }
    s.assert_invariants(name, "after the alignment checks");
}

/// A zero-byte request is `ZeroSize` at any alignment and changes nothing.
pub fn zero_size<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let before = s.usage_now();
    for align in [1, 256, 4096] {
        match s.mr.allocate(env.stream(0), 0, align) {
            Err(Error::ZeroSize) => {}
            other => panic!("{name}: allocate(0, {align}): expected ZeroSize, got {other:?}"),
        }
    }
    assert_usage(name, &s, before, "by refused zero-byte requests");
    still_works(name, env, &s);
    s.assert_invariants(name, "after zero-byte requests");
}

/// A huge request is `OutOfMemory` (or `InvalidArgument` past a stated `max_bytes`), so is a
/// huge alignment unless the machine can grant it (or `Unsupported` past a stated `max_align`),
/// sizes that overflow once aligned
/// are `SizeOverflow`, and none of them changes anything.
pub fn huge_size<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let st = env.stream(0);
    let before = s.usage_now();
    match s.mr.allocate(st, HUGE, 256) {
        Err(Error::InvalidArgument(_)) if HUGE > s.max_bytes => {}
        Err(Error::OutOfMemory { bytes, .. }) if HUGE <= s.max_bytes => {
            assert!(
                bytes >= HUGE,
                "{name}: the error names {bytes} bytes, not the {HUGE} requested"
            )
        }
        other => panic!(
            "{name}: allocate(2^50): expected {}, got {other:?}",
            if HUGE > s.max_bytes {
                "InvalidArgument"
            } else {
                "OutOfMemory"
            }
        ),
    }
    match s.mr.allocate(st, 64, 1 << 40) {
        Err(Error::Unsupported(_)) if s.max_align < 1 << 40 => {}
        Err(Error::OutOfMemory { .. }) if s.max_align >= 1 << 40 => {}
        // A 1 TiB-aligned block is only address space: a machine with room for it (overcommit)
        // may grant it, and then it must be honoured and freeable.
        Ok(p) if s.max_align >= 1 << 40 => {
            assert_eq!(p.as_ptr() as usize % (1 << 40), 0, "{name}: misaligned");
            // SAFETY: allocated just above with these arguments, and never used.
            unsafe { s.mr.deallocate(st, p, 64, 1 << 40) }.unwrap();
        }
        other => {
            panic!("{name}: allocate(64, align 2^40): expected a typed refusal, got {other:?}")
        }
    }
    for (bytes, align) in [
        (usize::MAX, 1),
        (usize::MAX, 256),
        (usize::MAX - 100, 256),
        (isize::MAX as usize, 256),
        (1, 1 << (usize::BITS - 1)),
    ] {
        match s.mr.allocate(st, bytes, align) {
            Err(Error::SizeOverflow { .. }) => {}
            other => panic!(
                "{name}: allocate({bytes:#x}, {align:#x}): expected SizeOverflow, got {other:?}"
            ),
        }
    }
    assert_usage(name, &s, before, "by refused huge requests");
    still_works(name, env, &s);
    s.assert_invariants(name, "after huge requests");
}

/// The typed errors that refuse a free (a zero size is refused as a zero-size request).
fn refused(e: &Error) -> bool {
    matches!(
        e,
        Error::UnknownPointer { .. }
            | Error::DoubleFree { .. }
            | Error::SizeMismatch { .. }
            | Error::ZeroSize
    )
}

/// Frees the resource cannot honour: a foreign pointer, an interior pointer, a block of a
/// sibling instance, a wrong size and a double free are refused with typed errors, and leave the
/// statistics, the invariants and the live blocks untouched; or, where the list entry says the
/// resource accepts one by design ([`Detect::Accepted`]), it frees the block. Done for a small
/// and a large block, since resources route sizes differently.
pub fn bad_frees<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    for bytes in [1000, 100_000].into_iter().filter(|&b| b <= s.max_bytes) {
        bad_frees_of(&format!("{name} ({bytes} bytes)"), env, &s, make, bytes);
    }
    still_works(name, env, &s);
}

fn bad_frees_of<R: MemoryResource, E: Env>(
    name: &str,
    env: &E,
    s: &Subject<R>,
    make: &dyn Fn() -> Subject<R>,
    bytes: usize,
) {
    let st = env.stream(0);
    let before = s.usage_now();
    let mut live = Live::new(fills(s));
    let p = s.mr.allocate(st, bytes, 256).unwrap();
    live.add(name, p, bytes, 256);
    let during = s.usage_now();

    let expect_refused = |what: &str, r: carve::Result<()>| match r {
        Err(e) if refused(&e) => {}
        other => panic!("{name}: {what}: expected a typed refusal, got {other:?}"),
    };
    match s.foreign {
        Detect::Refused => {
            let mut local = [0u8; 64];
            let stack = NonNull::from(&mut local).cast::<u8>();
            // SAFETY: a pointer the resource never handed out, on purpose: it must refuse it
            // before touching it.
            let r = unsafe { s.mr.deallocate(st, stack, bytes, 256) };
            assert!(
                matches!(r, Err(Error::UnknownPointer { .. })),
                "{name}: free of a stack address: expected UnknownPointer, got {r:?}"
            );
            let interior = NonNull::new(p.as_ptr().wrapping_add(256)).unwrap();
            // SAFETY: an interior pointer of a live block, on purpose; refused untouched.
            let r = unsafe { s.mr.deallocate(st, interior, bytes - 256, 256) };
            expect_refused("free of an interior pointer", r);
        }
        Detect::Accepted(why) | Detect::Unchecked(why) => {
            note(name, &format!("foreign pointers not checked: {why}"))
        }
    }
    match s.sibling {
        Detect::Refused => {
            let other = make();
            let q = other.mr.allocate(st, bytes, 256).unwrap();
            // SAFETY: a block of another instance, on purpose: refused untouched.
            let r = unsafe { s.mr.deallocate(st, q, bytes, 256) };
            assert!(
                matches!(r, Err(Error::UnknownPointer { .. })),
                "{name}: free of a sibling instance's block: expected UnknownPointer, got {r:?}"
            );
            // SAFETY: the block's own free, into its own resource.
            unsafe { other.mr.deallocate(st, q, bytes, 256) }
                .unwrap_or_else(|e| panic!("{name}: the sibling could not free its block: {e}"));
        }
        Detect::Accepted(why) => {
            note(name, &format!("a sibling's block is freed: {why}"));
            let other = make();
            let q = other.mr.allocate(st, bytes, 256).unwrap();
            // SAFETY: the sibling's block, freed once, through a resource documented to free
            // it; the sibling never frees it again.
            let r = unsafe { s.mr.deallocate(st, q, bytes, 256) };
            assert!(r.is_ok(), "{name}: free of a sibling's block: {r:?}");
        }
        Detect::Unchecked(why) => note(name, &format!("sibling blocks not checked: {why}")),
    }
    assert_usage(name, s, during, "by refused frees");
    s.assert_invariants(name, "after refused frees");
    let mut freed = false;
    match s.size_mismatch {
        Detect::Refused => {
            // Sizes across routing thresholds too (bins, superblocks, over-alignment).
            for wrong in [bytes / 2, bytes + 256, 0, 1 << 16, 1 << 20] {
                // SAFETY: the wrong size on purpose: refused untouched.
                let r = unsafe { s.mr.deallocate(st, p, wrong, 256) };
                expect_refused(&format!("free of {bytes} bytes as {wrong}"), r);
            }
        }
        Detect::Accepted(why) => {
            note(name, &format!("a smaller size frees the block: {why}"));
            let blk = live.take(name, 0).unwrap();
            // SAFETY: the block's one free, with a size the resource documents as accepted.
            let r = unsafe { s.mr.deallocate(st, blk.ptr, bytes - 1, 256) };
            assert!(
                r.is_ok(),
                "{name}: free of {bytes} bytes as {}: {r:?}",
                bytes - 1
            );
            freed = true;
        }
        Detect::Unchecked(why) => note(name, &format!("size mismatches not checked: {why}")),
    }
    if !freed {
        assert_usage(name, s, during, "by refused frees");
        s.assert_invariants(name, "after refused frees");
        let blk = live.take(name, 0).unwrap();
        // SAFETY: the block's one correct free.
        unsafe { s.mr.deallocate(st, blk.ptr, blk.bytes, blk.align) }
            .unwrap_or_else(|e| panic!("{name}: the correct free after refused ones failed: {e}"));
    }
    match s.double_free {
        Detect::Refused => {
            // SAFETY: a double free on purpose: refused before anything is touched.
            let r = unsafe { s.mr.deallocate(st, p, bytes, 256) };
            assert!(
                matches!(
                    r,
                    Err(Error::DoubleFree { .. } | Error::UnknownPointer { .. })
                ),
                "{name}: double free: expected DoubleFree or UnknownPointer, got {r:?}"
            );
        }
        Detect::Accepted(why) | Detect::Unchecked(why) => {
            note(name, &format!("double frees not checked: {why}"))
        }
    }
    assert_usage(name, s, before, "after the block's correct free");
    s.assert_invariants(name, "after a double free");
}

/// Statistics follow each allocation and free, and return exactly to where they started.
pub fn statistics<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let probe = match s.usage {
        Ok(f) => f,
        Err(why) => {
            note(name, &format!("no statistics: {why}"));
            return;
        }
    };
    let st = env.stream(0);
    let base = probe(&s.mr);
    let mut prev = base;
    let mut requested = 0;
    let mut blocks = Vec::new();
    for (k, bytes) in sizes(&s).enumerate() {
        let p = s.mr.allocate(st, bytes, 256).unwrap();
        blocks.push((p, bytes));
        requested += bytes;
        let u = probe(&s.mr);
        assert!(
            u.bytes > prev.bytes && u.bytes >= base.bytes + requested,
            "{name}: after allocating {bytes} bytes, bytes in use went {} -> {} ({requested} \
             requested in all)",
            prev.bytes,
            u.bytes
        );
        if let Some(b) = base.blocks {
            assert_eq!(
                u.blocks,
                Some(b + k + 1),
                "{name}: live blocks after {k} allocations"
            );
        }
        prev = u;
    }
    while let Some((p, bytes)) = blocks.pop() {
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { s.mr.deallocate(st, p, bytes, 256) }.unwrap();
        let u = probe(&s.mr);
        assert!(
            u.bytes < prev.bytes,
            "{name}: freeing {bytes} bytes took bytes in use {} -> {}",
            prev.bytes,
            u.bytes
        );
        if let Some(b) = base.blocks {
            assert_eq!(
                u.blocks,
                Some(b + blocks.len()),
                "{name}: live blocks after a free"
            );
        }
        prev = u;
    }
    assert_eq!(prev, base, "{name}: statistics after freeing everything");
}

/// RMM's various and mixed random allocations: sizes from bytes to megabytes (also through the
/// synchronous forms), then a seeded mix of allocations and frees over several streams; blocks
/// stay aligned, disjoint and intact.
pub fn sizes_and_mixed<R: MemoryResource, E: Env>(
    name: &str,
    env: &E,
    make: &dyn Fn() -> Subject<R>,
) {
    let s = make();
    let before = s.usage_now();
    let mut live = Live::new(fills(&s));
    for bytes in [4, 1 << 10, 1 << 16, 1 << 20]
        .into_iter()
        .filter(|&b| b <= s.max_bytes)
    {
        let p = s.mr.allocate(env.stream(1), bytes, 256);
        let p = p.unwrap_or_else(|e| panic!("{name}: allocate({bytes}): {e}"));
        live.add(name, p, bytes, 256);
        free_all(name, env, &s, &mut live, 1);
        // The synchronous forms, on the default stream.
        let p = s.mr.allocate_sync(bytes, 256);
        let p = p.unwrap_or_else(|e| panic!("{name}: allocate_sync({bytes}): {e}"));
        live.add(name, p, bytes, 256);
        let b = live.take(name, 0).unwrap();
        // SAFETY: just allocated with these arguments; freed once.
        unsafe { s.mr.deallocate_sync(b.ptr, b.bytes, b.align) }
            .unwrap_or_else(|e| panic!("{name}: deallocate_sync({bytes}): {e}"));
    }
    let mut rng = Rng::new(0x5eed);
    let max = s.max_bytes.min(64 << 10);
    let mut allocs = 0;
    for _ in 0..400 {
        if live.is_empty() || (rng.range(0, 99) < 53 && allocs < 200) {
            let bytes = rng.range(1, max);
            let align = 1 << rng.range(0, align_log(&s, 12));
            let st = env.stream(rng.range(0, STREAMS - 1));
            match s.mr.allocate(st, bytes, align) {
                Ok(p) => {
                    live.add(name, p, bytes, align);
                    allocs += 1;
                }
                Err(Error::OutOfMemory { .. }) => {}
                Err(e) => panic!("{name}: allocate({bytes}, {align}): {e}"),
            }
        } else {
            let b = live.take(name, rng.next() as usize).unwrap();
            let st = env.stream(rng.range(0, STREAMS - 1));
            // SAFETY: a live block of `s.mr`, freed once.
            unsafe { s.mr.deallocate(st, b.ptr, b.bytes, b.align) }
                .unwrap_or_else(|e| panic!("{name}: free: {e}"));
        }
    }
    assert!(
        allocs > 50,
        "{name}: only {allocs} of the mixed allocations succeeded"
    );
    free_all(name, env, &s, &mut live, 2);
    assert_usage(name, &s, before, "after freeing everything");
    s.assert_invariants(name, "after mixed allocations");
}

/// Threads on their own streams allocate (up to 64 KiB; on the CPU that runs into the test's
/// memory cap at times), hand some blocks to each other to free, and free: no two live blocks
/// ever overlap (a shared map checks every handout), tags survive, out-of-memory is the only
/// error, and everything is returned at the end.
pub fn concurrency<R: MemoryResource, E: Env>(name: &str, env: &E, make: &dyn Fn() -> Subject<R>) {
    let s = make();
    let before = s.usage_now();
    let fill = fills(&s);
    let global = Mutex::new(std::collections::BTreeMap::<usize, usize>::new());
    let handoff = Mutex::new(Vec::new());
    let max = s.max_bytes.min(64 << 10);
    let max_align_log = align_log(&s, 10);
    let claim = |p: NonNull<u8>, bytes: usize| {
        let a = p.as_ptr() as usize;
        let mut g = global.lock().unwrap();
        if let Some((&b, &len)) = g.range(..=a).next_back() {
            assert!(
                b + len <= a,
                "{name}: {a:#x}+{bytes} handed out while {b:#x}+{len} is live"
            );
        }
        if let Some((&b, _)) = g.range(a..).next() {
            assert!(
                a + bytes <= b,
                "{name}: {a:#x}+{bytes} handed out over live {b:#x}"
            );
        }
        g.insert(a, bytes);
    };
    let release = |p: NonNull<u8>| {
        global.lock().unwrap().remove(&(p.as_ptr() as usize));
    };
    let start = std::sync::Barrier::new(STREAMS);
    let (successes, refusals) = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..STREAMS)
            .map(|t| {
                let (s, claim, release, handoff) = (&s, &claim, &release, &handoff);
                let start = &start;
                scope.spawn(move || {
                    start.wait();
                    let st = env.stream(t);
                    let mut rng = Rng::new(0xc0ffee + t as u64);
                    let mut live = Live::new(fill);
                    let (mut ok, mut oom) = (0, 0);
                    for i in 0..300 {
                        if live.len() < 96 && rng.range(0, 2) > 0 {
                            let bytes = rng.range(1, max);
                            let align = 1 << rng.range(0, max_align_log);
                            match s.mr.allocate(st, bytes, align) {
                                Ok(p) => {
                                    claim(p, bytes);
                                    live.add(name, p, bytes, align);
                                    ok += 1;
                                }
                                Err(Error::OutOfMemory { .. }) => oom += 1,
                                Err(e) => panic!("{name}: thread {t}: allocate({bytes}): {e}"),
                            }
                        } else if let Some(b) = live.take(name, rng.next() as usize) {
                            release(b.ptr);
                            if i % 5 == 0 {
                                // Another thread frees it, on its own stream.
                                handoff.lock().unwrap().push(b);
                                continue;
                            }
                            // SAFETY: a live block of `s.mr`, freed once.
                            unsafe { s.mr.deallocate(st, b.ptr, b.bytes, b.align) }
                                .unwrap_or_else(|e| panic!("{name}: thread {t}: free: {e}"));
                        }
                        let theirs = handoff.lock().unwrap().pop();
                        if let Some(b) = theirs {
                            // SAFETY: a block another thread allocated and gave up, freed once.
                            unsafe { s.mr.deallocate(st, b.ptr, b.bytes, b.align) }
                                .unwrap_or_else(|e| panic!("{name}: thread {t}: free: {e}"));
                        }
                    }
                    while let Some(b) = live.take(name, 0) {
                        release(b.ptr);
                        // SAFETY: as above.
                        unsafe { s.mr.deallocate(st, b.ptr, b.bytes, b.align) }.unwrap();
                    }
                    (ok, oom)
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|h| h.join().unwrap())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d))
    });
    for b in handoff.into_inner().unwrap() {
        // SAFETY: blocks handed off but not yet freed; all threads are done.
        unsafe { s.mr.deallocate(env.stream(0), b.ptr, b.bytes, b.align) }.unwrap();
    }
    assert!(
        successes > 100,
        "{name}: only {successes} allocations succeeded"
    );
    if refusals > 0 {
        note(
            name,
            &format!("{refusals} requests ran out of memory under contention"),
        );
    }
    env.synchronize();
    assert_usage(name, &s, before, "after the threads freed everything");
    s.assert_invariants(name, "after concurrent use");
    still_works(name, env, &s);
}

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
