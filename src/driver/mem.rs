//! One thin wrapper per driver memory call. Each makes one call, through cudarc's `result`
//! layer where it has the call and through `sys` where it does not, and turns a failure into
//! [`Error::Driver`] naming the call. Callers that give a code its own meaning (out of memory,
//! an unknown pointer) match on [`Error::is_out_of_memory`] or on the returned code.
//!
//! Every wrapper expects the caller to have made the right context current, as the driver does.

use std::ffi::c_void;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

/// The one conversion from a raw driver status to carve's error, for calls made through `sys`
/// (the `result` layer's errors take [`Error::driver`] directly).
pub(crate) fn check(call: &'static str, status: sys::CUresult) -> Result<()> {
    status.result().map_err(|e| Error::driver(call, e))
}

/// `cuMemAlloc`.
///
/// # Safety
/// A context is current.
pub(crate) unsafe fn alloc(bytes: usize) -> Result<sys::CUdeviceptr> {
    // SAFETY: the caller's contract.
    unsafe { result::malloc_sync(bytes) }.map_err(|e| Error::driver("cuMemAlloc", e))
}

/// `cuMemFree`, for device and managed memory.
///
/// # Safety
/// `ptr` came from `cuMemAlloc` or `cuMemAllocManaged` in the current context, is freed once,
/// and nothing still uses it.
pub(crate) unsafe fn free(ptr: sys::CUdeviceptr) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::free_sync(ptr) }.map_err(|e| Error::driver("cuMemFree", e))
}

/// `cuMemAllocManaged`, attached globally (every stream may use it).
///
/// # Safety
/// A context is current.
pub(crate) unsafe fn alloc_managed(bytes: usize) -> Result<sys::CUdeviceptr> {
    let global = sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL;
    // SAFETY: the caller's contract.
    unsafe { result::malloc_managed(bytes, global) }
        .map_err(|e| Error::driver("cuMemAllocManaged", e))
}

/// `cuMemPrefetchAsync_v2` of `[ptr, ptr + len)` to `location`, ordered on `stream`.
///
/// # Safety
/// The range is live, `stream` is a valid stream of the current context, and libcuda exports
/// the symbol (cudarc panics on a missing one).
pub(crate) unsafe fn prefetch_async(
    ptr: sys::CUdeviceptr,
    len: usize,
    location: sys::CUmemLocation,
    stream: sys::CUstream,
) -> Result<()> {
    // SAFETY: the caller's contract; the driver refuses memory that is not managed.
    unsafe { result::mem_prefetch_async(ptr, len, location, stream) }
        .map_err(|e| Error::driver("cuMemPrefetchAsync_v2", e))
}

/// `cuMemAdvise_v2` for `[ptr, ptr + len)`.
///
/// # Safety
/// The range is live managed memory, and libcuda exports the symbol.
pub(crate) unsafe fn advise(
    ptr: sys::CUdeviceptr,
    len: usize,
    advice: sys::CUmem_advise,
    location: sys::CUmemLocation,
) -> Result<()> {
    // SAFETY: the caller's contract; advice changes placement policy only.
    unsafe { result::mem_advise(ptr, len, advice, location) }
        .map_err(|e| Error::driver("cuMemAdvise_v2", e))
}

/// `cuMemRangeGetAttribute` into `out` (`out_len` bytes).
///
/// # Safety
/// `out` holds `out_len` writable bytes, the size `attr` takes; the range is managed.
pub(crate) unsafe fn range_attribute(
    out: *mut c_void,
    out_len: usize,
    attr: sys::CUmem_range_attribute,
    ptr: sys::CUdeviceptr,
    len: usize,
) -> Result<()> {
    // SAFETY: the caller's contract.
    let status = unsafe { sys::cuMemRangeGetAttribute(out, out_len, attr, ptr, len) };
    check("cuMemRangeGetAttribute", status)
}

/// `cuPointerGetAttribute` into `out`.
///
/// # Safety
/// `out` is a writable slot of the size `attr` takes.
pub(crate) unsafe fn pointer_attribute(
    out: *mut c_void,
    attr: sys::CUpointer_attribute,
    ptr: sys::CUdeviceptr,
) -> Result<()> {
    // SAFETY: the caller's contract; a query.
    check("cuPointerGetAttribute", unsafe {
        sys::cuPointerGetAttribute(out, attr, ptr)
    })
}

/// `cuMemHostAlloc` with `flags` (`CU_MEMHOSTALLOC_*`).
///
/// # Safety
/// A context is current.
pub(crate) unsafe fn host_alloc(bytes: usize, flags: u32) -> Result<*mut c_void> {
    // SAFETY: the caller's contract.
    unsafe { result::malloc_host(bytes, flags) }.map_err(|e| Error::driver("cuMemHostAlloc", e))
}

/// `cuMemFreeHost`.
///
/// # Safety
/// `ptr` came from `cuMemHostAlloc`, is freed once, and no queued work still uses it.
pub(crate) unsafe fn free_host(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::free_host(ptr) }.map_err(|e| Error::driver("cuMemFreeHost", e))
}

/// `cuMemHostRegister_v2` of `[ptr, ptr + len)` with `flags` (`CU_MEMHOSTREGISTER_*`).
///
/// # Safety
/// The range is live host memory that stays so until [`host_unregister`].
pub(crate) unsafe fn host_register(ptr: *mut c_void, len: usize, flags: u32) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemHostRegister", unsafe {
        sys::cuMemHostRegister_v2(ptr, len, flags)
    })
}

/// `cuMemHostUnregister`.
///
/// # Safety
/// `ptr` was registered by [`host_register`] and is unregistered once.
pub(crate) unsafe fn host_unregister(ptr: *mut c_void) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemHostUnregister", unsafe {
        sys::cuMemHostUnregister(ptr)
    })
}

/// `cuMemHostGetDevicePointer_v2`: the device address of pinned, mapped host memory.
///
/// # Safety
/// A context is current. (A query: the driver refuses addresses it did not map.)
pub(crate) unsafe fn host_device_pointer(host: *mut c_void) -> Result<sys::CUdeviceptr> {
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-slot; the caller's contract.
    check("cuMemHostGetDevicePointer", unsafe {
        sys::cuMemHostGetDevicePointer_v2(&mut dptr, host, 0)
    })?;
    Ok(dptr)
}

/// `cuMemHostGetFlags`: the `CU_MEMHOSTALLOC_*` bits the driver records for pinned memory.
///
/// # Safety
/// A context is current. (A query: the driver refuses addresses it did not pin.)
pub(crate) unsafe fn host_get_flags(host: *mut c_void) -> Result<u32> {
    let mut flags = 0u32;
    // SAFETY: a valid out-slot; the caller's contract.
    check("cuMemHostGetFlags", unsafe {
        sys::cuMemHostGetFlags(&mut flags, host)
    })?;
    Ok(flags)
}

/// `cuStreamSynchronize`.
///
/// # Safety
/// `stream` is a valid stream (or a default-stream handle) of the current context.
pub(crate) unsafe fn stream_synchronize(stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::stream::synchronize(stream) }
        .map_err(|e| Error::driver("cuStreamSynchronize", e))
}

/// `cuMemAllocFromPoolAsync`, ordered on `stream`.
///
/// # Safety
/// `pool` is live and `stream` is a valid stream of the current context.
pub(crate) unsafe fn pool_alloc_async(
    pool: sys::CUmemoryPool,
    bytes: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr> {
    // SAFETY: the caller's contract.
    unsafe { result::mem_pool::alloc_async(pool, bytes, stream) }
        .map_err(|e| Error::driver("cuMemAllocFromPoolAsync", e))
}

/// `cuMemFreeAsync`, ordered on `stream`.
///
/// # Safety
/// `ptr` came from a stream-ordered allocation (or a pool import), is freed once, and
/// `stream` is a valid stream of the current context.
pub(crate) unsafe fn free_async(ptr: sys::CUdeviceptr, stream: sys::CUstream) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::free_async(ptr, stream) }.map_err(|e| Error::driver("cuMemFreeAsync", e))
}

/// `cuMemPoolCreate`.
///
/// # Safety
/// `props` is valid (reserved bytes zero) and a context is current.
pub(crate) unsafe fn pool_create(props: &sys::CUmemPoolProps) -> Result<sys::CUmemoryPool> {
    // SAFETY: the caller's contract.
    unsafe { result::mem_pool::create(props) }.map_err(|e| Error::driver("cuMemPoolCreate", e))
}

/// `cuMemPoolDestroy`.
///
/// # Safety
/// The caller created `pool`, and destroys it once.
pub(crate) unsafe fn pool_destroy(pool: sys::CUmemoryPool) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::mem_pool::destroy(pool) }.map_err(|e| Error::driver("cuMemPoolDestroy", e))
}

/// `cuMemPoolTrimTo`.
///
/// # Safety
/// `pool` is live.
pub(crate) unsafe fn pool_trim_to(pool: sys::CUmemoryPool, keep: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    unsafe { result::mem_pool::trim_to(pool, keep) }
        .map_err(|e| Error::driver("cuMemPoolTrimTo", e))
}

/// `cuMemPoolGetAttribute` of a `cuuint64_t` attribute.
///
/// # Safety
/// `pool` is live and `attr` is one whose value is a `cuuint64_t`.
pub(crate) unsafe fn pool_attribute(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
) -> Result<u64> {
    let mut value: u64 = 0;
    // SAFETY: the caller's contract; `value` is a cuuint64_t slot.
    unsafe { result::mem_pool::get_attribute(pool, attr, (&mut value as *mut u64).cast()) }
        .map_err(|e| Error::driver("cuMemPoolGetAttribute", e))?;
    Ok(value)
}

/// `cuMemPoolSetAttribute` of a `cuuint64_t` attribute.
///
/// # Safety
/// `pool` is live and `attr` is one whose value is a `cuuint64_t`.
pub(crate) unsafe fn set_pool_attribute(
    pool: sys::CUmemoryPool,
    attr: sys::CUmemPool_attribute,
    mut value: u64,
) -> Result<()> {
    // SAFETY: the caller's contract; `value` is a cuuint64_t slot.
    unsafe { result::mem_pool::set_attribute(pool, attr, (&mut value as *mut u64).cast()) }
        .map_err(|e| Error::driver("cuMemPoolSetAttribute", e))
}

/// `cuMemPoolSetAccess` with one descriptor.
///
/// # Safety
/// `pool` is live.
pub(crate) unsafe fn pool_set_access(
    pool: sys::CUmemoryPool,
    desc: &sys::CUmemAccessDesc,
) -> Result<()> {
    // SAFETY: the caller's contract; one valid descriptor.
    check("cuMemPoolSetAccess", unsafe {
        sys::cuMemPoolSetAccess(pool, desc, 1)
    })
}

/// `cuMemPoolGetAccess`: what `location` may do with the pool's memory.
///
/// # Safety
/// `pool` is live.
pub(crate) unsafe fn pool_access(
    pool: sys::CUmemoryPool,
    mut location: sys::CUmemLocation,
) -> Result<sys::CUmemAccess_flags> {
    let mut flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_NONE;
    // SAFETY: valid in/out slots; the caller's contract.
    check("cuMemPoolGetAccess", unsafe {
        sys::cuMemPoolGetAccess(&mut flags, pool, &mut location)
    })?;
    Ok(flags)
}

/// `cuDeviceGetDefaultMemPool`.
///
/// # Safety
/// `device` is a valid device handle.
pub(crate) unsafe fn default_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    // SAFETY: the caller's contract.
    unsafe { result::device::get_default_mem_pool(device) }
        .map_err(|e| Error::driver("cuDeviceGetDefaultMemPool", e))
}

/// `cuDeviceGetMemPool`: the pool `cuMemAllocAsync` uses.
///
/// # Safety
/// `device` is a valid device handle.
pub(crate) unsafe fn current_mem_pool(device: sys::CUdevice) -> Result<sys::CUmemoryPool> {
    // SAFETY: the caller's contract.
    unsafe { result::device::get_mem_pool(device) }
        .map_err(|e| Error::driver("cuDeviceGetMemPool", e))
}

/// `cuMemPoolExportToShareableHandle` as a POSIX file descriptor (-1 if the driver gave none).
///
/// # Safety
/// `pool` is live and was created exportable as a descriptor.
#[cfg(unix)]
pub(crate) unsafe fn pool_export_fd(pool: sys::CUmemoryPool) -> Result<std::ffi::c_int> {
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for the POSIX fd handle type the out-slot is an int; the caller's contract.
    check("cuMemPoolExportToShareableHandle", unsafe {
        sys::cuMemPoolExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            pool,
            kind,
            0,
        )
    })?;
    Ok(fd)
}

/// `cuMemPoolImportFromShareableHandle` of a POSIX file descriptor.
///
/// # Safety
/// A context is current; `fd` is open for the call.
#[cfg(unix)]
pub(crate) unsafe fn pool_import_fd(fd: std::ffi::c_int) -> Result<sys::CUmemoryPool> {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for the POSIX descriptor handle type, the handle argument is the descriptor
    // itself cast to a pointer (CUDA driver API); the driver only reads it.
    check("cuMemPoolImportFromShareableHandle", unsafe {
        sys::cuMemPoolImportFromShareableHandle(&mut pool, fd as isize as *mut c_void, kind, 0)
    })?;
    Ok(pool)
}

/// `cuMemPoolExportPointer`: the data another process imports `ptr` with.
///
/// # Safety
/// A context is current. (The driver checks the pointer.)
pub(crate) unsafe fn pool_export_pointer(
    ptr: sys::CUdeviceptr,
) -> Result<sys::CUmemPoolPtrExportData_st> {
    let mut data = sys::CUmemPoolPtrExportData_st { reserved: [0; 64] };
    // SAFETY: a valid out-slot of the driver's export type.
    check("cuMemPoolExportPointer", unsafe {
        sys::cuMemPoolExportPointer(&mut data, ptr)
    })?;
    Ok(data)
}

/// `cuMemPoolImportPointer`: maps a block that another process exported from `pool`.
///
/// # Safety
/// `pool` is a live imported pool; the block stays allocated in the exporting process until
/// the returned pointer is freed.
pub(crate) unsafe fn pool_import_pointer(
    pool: sys::CUmemoryPool,
    mut data: sys::CUmemPoolPtrExportData_st,
) -> Result<sys::CUdeviceptr> {
    let mut dptr: sys::CUdeviceptr = 0;
    // SAFETY: valid in/out slots; the caller's contract.
    check("cuMemPoolImportPointer", unsafe {
        sys::cuMemPoolImportPointer(&mut dptr, pool, &mut data)
    })?;
    Ok(dptr)
}
