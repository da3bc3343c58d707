//! Sharing driver pools between processes: a pool exported as a POSIX file descriptor
//! ([`AsyncMemoryResource::export_fd`]) is imported as an [`ImportedPool`]; a block of it,
//! exported as [`PointerExport`] data, is imported as an [`ImportedPointer`] in the other
//! process. Imported pools cannot allocate (the driver refuses), so they are no resource.

use std::fmt;
use std::ptr::NonNull;

use cudarc::driver::sys;

use super::{AsyncMemoryResource, PoolHandle};
use crate::driver::{mem, Device};
use crate::error::{Error, Result};
use crate::resource::engine::release::{release_in_drop, release_once};
use crate::stream::StreamRef;

/// The driver's opaque description of one pool block (`CUmemPoolPtrExportData`, 64 bytes),
/// to send to the importing process (it holds no handle, only data).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PointerExport(pub [u8; 64]);

impl fmt::Debug for PointerExport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PointerExport(")?;
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        f.write_str(")")
    }
}

impl PointerExport {
    /// Lowercase hex, 128 characters (for a command line or an environment variable).
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex)'s output.
    pub fn from_hex(hex: &str) -> Result<Self> {
        let bad = || Error::InvalidArgument(format!("not 64 bytes of hex: {hex:?}"));
        if hex.len() != 128 || !hex.is_ascii() {
            return Err(bad());
        }
        let mut out = [0u8; 64];
        for (i, b) in out.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
        }
        Ok(PointerExport(out))
    }
}

impl AsyncMemoryResource {
    /// Describes `ptr`, a live block of this pool, for another process that imported the pool
    /// (`cuMemPoolExportPointer`). The pool must have been created with
    /// [`AsyncPoolOptions::ipc_export`](super::AsyncPoolOptions::ipc_export); the driver refuses
    /// pointers of other pools with an error.
    pub fn export_pointer(&self, ptr: NonNull<u8>) -> Result<PointerExport> {
        if !self.inner.ipc_export {
            return Err(Error::Unsupported(
                "the pool was not created with AsyncPoolOptions::ipc_export".into(),
            ));
        }
        #[cfg(unix)]
        if self.inner.exported.get().is_none() {
            let fd = self.export_fd()?;
            // A racing thread's export is as good: either one stays open.
            let _ = self.inner.exported.set(fd);
        }
        self.inner.device.bind()?;
        // SAFETY: a context is current (bound above); the driver checks the pointer.
        let data = unsafe { mem::pool_export_pointer(ptr.as_ptr() as sys::CUdeviceptr) }?;
        Ok(PointerExport(data.reserved))
    }
}

/// A driver pool of another process, imported from its file descriptor. Blocks the other
/// process exported are imported through it; it cannot allocate. The imported handle is not
/// destroyed (the driver releases it with the process).
pub struct ImportedPool {
    device: Device,
    pool: PoolHandle,
}

impl ImportedPool {
    /// Imports the pool that another process exported as `fd`
    /// (`cuMemPoolImportFromShareableHandle`). `device` is the device of the pool's memory.
    #[cfg(unix)]
    pub fn from_fd(device: &Device, fd: std::os::fd::BorrowedFd<'_>) -> Result<Self> {
        use std::os::fd::AsRawFd;
        device.bind()?;
        // SAFETY: a context is current (bound above); `fd` is borrowed, so open for the call.
        let pool = unsafe { mem::pool_import_fd(fd.as_raw_fd()) }?;
        Ok(ImportedPool {
            device: device.clone(),
            pool: PoolHandle(pool),
        })
    }

    /// The raw imported pool.
    pub fn handle(&self) -> sys::CUmemoryPool {
        self.pool.0
    }

    /// The device of the pool's memory.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Maps a block the exporting process described (`cuMemPoolImportPointer`).
    ///
    /// # Safety
    /// The block must stay allocated in the exporting process until the returned pointer is
    /// freed here (the driver's rule for pool IPC), and the two processes must order their
    /// accesses to it themselves.
    pub unsafe fn import_pointer(&self, data: &PointerExport) -> Result<ImportedPointer> {
        let raw = sys::CUmemPoolPtrExportData_st { reserved: data.0 };
        self.device.bind()?;
        // SAFETY: the pool is live (imported above, never destroyed); the block's lifetime is
        // the caller's contract.
        let dptr = unsafe { mem::pool_import_pointer(self.handle(), raw) }?;
        Ok(ImportedPointer {
            device: self.device.clone(),
            ptr: Some(dptr),
        })
    }
}

impl fmt::Debug for ImportedPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportedPool")
            .field("device", &self.device.ordinal())
            .field("pool", &self.pool.0)
            .finish()
    }
}

/// A block of another process's pool, mapped here. Freed (`cuMemFreeAsync`) by
/// [`free`](Self::free) on a stream, or on drop on its device's default stream.
pub struct ImportedPointer {
    device: Device,
    ptr: Option<sys::CUdeviceptr>,
}

impl ImportedPointer {
    /// The device address in this process.
    pub fn as_ptr(&self) -> u64 {
        self.ptr.unwrap_or(0)
    }

    /// The device of the memory.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Unmaps the block, ordered on `stream` (of this pointer's device). If binding the device
    /// fails the block stays mapped, and dropping the pointer (which this does on return) tries
    /// once more.
    pub fn free(mut self, stream: StreamRef<'_>) -> Result<()> {
        self.release(stream)
    }

    fn release(&mut self, stream: StreamRef<'_>) -> Result<()> {
        // Refused before the pointer is taken: it stays mapped, and is freed on drop.
        let raw = stream.driver_handle("ImportedPointer::free")?;
        let device = &self.device;
        release_once(
            &mut self.ptr,
            || device.bind(),
            |ptr| {
                // SAFETY: an imported pointer, freed once (`release_once`); the stream is live
                // (borrowed).
                unsafe { mem::free_async(ptr, raw) }
            },
        )
    }
}

impl Drop for ImportedPointer {
    fn drop(&mut self) {
        // Drop cannot return the error: it is kept for `take_deferred_error` (callers who
        // want it at once use `free`). A failed bind leaves the block for one more try.
        release_in_drop("ImportedPointer drop: cuMemFreeAsync", || {
            self.release(StreamRef::DEFAULT)
        });
    }
}

impl fmt::Debug for ImportedPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ImportedPointer")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.as_ptr()))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_exports_round_trip_through_hex_and_bad_hex_is_refused() {
        let mut d = [0u8; 64];
        for (i, b) in d.iter_mut().enumerate() {
            *b = (i * 37) as u8;
        }
        let e = PointerExport(d);
        assert_eq!(PointerExport::from_hex(&e.to_hex()).unwrap(), e);
        assert!(PointerExport::from_hex("zz").is_err());
        assert!(PointerExport::from_hex(&"g".repeat(128)).is_err());
        assert!(PointerExport::from_hex(&"é".repeat(64)).is_err());
    }
}
