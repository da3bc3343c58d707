//! Sharing virtual-memory chunks between processes (`carve_vm_export_chunk`,
//! `carve_vm_import_chunk`, `carve_vm_chunk_release`). A chunk is exported as a POSIX file
//! descriptor; the importing process maps it behind a generation-checked chunk handle, so a
//! released or forged handle is `CARVE_ERROR_INVALID_HANDLE`, never a dangling mapping.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};
use std::os::fd::{BorrowedFd, IntoRawFd};
use std::ptr::NonNull;
use std::sync::{Mutex, MutexGuard, PoisonError};

use carve::resource::ImportedChunk;
use carve::Device;

use crate::error::{guard, Code, FfiError, FfiResult};
use crate::ffi::{carve_resource_t, check_out, device, handle_of};
use crate::registry::{self, Entry};
use crate::slots::{Handle, Slots};
use crate::vm_export::ExportedChunk;

/// `carve_chunk_t`: an imported chunk's handle (a table id, never dereferenced).
pub type carve_chunk_t = *mut c_void;

/// The chunk holding `ptr` (a live block of the virtual-memory resource behind `entry`): a new
/// descriptor the caller owns, the chunk's start and its size.
pub fn export(entry: &Entry, ptr: usize) -> FfiResult<ExportedChunk> {
    let p = NonNull::new(ptr as *mut u8)
        .ok_or_else(|| FfiError::new(Code::BadPointer, "null pointer passed to export_chunk"))?;
    let chunks = entry.chunks.as_ref().ok_or_else(|| {
        FfiError::new(
            Code::Unsupported,
            format!(
                "a {} resource does not export chunks: export through the virtual-memory \
                 resource (virtual or expandable) that allocated the block",
                entry.kind_str()
            ),
        )
    })?;
    Ok(chunks.export_chunk(p)?)
}

/// Maps the chunk behind `fd` (another process's [`export`]) of `size` bytes on `device`.
pub fn import(fd: BorrowedFd<'_>, size: usize, device: usize) -> FfiResult<ImportedChunk> {
    if size == 0 {
        return Err(FfiError::invalid("import_chunk: a size of zero"));
    }
    Ok(ImportedChunk::import(&Device::get(device)?, fd, size)?)
}

static IMPORTED: Mutex<Slots<ImportedChunk>> = Mutex::new(Slots::new());

fn imported() -> MutexGuard<'static, Slots<ImportedChunk>> {
    // Every critical section is a single slot update, so a poisoned lock holds consistent data.
    IMPORTED.lock().unwrap_or_else(PoisonError::into_inner)
}

fn bad_chunk(handle: Handle) -> FfiError {
    FfiError::new(
        Code::InvalidHandle,
        format!("carve chunk handle {handle:#x} is not live (released or never imported)"),
    )
}

/// `carve_vm_export_chunk`.
///
/// # Safety
/// `fd`, `chunk_start` and `chunk_size` must each be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_vm_export_chunk(
    r: carve_resource_t,
    ptr: *mut c_void,
    fd: *mut c_int,
    chunk_start: *mut *mut c_void,
    chunk_size: *mut usize,
) -> c_int {
    guard(|| {
        check_out(fd)?;
        check_out(chunk_start)?;
        check_out(chunk_size)?;
        let e = registry::get(handle_of(r))?;
        let (owned, start, size) = export(&e, ptr as usize)?;
        // SAFETY: non-null (checked) and writable by the caller's contract. The descriptor
        // becomes the caller's.
        unsafe {
            fd.write(owned.into_raw_fd());
            chunk_start.write(start as *mut c_void);
            chunk_size.write(size);
        }
        Ok(())
    })
}

/// `carve_vm_import_chunk`.
///
/// # Safety
/// `fd` must be an open descriptor for the duration of the call; `out` and `ptr` must each be
/// null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_vm_import_chunk(
    fd: c_int,
    size: usize,
    dev: c_int,
    out: *mut carve_chunk_t,
    ptr: *mut *mut c_void,
) -> c_int {
    guard(|| {
        check_out(out)?;
        check_out(ptr)?;
        if fd < 0 {
            return Err(FfiError::invalid(format!(
                "import_chunk: file descriptor {fd}"
            )));
        }
        // SAFETY: the caller keeps `fd` open for this call, and the borrow ends with it.
        let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
        let chunk = import(borrowed, size, device(dev)?)?;
        let at = chunk.as_ptr().as_ptr();
        let h = imported()
            .insert(chunk)
            .ok_or_else(|| FfiError::new(Code::OutOfMemory, "too many imported chunks"))?;
        // SAFETY: non-null (checked) and writable by the caller's contract.
        unsafe {
            out.write(h as usize as carve_chunk_t);
            ptr.write(at.cast());
        }
        Ok(())
    })
}

/// `carve_vm_chunk_release`: unmaps an imported chunk (after waiting for its device).
#[no_mangle]
pub extern "C" fn carve_vm_chunk_release(chunk: carve_chunk_t) -> c_int {
    guard(|| {
        let h = chunk as usize as Handle;
        // Taken out under the lock, dropped outside it: the drop waits for the device.
        let taken = imported().remove(h);
        drop(taken.ok_or_else(|| bad_chunk(h))?);
        Ok(())
    })
}
