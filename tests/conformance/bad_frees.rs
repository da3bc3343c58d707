//! Frees the resource cannot honour, refused with typed errors.

use std::ptr::NonNull;

use carve::{Error, MemoryResource};

use super::model::Live;
use super::shared::{assert_usage, fills, still_works};
use super::subject::{note, Detect, Env, Subject};

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
