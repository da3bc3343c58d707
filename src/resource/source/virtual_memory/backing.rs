//! Where a [`VirtualMemoryResource`](super::VirtualMemoryResource) gets address ranges and the
//! physical memory it maps into them: the [`PhysicalBacking`] trait. Implementations: the CUDA
//! driver ([`super::CudaBacking`]), host memory files ([`super::HostBacking`]), an address-only
//! simulation ([`SimulatedBacking`]), and a counting wrapper ([`super::CountingBacking`]).

use std::fmt;

#[cfg(doc)]
use super::SimulatedBacking;
use crate::error::{Error, Result};
use crate::resource::memory_resource::Properties;

/// A physical allocation, as the driver's `CUmemGenericAllocationHandle`.
pub type PhysicalHandle = u64;

/// Reserves virtual address ranges, creates physical chunks and maps them: the CUDA driver's
/// virtual memory management calls (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, ...), or
/// a simulation of them.
///
/// # Safety
/// Implementors promise that:
/// - [`reserve`](Self::reserve) returns a range aligned to [`granularity`](Self::granularity),
///   disjoint from every other live reservation and allocation in the process, that stays
///   reserved until [`free_reservation`](Self::free_reservation);
/// - [`create`](Self::create) returns a handle to `size` bytes of physical memory nobody else
///   uses, until [`release`](Self::release);
/// - after a successful [`map`](Self::map) and [`set_access`](Self::set_access) over it, the
///   range addresses the handle's memory with the access [`properties`](Self::properties)
///   state (for [`SimulatedBacking`]: no access at all), until [`unmap`](Self::unmap).
///
/// [`VirtualMemoryResource`](super::VirtualMemoryResource) relies on this to hand out blocks
/// without checking them.
pub unsafe trait PhysicalBacking: Send + Sync + fmt::Debug + 'static {
    /// The size and alignment unit of reservations, chunks and mappings.
    fn granularity(&self) -> usize;

    /// Who may dereference mapped memory.
    fn properties(&self) -> Properties;

    /// The device whose context the backing's driver calls run in (`None`: no driver).
    fn device(&self) -> Option<crate::driver::Device> {
        None
    }

    /// Reserves `size` bytes (a multiple of the granularity) of address space at an address
    /// aligned to `align` (a power-of-two multiple of the granularity); maps nothing.
    fn reserve(&self, size: usize, align: usize) -> Result<usize>;

    /// Returns a reservation.
    ///
    /// # Safety
    /// `(va, size)` is a live reservation of this backing with nothing mapped in it, never used
    /// again.
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()>;

    /// Creates a physical chunk of `size` bytes (a multiple of the granularity).
    fn create(&self, size: usize) -> Result<PhysicalHandle>;

    /// Frees a physical chunk of `size` bytes.
    ///
    /// # Safety
    /// `handle` came from [`create`](Self::create)`(size)`, is mapped nowhere, and is never
    /// used again.
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()>;

    /// Maps the whole of `handle` (of `size` bytes) at `va`. The memory may be used only once
    /// [`set_access`](Self::set_access) has covered it.
    ///
    /// # Safety
    /// `[va, va + size)` lies in a live reservation of this backing, is aligned to the
    /// granularity and has nothing mapped; `handle` is live and of `size` bytes.
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()>;

    /// Grants the access [`properties`](Self::properties) states to `[va, va + size)`, which
    /// one or more [`map`](Self::map)s cover wholly (one call for many mappings: on a GPU this
    /// is the expensive step).
    ///
    /// # Safety
    /// Every byte of the range is mapped by this backing.
    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        let _ = (va, size);
        Ok(())
    }

    /// Unmaps a mapping.
    ///
    /// # Safety
    /// `(va, size)` is exactly one earlier [`map`](Self::map), and no queued or running work
    /// and no live pointer uses the range any more.
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()>;

    /// A POSIX file descriptor for `handle`, for another process to import (only backings that
    /// created their chunks exportable support this).
    #[cfg(unix)]
    fn export_fd(&self, handle: PhysicalHandle) -> Result<std::os::fd::OwnedFd> {
        let _ = handle;
        Err(Error::Unsupported(format!(
            "{self:?} does not export its chunks"
        )))
    }
}

// SAFETY: pure delegation; the pointee upholds the contract.
unsafe impl<B: PhysicalBacking> PhysicalBacking for std::sync::Arc<B> {
    fn granularity(&self) -> usize {
        (**self).granularity()
    }
    fn properties(&self) -> Properties {
        (**self).properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        (**self).device()
    }
    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        (**self).reserve(size, align)
    }
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { (**self).free_reservation(va, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        (**self).create(size)
    }
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { (**self).release(handle, size) }
    }
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { (**self).map(va, size, handle) }
    }
    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { (**self).set_access(va, size) }
    }
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { (**self).unmap(va, size) }
    }
    #[cfg(unix)]
    fn export_fd(&self, handle: PhysicalHandle) -> Result<std::os::fd::OwnedFd> {
        (**self).export_fd(handle)
    }
}
