//! Requests: alignments, zero sizes and huge sizes, refused with typed errors.

use carve::{Error, MemoryResource};

use super::model::Live;
use super::shared::{assert_usage, fills, free_all, sizes, still_works, HUGE};
use super::subject::{Env, Subject};

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
