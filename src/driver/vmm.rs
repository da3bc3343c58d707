//! One thin wrapper per driver virtual-memory call (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap` and the rest). cudarc's `result` layer has none of them, so each calls `sys` and
//! reports a failure through [`check`] as [`Error::Driver`](crate::Error::Driver) naming the
//! call.
//!
//! Every wrapper expects the caller to have made the right context current.

use cudarc::driver::sys;

use super::mem::check;
use crate::error::Result;

/// `cuMemGetAllocationGranularity`: the minimum granularity, or the driver's recommended one
/// (`recommended`: the size at which it maps best, and what NCCL allocates in).
///
/// # Safety
/// `prop` is a fully initialised allocation description.
pub(crate) unsafe fn allocation_granularity(
    prop: &sys::CUmemAllocationProp,
    recommended: bool,
) -> Result<usize> {
    use sys::CUmemAllocationGranularity_flags as F;
    let mut granularity = 0usize;
    let flag = if recommended {
        F::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    } else {
        F::CU_MEM_ALLOC_GRANULARITY_MINIMUM
    };
    // SAFETY: the caller's contract; a valid out-slot.
    check("cuMemGetAllocationGranularity", unsafe {
        sys::cuMemGetAllocationGranularity(&mut granularity, prop, flag)
    })?;
    Ok(granularity)
}

/// `cuMemAddressReserve`: `size` bytes of address space aligned to `align`.
///
/// # Safety
/// A context is current. (Reserves address space only.)
pub(crate) unsafe fn address_reserve(size: usize, align: usize) -> Result<sys::CUdeviceptr> {
    let mut va: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-slot; the caller's contract.
    check("cuMemAddressReserve", unsafe {
        sys::cuMemAddressReserve(&mut va, size, align, 0, 0)
    })?;
    Ok(va)
}

/// `cuMemAddressFree`.
///
/// # Safety
/// `[va, va + size)` is a live, empty reservation, never used again.
pub(crate) unsafe fn address_free(va: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemAddressFree", unsafe {
        sys::cuMemAddressFree(va, size)
    })
}

/// `cuMemCreate`: a physical chunk of `size` bytes.
///
/// # Safety
/// `prop` is a fully initialised allocation description; a context is current.
pub(crate) unsafe fn create(
    size: usize,
    prop: &sys::CUmemAllocationProp,
) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: a valid out-slot; the caller's contract.
    check("cuMemCreate", unsafe {
        sys::cuMemCreate(&mut handle, size, prop, 0)
    })?;
    Ok(handle)
}

/// `cuMemRelease`.
///
/// # Safety
/// `handle` is an unmapped chunk, never used again.
pub(crate) unsafe fn release(handle: sys::CUmemGenericAllocationHandle) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
}

/// `cuMemMap` of a whole chunk at `va`.
///
/// # Safety
/// `[va, va + size)` is an empty, aligned range of a reservation and `handle` a live chunk of
/// `size` bytes.
pub(crate) unsafe fn map(
    va: sys::CUdeviceptr,
    size: usize,
    handle: sys::CUmemGenericAllocationHandle,
) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemMap", unsafe { sys::cuMemMap(va, size, 0, handle, 0) })
}

/// `cuMemSetAccess` of `[va, va + size)` for every descriptor in `access`.
///
/// # Safety
/// The range is wholly mapped.
pub(crate) unsafe fn set_access(
    va: sys::CUdeviceptr,
    size: usize,
    access: &[sys::CUmemAccessDesc],
) -> Result<()> {
    // SAFETY: the caller's contract; the descriptors are valid for the call.
    check("cuMemSetAccess", unsafe {
        sys::cuMemSetAccess(va, size, access.as_ptr(), access.len())
    })
}

/// `cuMemUnmap`.
///
/// # Safety
/// `[va, va + size)` is exactly one earlier mapping, no longer used.
pub(crate) unsafe fn unmap(va: sys::CUdeviceptr, size: usize) -> Result<()> {
    // SAFETY: the caller's contract.
    check("cuMemUnmap", unsafe { sys::cuMemUnmap(va, size) })
}

/// `cuMemExportToShareableHandle` as a POSIX file descriptor (-1 if the driver gave none).
///
/// # Safety
/// `handle` is a live chunk created exportable as a descriptor.
#[cfg(unix)]
pub(crate) unsafe fn export_fd(handle: sys::CUmemGenericAllocationHandle) -> Result<i32> {
    let mut fd: std::ffi::c_int = -1;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for POSIX handles the driver writes an `int` descriptor through the pointer; the
    // caller's contract.
    check("cuMemExportToShareableHandle", unsafe {
        sys::cuMemExportToShareableHandle((&mut fd as *mut std::ffi::c_int).cast(), handle, kind, 0)
    })?;
    Ok(fd)
}

/// `cuMemImportFromShareableHandle` of a POSIX file descriptor.
///
/// # Safety
/// A context is current; `fd` is open for the call.
#[cfg(unix)]
pub(crate) unsafe fn import_fd(fd: std::ffi::c_int) -> Result<sys::CUmemGenericAllocationHandle> {
    let mut handle: sys::CUmemGenericAllocationHandle = 0;
    let kind = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    // SAFETY: for POSIX handles the driver takes the descriptor's number in place of a pointer
    // and only reads the descriptor; the caller's contract keeps it open.
    check("cuMemImportFromShareableHandle", unsafe {
        sys::cuMemImportFromShareableHandle(&mut handle, fd as usize as *mut std::ffi::c_void, kind)
    })?;
    Ok(handle)
}
