//! Prefetch managed allocations to their device, as RMM's `prefetch_resource_adaptor`.
//!
//! The prefetch call itself lives at the bottom of this file for now. It is the one place to
//! point at the shared managed-memory helpers (issue 3) once they land.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::driver::Device;
use crate::error::Result;
use crate::resource::prefetch_raw;
use crate::resource::{Location, MemoryResource, Properties};
use crate::stream::StreamRef;

/// After each allocation, queues a prefetch of the whole block to `device` on the allocation's
/// stream, so the first kernel that touches managed memory does not fault it in page by page.
///
/// The upstream must hand out managed memory (`cuMemAllocManaged` or a managed pool); for other
/// memory the driver refuses the prefetch, and the allocation fails with that error after the
/// block is given back.
#[derive(Debug)]
pub struct PrefetchResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R> {
    upstream: R,
    device: Device,
}

impl<R> Clone for PrefetchResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> PrefetchResourceAdaptor<R> {
    /// Prefetches `upstream`'s blocks to `device`.
    pub fn new(upstream: R, device: &Device) -> Self {
        Self {
            inner: Arc::new(Inner {
                upstream,
                device: device.clone(),
            }),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// The device blocks are prefetched to.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract.
unsafe impl<R: MemoryResource> MemoryResource for PrefetchResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let ptr = self.inner.upstream.allocate(stream, bytes, align)?;
        if let Err(e) = prefetch_to_device(ptr, bytes, &self.inner.device, stream) {
            // SAFETY: just allocated with these arguments; nothing was queued that uses it.
            let undo = unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) };
            crate::deferred::record("PrefetchResourceAdaptor: undoing an allocation", undo);
            return Err(e);
        }
        Ok(ptr)
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

fn prefetch_to_device(
    ptr: NonNull<u8>,
    bytes: usize,
    device: &Device,
    stream: StreamRef<'_>,
) -> Result<()> {
    device.bind()?;
    prefetch_raw(
        ptr.as_ptr() as u64,
        bytes,
        Location::Device(device.ordinal()),
        stream,
    )
}
