//! The host crate's loom/std shim: atomics come from `carve_kernels::sync` (one switch for both
//! crates), locks and `Arc` from loom or std; and [`lock`], the one way carve takes a mutex.

#[allow(unused_imports)]
pub(crate) use carve_kernels::sync::{atomic, spin_loop};

#[cfg(carve_loom)]
#[allow(unused_imports)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

#[cfg(not(carve_loom))]
#[allow(unused_imports)]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

use std::sync::PoisonError;

/// Locks `m`, ignoring poisoning. A critical section that calls out while it holds a lock (a
/// stream order, a physical backing) puts its books back with an undo guard before a panic
/// leaves it, so a lock that a panicking thread held still guards consistent data, and
/// poisoning carries no information.
#[inline]
pub(crate) fn lock<M: Lock + ?Sized>(m: &M) -> M::Guard<'_> {
    m.lock_unpoisoned()
}

/// A mutex [`lock`] takes: std's, and loom's under `--cfg carve_loom`, or an `Arc` of one.
pub(crate) trait Lock {
    /// What holding the lock gives.
    type Guard<'a>
    where
        Self: 'a;
    /// Locks, taking the data of a poisoned lock as it is.
    fn lock_unpoisoned(&self) -> Self::Guard<'_>;
}

impl<T: ?Sized> Lock for std::sync::Mutex<T> {
    type Guard<'a>
        = std::sync::MutexGuard<'a, T>
    where
        T: 'a;
    #[inline]
    fn lock_unpoisoned(&self) -> Self::Guard<'_> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<M: Lock + ?Sized> Lock for std::sync::Arc<M> {
    type Guard<'a>
        = M::Guard<'a>
    where
        M: 'a;
    #[inline]
    fn lock_unpoisoned(&self) -> Self::Guard<'_> {
        (**self).lock_unpoisoned()
    }
}

#[cfg(carve_loom)]
impl<M: Lock + ?Sized> Lock for loom::sync::Arc<M> {
    type Guard<'a>
        = M::Guard<'a>
    where
        M: 'a;
    #[inline]
    fn lock_unpoisoned(&self) -> Self::Guard<'_> {
        (**self).lock_unpoisoned()
    }
}

#[cfg(carve_loom)]
impl<T> Lock for loom::sync::Mutex<T> {
    type Guard<'a>
        = loom::sync::MutexGuard<'a, T>
    where
        T: 'a;
    #[inline]
    fn lock_unpoisoned(&self) -> Self::Guard<'_> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
