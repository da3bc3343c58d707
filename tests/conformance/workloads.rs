//! Workloads: statistics that follow them, mixed sizes over several streams, and threads.

use std::ptr::NonNull;
use std::sync::Mutex;

use carve::{Error, MemoryResource};

use super::model::Live;
use super::shared::{align_log, assert_usage, fills, free_all, sizes, still_works};
use super::subject::{note, Env, Subject, STREAMS};
use crate::common::rng::XorShift64Star as Rng;

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
