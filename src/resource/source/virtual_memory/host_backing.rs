//! [`HostBacking`]: the virtual-memory calls done with the host's own (Linux): a reservation is
//! an inaccessible anonymous mapping, a chunk is a memory file (`memfd_create`), mapping puts the
//! file over part of the reservation, unmapping puts the inaccessible mapping back. Real memory
//! that keeps its bytes, so the resources over it are tested on CPUs with data checks.

use std::ffi::c_void;

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::error::{Error, Result};
use crate::resource::memory_resource::Properties;

/// Host virtual memory (see the module docs): pages of 4 KiB or more, readable and writable by
/// the host once mapped.
#[derive(Debug)]
pub struct HostBacking {
    granularity: usize,
}

impl HostBacking {
    /// Chunks of `granularity` bytes (a power of two, at least the system's page size).
    pub fn new(granularity: usize) -> Result<Self> {
        // SAFETY: a plain query.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if !granularity.is_power_of_two() || page <= 0 || granularity < page as usize {
            return Err(Error::InvalidArgument(format!(
                "HostBacking: granularity {granularity} must be a power of two of at least the \
                 page size {page}"
            )));
        }
        Ok(HostBacking { granularity })
    }
}

fn os_error(call: &str) -> Error {
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENOMEM) {
        Error::OutOfMemory {
            bytes: 0,
            resource: "HostBacking",
            detail: format!("{call}: {e}"),
        }
    } else {
        Error::Io(std::io::Error::new(e.kind(), format!("{call}: {e}")))
    }
}

/// Maps `size` inaccessible, unbacked bytes at `va` (or anywhere, with null).
///
/// # Safety
/// With a non-null `va`, the range must be ours to replace.
unsafe fn inaccessible(va: *mut c_void, size: usize) -> Result<usize> {
    let fixed = if va.is_null() { 0 } else { libc::MAP_FIXED };
    // SAFETY: anonymous, inaccessible memory; with MAP_FIXED, the caller's range.
    let p = unsafe {
        libc::mmap(
            va,
            size,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | fixed,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    Ok(p as usize)
}

// SAFETY: reservations are the kernel's (disjoint, aligned here by over-reserving and trimming);
// a chunk is a memory file of its own; `map` makes the range readable and writable by the host,
// as `properties` says.
unsafe impl PhysicalBacking for HostBacking {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn properties(&self) -> Properties {
        Properties::HOST
    }

    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        let g = align.max(self.granularity);
        let total = size.checked_add(g).ok_or(Error::SizeOverflow {
            bytes: size,
            align: g,
        })?;
        // SAFETY: a fresh mapping anywhere.
        let raw = unsafe { inaccessible(std::ptr::null_mut(), total)? };
        let start = raw.next_multiple_of(g);
        // Trim the over-reservation so the range is aligned to the granularity.
        // SAFETY: both pieces are parts of the mapping just made, outside [start, start + size).
        unsafe {
            if start > raw {
                libc::munmap(raw as *mut c_void, start - raw);
            }
            let end = start + size;
            if raw + total > end {
                libc::munmap(end as *mut c_void, raw + total - end);
            }
        }
        Ok(start)
    }

    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: the caller's reservation, with nothing mapped.
        if unsafe { libc::munmap(va as *mut c_void, size) } != 0 {
            return Err(os_error("munmap"));
        }
        Ok(())
    }

    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        // SAFETY: the name is a NUL-terminated literal.
        let fd = unsafe { libc::memfd_create(c"carve-chunk".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: sizing our own new file.
        if unsafe { libc::ftruncate(fd, size as libc::off_t) } != 0 {
            let e = os_error("ftruncate");
            // SAFETY: our descriptor, closed once.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        Ok(fd as PhysicalHandle)
    }

    unsafe fn release(&self, handle: PhysicalHandle, _size: usize) -> Result<()> {
        // SAFETY: the caller's unmapped chunk: our descriptor, closed once.
        if unsafe { libc::close(handle as libc::c_int) } != 0 {
            return Err(os_error("close"));
        }
        Ok(())
    }

    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: the caller's empty range of our reservation; the file is `size` bytes.
        let p = unsafe {
            libc::mmap(
                va as *mut c_void,
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                handle as libc::c_int,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        Ok(())
    }

    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: the caller's mapping, no longer used; it becomes reserved space again.
        unsafe { inaccessible(va as *mut c_void, size) }.map(drop)
    }
}
