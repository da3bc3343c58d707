//! A driver memory pool as a resource: `cuMemAllocFromPoolAsync` / `cuMemFreeAsync` on a pool
//! carve creates (`cuMemPoolCreate`) or one it wraps without owning (the device's default or
//! current pool, or a raw handle from another library).

mod ipc;
mod options;

pub use ipc::{ImportedPointer, ImportedPool, PointerExport};
pub use options::AsyncPoolOptions;

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;

use super::location::{check_ordinal, Location};
use crate::driver::{mem, Device};
use crate::error::{DriverCode, Error, Result};
use crate::resource::engine::ledger::Ledger;
use crate::resource::memory_resource::{
    check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT,
};
use crate::stream::StreamRef;

const NAME: &str = "AsyncMemoryResource";

/// Stream-ordered device memory from a driver pool (what `cudaMallocAsync` uses).
///
/// Cheap to clone; a pool carve created is destroyed with the last clone (the driver defers that
/// until every block is freed). Blocks are recorded, so foreign pointers, double frees and size
/// mismatches are typed errors, and the hard limit counts bytes in use through this resource.
#[derive(Clone)]
pub struct AsyncMemoryResource {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    pool: PoolHandle,
    owned: bool,
    ipc_export: bool,
    /// The pool's first export, kept open: the driver refuses `cuMemPoolExportPointer` on a
    /// pool that was never exported (CUDA_ERROR_INVALID_VALUE, seen on driver 580).
    #[cfg(unix)]
    exported: std::sync::OnceLock<std::os::fd::OwnedFd>,
    driver_cap: Option<usize>,
    ledger: Ledger,
}

/// A raw pool handle.
#[derive(Clone, Copy, Debug)]
struct PoolHandle(sys::CUmemoryPool);
// SAFETY: a pool handle is a process-wide driver object; the driver synchronises its use from
// any thread.
unsafe impl Send for PoolHandle {}
// SAFETY: as above.
unsafe impl Sync for PoolHandle {}

/// Usage of a pool (`cuMemPoolGetAttribute`), for every user of the pool, not only this handle.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AsyncPoolStats {
    /// Bytes in blocks handed out and not yet freed.
    pub used: usize,
    /// Bytes the pool holds from the driver.
    pub reserved: usize,
    /// `reserved - used`: held but free for reuse.
    pub free: usize,
    /// Highest `used` since creation or [`AsyncMemoryResource::reset_high_water`].
    pub used_high: usize,
    /// Highest `reserved` since creation or the last reset.
    pub reserved_high: usize,
}

/// What other devices may do with a pool's memory (`cuMemPoolSetAccess`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolAccess {
    /// No access.
    None,
    /// Read only.
    Read,
    /// Read and write.
    ReadWrite,
}

impl PoolAccess {
    fn to_cu(self) -> sys::CUmemAccess_flags {
        use sys::CUmemAccess_flags as F;
        match self {
            PoolAccess::None => F::CU_MEM_ACCESS_FLAGS_PROT_NONE,
            PoolAccess::Read => F::CU_MEM_ACCESS_FLAGS_PROT_READ,
            PoolAccess::ReadWrite => F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        }
    }

    fn from_cu(flags: sys::CUmemAccess_flags) -> Self {
        use sys::CUmemAccess_flags as F;
        match flags {
            F::CU_MEM_ACCESS_FLAGS_PROT_READWRITE => PoolAccess::ReadWrite,
            F::CU_MEM_ACCESS_FLAGS_PROT_READ => PoolAccess::Read,
            _ => PoolAccess::None,
        }
    }
}

impl AsyncMemoryResource {
    /// Creates a pool on `device` with `options`, primed with `options.initial_size` bytes.
    pub fn new(device: &Device, options: &AsyncPoolOptions) -> Result<Self> {
        options.validate()?;
        let attr = |a| device.attribute(a);
        if attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)? == 0 {
            return Err(Error::Unsupported(format!(
                "device {} has no driver memory pools",
                device.ordinal()
            )));
        }
        let handle_types = if options.ipc_export {
            let fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
            let supported =
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES)?;
            if supported as u32 & fd.0 == 0 {
                return Err(Error::Unsupported(format!(
                    "device {} cannot export pools as file descriptors",
                    device.ordinal()
                )));
            }
            fd
        } else {
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
        };
        device.bind()?;
        let cap = options.hard_limit.and_then(options::max_size_for);
        let (pool, driver_cap) = match create_pool(device, handle_types, cap.unwrap_or(0)) {
            Ok(pool) => (pool, cap),
            // A driver that rejects the cap still has the limit enforced by the ledger.
            Err(Error::Driver {
                code: DriverCode(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
                ..
            }) if cap.is_some() => (create_pool(device, handle_types, 0)?, None),
            Err(e) => return Err(e),
        };
        let mr = AsyncMemoryResource {
            inner: Arc::new(Inner {
                device: device.clone(),
                pool: PoolHandle(pool),
                owned: true,
                ipc_export: options.ipc_export,
                #[cfg(unix)]
                exported: std::sync::OnceLock::new(),
                driver_cap,
                ledger: Ledger::new(NAME, options.hard_limit),
            }),
        };
        mr.set_release_threshold_raw(options.threshold())?;
        if options.initial_size > 0 {
            mr.prime(options.initial_size)?;
        }
        Ok(mr)
    }

    /// As [`new`](Self::new), on device `ordinal`.
    pub fn on(ordinal: usize, options: &AsyncPoolOptions) -> Result<Self> {
        Self::new(&Device::get(ordinal)?, options)
    }

    /// Wraps `device`'s default pool (`cuDeviceGetDefaultMemPool`) without owning it.
    pub fn default_pool(device: &Device) -> Result<Self> {
        device.bind()?;
        // SAFETY: a valid device handle.
        let pool = unsafe { mem::default_mem_pool(device.context().cu_device()) }?;
        // SAFETY: the default pool lives as long as the process.
        Ok(unsafe { Self::from_raw(device, pool, None) })
    }

    /// Wraps `device`'s current pool (`cuDeviceGetMemPool`), the one `cuMemAllocAsync` uses,
    /// without owning it.
    pub fn current_pool(device: &Device) -> Result<Self> {
        device.bind()?;
        // SAFETY: a valid device handle.
        let pool = unsafe { mem::current_mem_pool(device.context().cu_device()) }?;
        // SAFETY: a device's current pool is the default pool or one its setter keeps alive;
        // carve does not destroy it.
        Ok(unsafe { Self::from_raw(device, pool, None) })
    }

    /// Wraps a pool created elsewhere (PyTorch, CuPy, another carve resource's
    /// [`handle`](Self::handle)), without owning it. `hard_limit` applies to this handle's
    /// allocations.
    ///
    /// # Safety
    /// `pool` must be a live pool whose memory lives on `device`, and must outlive this resource
    /// and every block allocated through it.
    pub unsafe fn from_raw(
        device: &Device,
        pool: sys::CUmemoryPool,
        hard_limit: Option<usize>,
    ) -> Self {
        AsyncMemoryResource {
            inner: Arc::new(Inner {
                device: device.clone(),
                pool: PoolHandle(pool),
                owned: false,
                ipc_export: false,
                #[cfg(unix)]
                exported: std::sync::OnceLock::new(),
                driver_cap: None,
                ledger: Ledger::new(NAME, hard_limit),
            }),
        }
    }

    /// The raw pool, to share with other libraries (`cupy.cuda.MemoryAsyncPool`, PyTorch's
    /// cudaMallocAsync backend). Valid while this resource (or a clone) lives.
    pub fn handle(&self) -> sys::CUmemoryPool {
        self.inner.pool.0
    }

    /// The device the pool's memory lives on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// True when this resource created the pool and destroys it.
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// The hard limit on bytes in use through this resource.
    pub fn hard_limit(&self) -> Option<usize> {
        self.inner.ledger.limit()
    }

    /// The pool's own cap on reserved bytes (`maxSize`), when the driver accepted one.
    pub fn driver_cap(&self) -> Option<usize> {
        self.inner.driver_cap
    }

    /// Bytes in use through this handle and its clones (requested sizes).
    pub fn allocated_bytes(&self) -> usize {
        self.inner.ledger.in_use()
    }

    /// Highest [`allocated_bytes`](Self::allocated_bytes) seen.
    pub fn peak_allocated_bytes(&self) -> usize {
        self.inner.ledger.peak()
    }

    /// Number of live blocks allocated through this handle and its clones.
    pub fn allocation_count(&self) -> usize {
        self.inner.ledger.count()
    }

    /// The pool's counters, for all its users.
    pub fn stats(&self) -> Result<AsyncPoolStats> {
        use sys::CUmemPool_attribute as A;
        let used = self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
        let reserved = self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?;
        Ok(AsyncPoolStats {
            used,
            reserved,
            free: reserved.saturating_sub(used),
            used_high: self.attribute(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?,
            reserved_high: self.attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        })
    }

    /// Bytes the pool has handed out and not yet freed.
    pub fn used_bytes(&self) -> Result<usize> {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Bytes the pool holds from the driver.
    pub fn reserved_bytes(&self) -> Result<usize> {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
    }

    /// Bytes held but not handed out.
    pub fn free_bytes(&self) -> Result<usize> {
        Ok(self.stats()?.free)
    }

    /// Resets both high-water marks to the current values.
    pub fn reset_high_water(&self) -> Result<()> {
        use sys::CUmemPool_attribute as A;
        self.set_attribute(A::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
        self.set_attribute(A::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, 0)
    }

    /// The release threshold in bytes (`u64::MAX` keeps everything).
    pub fn release_threshold(&self) -> Result<u64> {
        self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD)
            .map(|v| v as u64)
    }

    /// Sets the release threshold.
    pub fn set_release_threshold(&self, bytes: usize) -> Result<()> {
        self.set_release_threshold_raw(bytes as u64)
    }

    fn set_release_threshold_raw(&self, bytes: u64) -> Result<()> {
        self.set_attribute(
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            bytes,
        )
    }

    /// Releases free memory until the pool reserves at most `bytes` (or nothing more can go:
    /// blocks in use, and frees still queued, stay). Synchronise the streams that freed first.
    /// CuPy's `free_all_blocks` is `trim_to(0)`.
    pub fn trim_to(&self, bytes: usize) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: the pool is live (owned, or by `from_raw`'s contract).
        unsafe { mem::pool_trim_to(self.handle(), bytes) }
    }

    /// Lets device `ordinal` access the pool's memory (its own device always has read-write).
    pub fn set_access(&self, ordinal: usize, access: PoolAccess) -> Result<()> {
        check_ordinal(ordinal)?;
        let desc = sys::CUmemAccessDesc {
            location: Location::Device(ordinal).to_cu(),
            flags: access.to_cu(),
        };
        self.inner.device.bind()?;
        // SAFETY: the pool is live.
        unsafe { mem::pool_set_access(self.handle(), &desc) }
    }

    /// What device `ordinal` may do with the pool's memory.
    pub fn access(&self, ordinal: usize) -> Result<PoolAccess> {
        check_ordinal(ordinal)?;
        let location = Location::Device(ordinal).to_cu();
        self.inner.device.bind()?;
        // SAFETY: the pool is live.
        let flags = unsafe { mem::pool_access(self.handle(), location) }?;
        Ok(PoolAccess::from_cu(flags))
    }

    /// Exports the pool as a POSIX file descriptor for another process
    /// (`cuMemPoolExportToShareableHandle`); [`Error::Unsupported`] unless created with
    /// [`AsyncPoolOptions::ipc_export`].
    #[cfg(unix)]
    pub fn export_fd(&self) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        if !self.inner.ipc_export {
            return Err(Error::Unsupported(
                "the pool was not created with AsyncPoolOptions::ipc_export".into(),
            ));
        }
        self.inner.device.bind()?;
        // SAFETY: the pool is live and was created exportable (checked above).
        let fd = unsafe { mem::pool_export_fd(self.handle()) }?;
        if fd < 0 {
            return Err(Error::Unsupported(
                "the driver exported no descriptor".into(),
            ));
        }
        // SAFETY: the driver gave us a fresh descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }

    /// Reserves `bytes` by allocating and freeing them on the default stream, then waiting.
    fn prime(&self, bytes: usize) -> Result<()> {
        self.inner.device.bind()?;
        let stream = StreamRef::DEFAULT.as_raw();
        // SAFETY: the pool is live; the block is freed at once on the same stream, then waited.
        unsafe {
            let dptr = mem::pool_alloc_async(self.handle(), bytes, stream)?;
            mem::free_async(dptr, stream)?;
            mem::stream_synchronize(stream)
        }
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<usize> {
        self.inner.device.bind()?;
        // SAFETY: every attribute read here is a cuuint64_t; the pool is live.
        let value = unsafe { mem::pool_attribute(self.handle(), attr) }?;
        Ok(usize::try_from(value).unwrap_or(usize::MAX))
    }

    fn set_attribute(&self, attr: sys::CUmemPool_attribute, value: u64) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: every attribute written here is a cuuint64_t; the pool is live.
        unsafe { mem::set_pool_attribute(self.handle(), attr, value) }
    }

    fn out_of_memory(&self, bytes: usize) -> Error {
        let in_use = self.inner.ledger.in_use().saturating_sub(bytes);
        match self.inner.ledger.limit() {
            Some(_) => self.inner.ledger.over_limit(bytes, in_use),
            None => Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: match self.inner.device.mem_info() {
                    Ok(m) => format!(
                        "the driver pool could not grow: device {} has {} of {} bytes free",
                        self.inner.device.ordinal(),
                        m.free,
                        m.total
                    ),
                    Err(_) => "the driver pool could not grow".into(),
                },
            },
        }
    }
}

fn create_pool(
    device: &Device,
    handle_types: sys::CUmemAllocationHandleType,
    max_size: usize,
) -> Result<sys::CUmemoryPool> {
    let props = sys::CUmemPoolProps {
        allocType: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
        handleTypes: handle_types,
        location: Location::Device(device.ordinal()).to_cu(),
        win32SecurityAttributes: std::ptr::null_mut(),
        maxSize: max_size,
        usage: 0,
        reserved: [0; 54],
    };
    // SAFETY: valid properties (reserved bytes zero); a context is current.
    unsafe { mem::pool_create(&props) }
}

// SAFETY: the driver pool returns distinct live blocks of the requested size, at least 256-byte
// aligned; larger alignments are refused. The ledger frees each block once.
unsafe impl MemoryResource for AsyncMemoryResource {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let raw = stream.driver_handle(NAME)?;
        let align = check_request(bytes, align, 1)?;
        if align > DEFAULT_ALIGNMENT {
            return Err(Error::Unsupported(format!(
                "{NAME} guarantees {DEFAULT_ALIGNMENT}-byte alignment, not {align}"
            )));
        }
        let admission = self.inner.ledger.admit(bytes)?;
        self.inner.device.bind()?;
        // SAFETY: the pool is live; `StreamRef`'s contract keeps the stream valid.
        let dptr = match unsafe { mem::pool_alloc_async(self.handle(), bytes, raw) } {
            Ok(dptr) => dptr,
            Err(e) if e.is_out_of_memory() => return Err(self.out_of_memory(bytes)),
            Err(e) => return Err(e),
        };
        let ptr = NonNull::new(dptr as *mut u8)
            .ok_or_else(|| Error::Unsupported("cuMemAllocFromPoolAsync returned null".into()))?;
        admission.commit(ptr);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        // Refused before the ledger sees the free: the block stays live.
        let raw = stream.driver_handle(NAME)?;
        self.inner.ledger.release(ptr, bytes, || {
            self.inner.device.bind().and_then(|()| {
                // SAFETY: the ledger confirmed the block is ours and live; the free is ordered on
                // `stream`, valid by `StreamRef`'s contract.
                unsafe { mem::free_async(ptr.as_ptr() as sys::CUdeviceptr, raw) }
            })
        })
    }

    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
    fn device(&self) -> Option<Device> {
        Some(self.inner.device.clone())
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats()?;
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: self.allocated_bytes(),
            bytes_reserved: Some(s.reserved),
            peak_bytes: Some(self.peak_allocated_bytes()),
            live_blocks: Some(self.allocation_count()),
            detail: vec![
                (c"allocated_bytes", n(self.allocated_bytes())),
                (c"peak_allocated_bytes", n(self.peak_allocated_bytes())),
                (c"allocation_count", n(self.allocation_count())),
                (c"used", n(s.used)),
                (c"reserved", n(s.reserved)),
                (c"free", n(s.free)),
                (c"used_high", n(s.used_high)),
                (c"reserved_high", n(s.reserved_high)),
            ],
        }))
    }
    fn release_unused(&self) -> crate::error::Result<usize> {
        let before = self.reserved_bytes()?;
        self.trim_to(0)?;
        Ok(before.saturating_sub(self.reserved_bytes()?))
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let r = self.device.bind().and_then(|()| {
            // SAFETY: we created the pool and this is its last handle. The driver defers the
            // release until blocks still allocated from it are freed.
            unsafe { mem::pool_destroy(self.pool.0) }
        });
        crate::deferred::record("AsyncMemoryResource drop: destroying its pool", r);
    }
}

impl fmt::Debug for AsyncMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.inner.device.ordinal())
            .field("pool", &self.inner.pool.0)
            .field("owned", &self.inner.owned)
            .field("hard_limit", &self.hard_limit())
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn access_flags_round_trip() {
        for a in [PoolAccess::None, PoolAccess::Read, PoolAccess::ReadWrite] {
            assert_eq!(PoolAccess::from_cu(a.to_cu()), a);
        }
    }
}
