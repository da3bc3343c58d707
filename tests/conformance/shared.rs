//! What the checks share: the sizes they try, and steps several of them take.

use carve::MemoryResource;

use super::model::Live;
use super::subject::{Env, Subject, Usage};

/// Sizes every check tries, capped by the resource's `max_bytes`.
pub const SIZES: [usize; 8] = [1, 8, 255, 256, 1000, 3000, 4096, 10_000];

/// A size far beyond any machine, but one that passes the request checks.
pub const HUGE: usize = 1 << 50;

pub fn sizes<R>(s: &Subject<R>) -> impl Iterator<Item = usize> + '_ {
    SIZES.into_iter().filter(|&b| b <= s.max_bytes)
}

/// log2 of the largest alignment to try: the resource's maximum, at most `2^cap`.
pub fn align_log<R>(s: &Subject<R>, cap: usize) -> usize {
    ((usize::BITS - 1 - s.max_align.leading_zeros()) as usize).min(cap)
}

pub fn fills<R: MemoryResource>(s: &Subject<R>) -> bool {
    s.mr.properties().host_accessible
}

/// Frees every block of `live` on stream `i`, checking tags.
pub fn free_all<R: MemoryResource, E: Env>(
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

pub fn assert_usage<R: MemoryResource>(
    name: &str,
    s: &Subject<R>,
    want: Option<Usage>,
    when: &str,
) {
    assert_eq!(s.usage_now(), want, "{name}: statistics changed {when}");
}

/// One allocation and free, to show the resource still works after whatever came before.
pub fn still_works<R: MemoryResource, E: Env>(name: &str, env: &E, s: &Subject<R>) {
    let p =
        s.mr.allocate(env.stream(0), 256, 256)
            .unwrap_or_else(|e| panic!("{name}: a plain allocation failed afterwards: {e}"));
    // SAFETY: just allocated with these arguments.
    unsafe { s.mr.deallocate(env.stream(0), p, 256, 256) }
        .unwrap_or_else(|e| panic!("{name}: a plain free failed afterwards: {e}"));
}
