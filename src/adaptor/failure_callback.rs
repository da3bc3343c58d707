//! On out-of-memory, ask a callback whether to retry, as RMM's `failure_callback_resource_adaptor`.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::Result;
use crate::resource::{MemoryResource, Properties};
use crate::stream::StreamRef;

/// Calls `callback(bytes)` whenever the upstream runs out of memory, and retries the request
/// while the callback returns `true`. The callback typically frees caches or spills, then says
/// whether trying again can help. Errors other than out-of-memory are returned at once.
///
/// A callback that always returns `true` retries forever, as in RMM: count attempts in it.
pub struct FailureCallbackResourceAdaptor<R, F> {
    inner: Arc<Inner<R, F>>,
}

struct Inner<R, F> {
    upstream: R,
    callback: F,
}

impl<R, F> Clone for FailureCallbackResourceAdaptor<R, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: fmt::Debug, F> fmt::Debug for FailureCallbackResourceAdaptor<R, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FailureCallbackResourceAdaptor")
            .field("upstream", &self.inner.upstream)
            .finish_non_exhaustive()
    }
}

impl<R, F> FailureCallbackResourceAdaptor<R, F>
where
    R: MemoryResource,
    F: Fn(usize) -> bool + Send + Sync,
{
    /// Wraps `upstream`, calling `callback(bytes)` on each out-of-memory failure.
    pub fn new(upstream: R, callback: F) -> Self {
        Self {
            inner: Arc::new(Inner { upstream, callback }),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract.
unsafe impl<R, F> MemoryResource for FailureCallbackResourceAdaptor<R, F>
where
    R: MemoryResource,
    F: Fn(usize) -> bool + Send + Sync,
{
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        loop {
            match self.inner.upstream.allocate(stream, bytes, align) {
                Err(e) if e.is_out_of_memory() && (self.inner.callback)(bytes) => continue,
                other => return other,
            }
        }
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) }
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}
