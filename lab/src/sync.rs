//! The lab's loom/std shim, as the library's: atomics from `carve_kernels::sync`, locks from
//! loom or std.

#[allow(unused_imports)]
pub(crate) use carve_kernels::sync::atomic;

#[cfg(carve_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Mutex, MutexGuard};

#[cfg(not(carve_loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Mutex, MutexGuard};
