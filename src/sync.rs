//! The host crate's loom/std shim: atomics come from `carve_kernels::sync` (one switch for both
//! crates), locks and `Arc` from loom or std.

#[allow(unused_imports)]
pub(crate) use carve_kernels::sync::{atomic, spin_loop};

#[cfg(carve_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(carve_loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};
