//! [`ImportedChunk`]: a virtual-memory chunk that another process exported
//! ([`VirtualMemoryResource::export_chunk`](super::VirtualMemoryResource::export_chunk)), mapped
//! into this process.

use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::ptr::NonNull;

use super::backing::{PhysicalBacking, PhysicalHandle};
use super::cuda_backing::{CudaBacking, CudaBackingOptions};
use crate::driver::Device;
use crate::error::{Error, Result};

/// Another process's chunk, mapped read-write on one device at an address of this process's
/// own (not the exporter's). Both processes map the same physical memory, so each sees the
/// other's writes once they are ordered (for example, synchronise before signalling the other
/// process). Drop unmaps it here and drops this process's reference; the exporter's mapping is
/// untouched.
pub struct ImportedChunk {
    backing: CudaBacking,
    handle: PhysicalHandle,
    va: usize,
    size: usize,
    /// Whether `[va, va + size)` maps `handle` (drop undoes exactly what `import` did).
    mapped: bool,
}

impl ImportedChunk {
    /// Maps the chunk behind `fd` (as [`export_chunk`] returned it, sent to this process) of
    /// `size` bytes, the size `export_chunk` reported. The descriptor stays the caller's.
    ///
    /// Errors: a size of zero or not a multiple of the device's allocation granularity, a
    /// descriptor the driver does not recognise, a size larger than the chunk, or a device
    /// without virtual memory management ([`Error::Unsupported`]).
    ///
    /// [`export_chunk`]: super::VirtualMemoryResource::export_chunk
    pub fn import(device: &Device, fd: BorrowedFd<'_>, size: usize) -> Result<Self> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let backing = CudaBacking::new(device, CudaBackingOptions::default())?;
        let grain = backing.granularity();
        if size % grain != 0 {
            return Err(Error::InvalidArgument(format!(
                "ImportedChunk: {size} bytes is not a multiple of the device's allocation \
                 granularity ({grain})"
            )));
        }
        // The driver takes the descriptor as a pointer-sized handle, and reads 0 as none given.
        let copy;
        let fd = if fd.as_raw_fd() == 0 {
            copy = fd.try_clone_to_owned().map_err(|e| {
                Error::InvalidArgument(format!("ImportedChunk: duplicating descriptor 0: {e}"))
            })?;
            copy.as_fd()
        } else {
            fd
        };
        let handle = backing.import_fd(fd)?;
        let va = match backing.reserve(size, grain) {
            Ok(va) => va,
            Err(e) => {
                // SAFETY: imported just now, mapped nowhere, not used again.
                let released = unsafe { backing.release(handle, size) };
                crate::deferred::record(
                    "ImportedChunk: releasing after a failed reserve",
                    released,
                );
                return Err(e);
            }
        };
        // From here on, drop undoes whatever succeeded.
        let mut chunk = ImportedChunk {
            backing,
            handle,
            va,
            size,
            mapped: false,
        };
        // SAFETY: `va` is our fresh reservation of `size` bytes, aligned to the granularity, and
        // `handle` a live chunk (the driver refuses a chunk smaller than `size`).
        unsafe { chunk.backing.map(va, size, handle) }?;
        chunk.mapped = true;
        // SAFETY: the range was mapped just above.
        unsafe { chunk.backing.set_access(va, size) }?;
        Ok(chunk)
    }

    /// The chunk's address in this process.
    pub fn as_ptr(&self) -> NonNull<u8> {
        NonNull::new(self.va as *mut u8).expect("a reservation is never at address 0")
    }

    /// The chunk's size in bytes (never zero).
    pub fn len(&self) -> usize {
        self.size
    }

    /// Always false: an imported chunk is at least one granule.
    pub fn is_empty(&self) -> bool {
        false
    }
}

impl Drop for ImportedChunk {
    fn drop(&mut self) {
        // The device may still use the mapping: finish its work first.
        crate::deferred::record(
            "ImportedChunk drop: synchronising the device",
            self.backing.device().synchronize(),
        );
        // SAFETY: the mapping (if made), the reservation and the handle are ours, made in
        // `import`, and each goes exactly once, in this order.
        unsafe {
            if self.mapped {
                let r = self.backing.unmap(self.va, self.size);
                crate::deferred::record("ImportedChunk drop: unmapping", r);
            }
            let r = self.backing.free_reservation(self.va, self.size);
            crate::deferred::record("ImportedChunk drop: freeing the reservation", r);
            let r = self.backing.release(self.handle, self.size);
            crate::deferred::record("ImportedChunk drop: releasing", r);
        }
    }
}

impl fmt::Debug for ImportedChunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportedChunk")
            .field("device", &self.backing.device().ordinal())
            .field("ptr", &format_args!("{:#x}", self.va))
            .field("size", &self.size)
            .finish()
    }
}
