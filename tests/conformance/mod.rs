//! The conformance suite: one set of checks that every [`MemoryResource`] must pass, in the
//! spirit of RMM's `mr_ref_test`. `tests/conformance_cpu.rs` and `tests/conformance_gpu.rs` each
//! hold one list of resources; [`conformance_suite!`] stamps out one `#[test]` per (resource,
//! check) pair, so adding a line to a list tests a new resource against everything here.
//!
//! What a resource cannot detect is stated in its list entry (a [`Detect::Unchecked`] with the
//! reason), and the check prints that reason instead of passing silently.
#![allow(dead_code)]

mod bad_frees;
mod memory_stats;
mod model;
mod requests;
mod shared;
mod stream_order;
mod subject;
mod workloads;

pub use bad_frees::*;
pub use memory_stats::*;
pub use requests::*;
pub use stream_order::*;
pub use subject::*;
pub use workloads::*;

/// Stamps out one `#[test]` per (resource, check) pair.
///
/// `conformance_suite!(env_fn; name => factory, ...)`: `env_fn()` returns `Option<E>` with
/// `E: Env` (`None` skips, after saying why), and `factory(&E)` returns a fresh
/// `Subject<R>` each call.
macro_rules! conformance_suite {
    ($env:ident; $($name:ident => $make:ident),* $(,)?) => {$(
        mod $name {
            conformance_suite!(@test $env, $make, $name, alignment);
            conformance_suite!(@test $env, $make, $name, zero_size);
            conformance_suite!(@test $env, $make, $name, huge_size);
            conformance_suite!(@test $env, $make, $name, bad_frees);
            conformance_suite!(@test $env, $make, $name, statistics);
            conformance_suite!(@test $env, $make, $name, memory_stats);
            conformance_suite!(@test $env, $make, $name, sizes_and_mixed);
            conformance_suite!(@test $env, $make, $name, concurrency);
            conformance_suite!(@test $env, $make, $name, stream_order);
        }
    )*};
    (@test $env:ident, $make:ident, $name:ident, $check:ident) => {
        #[test]
        fn $check() {
            let Some(env) = super::$env() else { return };
            crate::conformance::$check(stringify!($name), &env, &|| super::$make(&env));
            crate::conformance::Env::finish(&env, stringify!($name));
        }
    };
}
