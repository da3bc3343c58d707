//! The [`MemoryResource`] trait every resource implements, the [`Properties`] it reports, and
//! the request checks every resource runs first.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::MemoryStats;
use crate::stream::StreamRef;

/// Alignment every resource honours when asked for less: the CUDA allocation granularity that
/// RMM and the driver's own allocators give.
pub const DEFAULT_ALIGNMENT: usize = 256;

/// Where a resource's memory can be read and written from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Properties {
    /// Kernels may dereference the pointers.
    pub device_accessible: bool,
    /// Host code may dereference the pointers.
    pub host_accessible: bool,
}

impl Properties {
    /// Device memory (`cuMemAlloc`, pools).
    pub const DEVICE: Properties = Properties {
        device_accessible: true,
        host_accessible: false,
    };
    /// Pageable or pinned host memory that kernels cannot touch.
    pub const HOST: Properties = Properties {
        device_accessible: false,
        host_accessible: true,
    };
    /// Managed or mapped memory: both sides.
    pub const BOTH: Properties = Properties {
        device_accessible: true,
        host_accessible: true,
    };
}

/// A stream-ordered allocator, in the shape of RMM's `device_memory_resource`.
///
/// A block returned by [`allocate`](Self::allocate) on stream `s` may be used by work ordered on
/// `s` at once; other streams must synchronise with `s` first. [`deallocate`](Self::deallocate)
/// on `s` means "free once the work already queued on `s` is done": the resource must not hand
/// the block to another stream before that.
///
/// # Safety
/// Implementors promise that a successful `allocate(_, bytes, align)` returns a pointer aligned to
/// at least `align`, to `bytes` usable bytes that overlap no other live block of this resource
/// (or of any resource it compares equal to), which stay valid until deallocated. Adaptors and
/// suballocators rely on this to hand out memory without checking it.
pub unsafe trait MemoryResource: Send + Sync + fmt::Debug {
    /// Allocates `bytes` bytes aligned to `align` (a power of two), ordered on `stream`.
    ///
    /// Zero sizes, non-power-of-two alignments and sizes that overflow once aligned are
    /// [`Error::ZeroSize`], [`Error::InvalidAlignment`] and [`Error::SizeOverflow`].
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>>;

    /// Returns a block, ordered on `stream`.
    ///
    /// Resources that can tell report a pointer they do not own, a double free or a size
    /// mismatch as an error and leave their state untouched.
    ///
    /// # Safety
    /// `ptr` must have come from `allocate(_, bytes, align)` on this resource (or one that compares
    /// equal), and nothing may use the block after this call except work already ordered on
    /// `stream`.
    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()>;

    /// Where the memory is accessible from.
    fn properties(&self) -> Properties;

    /// The device whose context the resource's driver calls run in, and whose streams order
    /// its memory; `None` for resources that never call the driver (host, simulated memory).
    /// Adaptors report their upstream's. Stream ordering and synchronisation use this device,
    /// never the calling thread's current one.
    fn device(&self) -> Option<Device>;

    /// The resource's counters ([`MemoryStats`]); `None` for resources that keep none.
    /// Adaptors that keep no counters of their own report `None`, not their upstream's.
    fn memory_stats(&self) -> Result<Option<MemoryStats>> {
        Ok(None)
    }

    /// Returns memory the resource holds and does not use to its upstream or the driver, after
    /// waiting for the work that may still use it, as CuPy's `free_all_blocks` and PyTorch's
    /// `empty_cache`. Returns the bytes released. [`Error::Unsupported`] for resources that
    /// hold nothing beyond what they hand out.
    fn release_unused(&self) -> Result<usize> {
        Err(Error::Unsupported(
            "release: this resource holds nothing to release".into(),
        ))
    }

    /// Allocates on the default stream of the resource's [`device`](Self::device) and waits for
    /// it, so the block is usable from any stream.
    fn allocate_sync(&self, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let ptr = self.allocate(StreamRef::DEFAULT, bytes, align)?;
        if let Some(device) = self.device() {
            device.synchronize_default_stream()?;
        }
        Ok(ptr)
    }

    /// Waits for the default stream, then deallocates on it.
    ///
    /// # Safety
    /// As for [`deallocate`](Self::deallocate); additionally no work on any stream may still use
    /// the block.
    unsafe fn deallocate_sync(&self, ptr: NonNull<u8>, bytes: usize, align: usize) -> Result<()> {
        if let Some(device) = self.device() {
            device.synchronize_default_stream()?;
        }
        // SAFETY: forwarded caller contract.
        unsafe { self.deallocate(StreamRef::DEFAULT, ptr, bytes, align) }
    }
}

/// A type-erased, shared resource.
pub type SharedResource = Arc<dyn MemoryResource>;

macro_rules! forward_resource {
    ($($ty:ty),*) => {$(
        // SAFETY: pure delegation; the pointee upholds the contract.
        unsafe impl<R: MemoryResource + ?Sized> MemoryResource for $ty {
            fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
                (**self).allocate(stream, bytes, align)
            }
            unsafe fn deallocate(
                &self,
                stream: StreamRef<'_>,
                ptr: NonNull<u8>,
                bytes: usize,
                align: usize,
            ) -> Result<()> {
                // SAFETY: forwarded caller contract.
                unsafe { (**self).deallocate(stream, ptr, bytes, align) }
            }
            fn properties(&self) -> Properties {
                (**self).properties()
            }
            fn device(&self) -> Option<Device> {
                (**self).device()
            }
            fn memory_stats(&self) -> Result<Option<MemoryStats>> {
                (**self).memory_stats()
            }
            fn release_unused(&self) -> Result<usize> {
                (**self).release_unused()
            }
        }
    )*};
}
forward_resource!(Arc<R>, Box<R>, &R);

/// Checks a request's size and alignment; returns the alignment to use (at least `min_align`).
///
/// Every resource calls this first, so bad input gets the same typed error everywhere.
pub fn check_request(bytes: usize, align: usize, min_align: usize) -> Result<usize> {
    if bytes == 0 {
        return Err(Error::ZeroSize);
    }
    if !align.is_power_of_two() {
        return Err(Error::InvalidAlignment(align));
    }
    let align = align.max(min_align);
    match align_up(bytes, align) {
        Some(rounded) if rounded <= isize::MAX as usize => Ok(align),
        _ => Err(Error::SizeOverflow { bytes, align }),
    }
}

/// Rounds `value` up to a multiple of `align` (a power of two); `None` on overflow.
#[inline]
pub fn align_up(value: usize, align: usize) -> Option<usize> {
    debug_assert!(align.is_power_of_two());
    Some(value.checked_add(align - 1)? & !(align - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_validation() {
        assert!(matches!(check_request(0, 8, 1), Err(Error::ZeroSize)));
        assert!(matches!(
            check_request(8, 0, 1),
            Err(Error::InvalidAlignment(0))
        ));
        assert!(matches!(
            check_request(8, 12, 1),
            Err(Error::InvalidAlignment(12))
        ));
        assert!(matches!(
            check_request(usize::MAX, 1, 1),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            check_request(usize::MAX - 10, 256, 1),
            Err(Error::SizeOverflow { .. })
        ));
        assert_eq!(check_request(8, 4, 256).unwrap(), 256);
        assert_eq!(check_request(8, 4096, 256).unwrap(), 4096);
    }

    #[test]
    fn align_up_rounds_and_detects_overflow() {
        assert_eq!(align_up(0, 256), Some(0));
        assert_eq!(align_up(1, 256), Some(256));
        assert_eq!(align_up(256, 256), Some(256));
        assert_eq!(align_up(usize::MAX, 2), None);
    }
}
