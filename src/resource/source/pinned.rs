//! Pinned (page-locked) host memory: `cuMemHostAlloc` as a resource, an owned buffer with safe
//! host views and, when device-mapped, a device pointer; and registration of existing memory
//! ([`HostRegistration`]).

mod flags;
mod register;

pub use flags::PinnedFlags;
pub use register::HostRegistration;

use std::ffi::c_void;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::sys;

use super::host_buffer::HostBuffer;
use crate::driver::{mem, Device};
use crate::error::{Error, Result};
use crate::resource::engine::ledger::Ledger;
use crate::resource::memory_resource::{check_request, MemoryResource, Properties};
use crate::stream::StreamRef;

const NAME: &str = "PinnedHostMemoryResource";

/// The alignment `cuMemHostAlloc` guarantees. Large blocks are whole pages, but the driver
/// suballocates small ones (seen on an H100, driver 580: 512-byte steps), so no more is promised.
pub const PINNED_ALIGNMENT: usize = 256;

/// Page-locked host memory from `cuMemHostAlloc`, with [`PinnedFlags`].
///
/// Host-accessible always; device-accessible (reported by [`MemoryResource::properties`]) when
/// device-mapped. Freeing waits for the stream given, then calls `cuMemFreeHost`.
#[derive(Clone)]
pub struct PinnedHostMemoryResource {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    flags: PinnedFlags,
    ledger: Ledger,
}

impl PinnedHostMemoryResource {
    /// A resource that allocates in `device`'s context; [`Error::Unsupported`] when device-mapped
    /// is asked of a device that cannot map host memory.
    pub fn new(device: &Device, flags: PinnedFlags) -> Result<Self> {
        if flags.device_mapped
            && device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?
                == 0
        {
            return Err(Error::Unsupported(format!(
                "device {} cannot map host memory",
                device.ordinal()
            )));
        }
        Ok(PinnedHostMemoryResource {
            inner: Arc::new(Inner {
                device: device.clone(),
                flags,
                ledger: Ledger::new(NAME, None),
            }),
        })
    }

    /// The flags every allocation gets.
    pub fn flags(&self) -> PinnedFlags {
        self.inner.flags
    }

    /// The device whose context it allocates in.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Bytes in live blocks.
    pub fn allocated_bytes(&self) -> usize {
        self.inner.ledger.in_use()
    }

    /// Number of live blocks.
    pub fn allocation_count(&self) -> usize {
        self.inner.ledger.count()
    }

    /// The device address of host address `host` in a device-mapped allocation of this resource
    /// (`cuMemHostGetDevicePointer`); [`Error::Unsupported`] without device-mapped.
    pub fn device_pointer(&self, host: NonNull<u8>) -> Result<u64> {
        if !self.inner.flags.device_mapped {
            return Err(Error::Unsupported(format!(
                "{NAME} was created without PinnedFlags::DEVICE_MAPPED"
            )));
        }
        mapped_device_pointer(&self.inner.device, host)
    }

    /// The flags the driver records for host address `host` in an allocation of this resource
    /// (`cuMemHostGetFlags`), to check what the allocation really got.
    pub fn driver_flags(&self, host: NonNull<u8>) -> Result<PinnedFlags> {
        self.inner.device.bind()?;
        // SAFETY: a context is current (bound above); the driver rejects addresses it did not
        // pin.
        let bits = unsafe { mem::host_get_flags(host.as_ptr().cast::<c_void>()) }?;
        Ok(PinnedFlags::from_alloc_bits(bits))
    }
}

/// `cuMemHostGetDevicePointer` for a pinned, device-mapped host address.
fn mapped_device_pointer(device: &Device, host: NonNull<u8>) -> Result<u64> {
    device.bind()?;
    // SAFETY: a context is current (bound above); the driver rejects addresses it did not map.
    unsafe { mem::host_device_pointer(host.as_ptr().cast::<c_void>()) }
}

// SAFETY: the driver returns distinct live allocations of the requested size, aligned to
// PINNED_ALIGNMENT; larger alignments are refused. The ledger frees each block once.
unsafe impl MemoryResource for PinnedHostMemoryResource {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        // The capture query below passes the stream to the driver.
        stream.driver_handle(NAME)?;
        let align = check_request(bytes, align, 1)?;
        if align > PINNED_ALIGNMENT {
            return Err(Error::Unsupported(format!(
                "{NAME} guarantees {PINNED_ALIGNMENT}-byte alignment, not {align}"
            )));
        }
        self.inner.device.bind()?;
        // A synchronous allocation while the stream is captured would invalidate the capture.
        crate::driver::capture::refuse_capture(NAME, stream)?;
        let admission = self.inner.ledger.admit(bytes)?;
        // SAFETY: a context is current (bound above).
        let p = unsafe { mem::host_alloc(bytes, self.inner.flags.alloc_bits()) }.map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    bytes,
                    resource: NAME,
                    detail: "cuMemHostAlloc could not pin that much host memory".into(),
                }
            } else {
                e
            }
        })?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::Unsupported("cuMemHostAlloc returned null".into()))?;
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
                // SAFETY: `StreamRef`'s contract keeps the stream valid. Waiting honours the stream
                // order: work queued on it may still read or write the block.
                unsafe { mem::stream_synchronize(raw) }?;
                // SAFETY: the ledger confirmed the block is ours and live, and its stream is idle.
                unsafe { mem::free_host(ptr.as_ptr().cast::<c_void>()) }
            })
        })
    }

    fn properties(&self) -> Properties {
        if self.inner.flags.device_mapped {
            Properties::BOTH
        } else {
            Properties::HOST
        }
    }

    fn device(&self) -> Option<Device> {
        Some(self.inner.device.clone())
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        Ok(Some(crate::resource::MemoryStats::in_use(
            self.allocated_bytes(),
            self.allocation_count(),
        )))
    }
}

impl fmt::Debug for PinnedHostMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.inner.device.ordinal())
            .field("flags", &self.inner.flags)
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// An owned array of `T` in pinned host memory, with safe host views and, when device-mapped, a
/// device pointer.
pub type PinnedBuffer<T> = HostBuffer<T, PinnedHostMemoryResource>;

impl<T: Pod> HostBuffer<T, PinnedHostMemoryResource> {
    /// The flags it was allocated with.
    pub fn flags(&self) -> PinnedFlags {
        self.resource().flags()
    }

    /// The address kernels use to reach this memory without a copy; [`Error::Unsupported`]
    /// unless device-mapped, [`Error::ZeroSize`] when empty.
    pub fn device_ptr(&self) -> Result<u64> {
        let p = self.host_ptr().ok_or(Error::ZeroSize)?;
        self.resource().device_pointer(p)
    }

    /// The flags the driver records for this memory (`cuMemHostGetFlags`); [`Error::ZeroSize`]
    /// when empty.
    pub fn driver_flags(&self) -> Result<PinnedFlags> {
        let p = self.host_ptr().ok_or(Error::ZeroSize)?;
        self.resource().driver_flags(p)
    }
}
