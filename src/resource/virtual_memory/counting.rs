//! [`CountingBacking`]: a backing that counts the physical bytes in its chunks, and bounds them.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::error::{Error, Result};
use crate::resource::Properties;

/// A backing that counts the physical bytes in chunks (created and not released) and their
/// peak, for resources that share one backing.
#[derive(Debug)]
pub struct CountingBacking<B> {
    inner: B,
    limit: usize,
    physical: AtomicUsize,
    peak: AtomicUsize,
}

impl<B: PhysicalBacking> CountingBacking<B> {
    /// Counts `inner`'s chunks, refusing to create more than `limit` bytes of them.
    pub fn new(inner: B, limit: usize) -> Self {
        CountingBacking {
            inner,
            limit,
            physical: 0.into(),
            peak: 0.into(),
        }
    }
    /// The backing counted.
    pub fn inner(&self) -> &B {
        &self.inner
    }
    /// Physical bytes in chunks now.
    pub fn physical(&self) -> usize {
        self.physical.load(Relaxed)
    }
    /// The most physical bytes in chunks at once.
    pub fn peak_physical(&self) -> usize {
        self.peak.load(Relaxed)
    }
}

// SAFETY: pure delegation, plus counters.
unsafe impl<B: PhysicalBacking> PhysicalBacking for CountingBacking<B> {
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn properties(&self) -> Properties {
        self.inner.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.device()
    }
    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.inner.reserve(size, align)
    }
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.free_reservation(va, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        let now = self.physical.fetch_add(size, Relaxed) + size;
        let created = if now > self.limit {
            Err(Error::OutOfMemory {
                bytes: size,
                resource: "CountingBacking",
                detail: format!(
                    "{} bytes are in chunks, the limit is {}",
                    now - size,
                    self.limit
                ),
            })
        } else {
            self.inner.create(size)
        };
        match created {
            Ok(h) => {
                self.peak.fetch_max(now, Relaxed);
                Ok(h)
            }
            Err(e) => {
                self.physical.fetch_sub(size, Relaxed);
                Err(e)
            }
        }
    }
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.release(handle, size)? };
        self.physical.fetch_sub(size, Relaxed);
        Ok(())
    }
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.map(va, size, handle) }
    }
    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.set_access(va, size) }
    }
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.unmap(va, size) }
    }
    #[cfg(unix)]
    fn export_fd(&self, handle: PhysicalHandle) -> Result<std::os::fd::OwnedFd> {
        self.inner.export_fd(handle)
    }
}
