//! Errors that happened where nothing could return them: in `Drop` (a pool giving its chunks
//! back, a buffer freeing itself, a driver pool being destroyed) and in undo paths that already
//! report another error. cudarc defers such errors the same way.
//!
//! The first one is kept until [`take_deferred_error`] takes it; later ones are only counted
//! ([`deferred_error_count`]), so a burst of failures in one teardown cannot grow memory.
//!
//! ```
//! // After dropping resources, check that their teardown went through.
//! if let Some(e) = carve::take_deferred_error() {
//!     eprintln!("teardown failed: {e}");
//! }
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::error::{Error, Result};
use crate::sync::lock;

/// A failure that no caller could receive when it happened.
#[derive(Debug)]
pub struct DeferredError {
    /// What was being done, e.g. `"PoolMemoryResource drop: returning a chunk upstream"`.
    pub context: &'static str,
    /// The error itself.
    pub error: Error,
}

impl fmt::Display for DeferredError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.context, self.error)
    }
}

impl std::error::Error for DeferredError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

static FIRST: Mutex<Option<DeferredError>> = Mutex::new(None);
static COUNT: AtomicU64 = AtomicU64::new(0);

/// Takes the first deferred error recorded since the last call (process-wide), if any.
pub fn take_deferred_error() -> Option<DeferredError> {
    lock(&FIRST).take()
}

/// How many deferred errors were recorded since the process started (taken or not).
pub fn deferred_error_count() -> u64 {
    COUNT.load(Ordering::Relaxed)
}

/// Records `result`'s error, if any, as deferred. Never panics, never blocks on I/O. Public so
/// that bindings (the Python package's buffers) record their destructors' errors here too.
pub fn record<T>(context: &'static str, result: Result<T>) {
    if let Err(error) = result {
        COUNT.fetch_add(1, Ordering::Relaxed);
        let mut first = lock(&FIRST);
        if first.is_none() {
            *first = Some(DeferredError { context, error });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The slot is process-wide and other unit tests may record into it concurrently, so this
    // test only checks what a concurrent recorder cannot change: the count grows, and a taken
    // error is one that was recorded.
    #[test]
    fn records_count_and_first_error() {
        let before = deferred_error_count();
        record::<()>("unit test", Err(Error::ZeroSize));
        record::<()>("unit test", Ok(()));
        assert!(deferred_error_count() > before);
        let taken = take_deferred_error().expect("one was recorded");
        assert!(!taken.to_string().is_empty());
    }
}
