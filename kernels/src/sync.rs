//! The one place atomics come from, so loom can replace them (`--cfg carve_loom`).
//!
//! Device and host code import `crate::sync::atomic::*` and never `core::sync::atomic` directly.

/// Atomics: loom's under `carve_loom`, `core`'s otherwise (which lower to PTX `atom.*` on nvptx).
pub mod atomic {
    #[cfg(carve_loom)]
    pub use loom::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};

    #[cfg(not(carve_loom))]
    pub use core::sync::atomic::{fence, AtomicU32, AtomicU64, AtomicUsize, Ordering};
}

/// Spin-wait hint: yields to loom's scheduler under `carve_loom`.
#[inline]
pub fn spin_loop() {
    #[cfg(carve_loom)]
    loom::thread::yield_now();
    #[cfg(not(carve_loom))]
    core::hint::spin_loop();
}
