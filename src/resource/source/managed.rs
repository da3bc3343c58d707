//! `cuMemAllocManaged` (global attach): unified memory that kernels and the host both reach, as a
//! resource, an owned host-viewable buffer, and the prefetch/advice helpers of [`ops`].

mod ops;

pub(crate) use ops::prefetch_raw;
pub use ops::{Advice, ManagedRange, RangeAttributes};

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::sys;

use super::host_buffer::HostBuffer;
use super::location::Location;
use crate::driver::{mem, Device, Stream};
use crate::error::{Error, Result};
use crate::resource::engine::ledger::Ledger;
use crate::resource::memory_resource::{
    check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT,
};
use crate::stream::StreamRef;

const NAME: &str = "ManagedMemoryResource";

/// Managed memory, allocated with global attach so every stream and device may use it.
///
/// Each call is a synchronous driver call. The resource records its blocks, so foreign pointers,
/// double frees and size mismatches are typed errors.
#[derive(Clone)]
pub struct ManagedMemoryResource {
    inner: Arc<Inner>,
}

struct Inner {
    device: Device,
    ledger: Ledger,
}

impl ManagedMemoryResource {
    /// A resource whose driver calls run in `device`'s context; [`Error::Unsupported`] when the
    /// device cannot allocate managed memory.
    pub fn new(device: &Device) -> Result<Self> {
        if device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY)? == 0 {
            return Err(Error::Unsupported(format!(
                "device {} does not support managed memory",
                device.ordinal()
            )));
        }
        Ok(ManagedMemoryResource {
            inner: Arc::new(Inner {
                device: device.clone(),
                ledger: Ledger::new(NAME, None),
            }),
        })
    }

    /// A resource on device `ordinal`.
    pub fn on(ordinal: usize) -> Result<Self> {
        Self::new(&Device::get(ordinal)?)
    }

    /// The device whose context it allocates in.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// Bytes in live blocks of this resource and its clones.
    pub fn allocated_bytes(&self) -> usize {
        self.inner.ledger.in_use()
    }

    /// Number of live blocks.
    pub fn allocation_count(&self) -> usize {
        self.inner.ledger.count()
    }
}

// SAFETY: the driver returns distinct live allocations of the requested size, 256-byte aligned;
// larger alignments are refused. The ledger frees each block once.
unsafe impl MemoryResource for ManagedMemoryResource {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        // The capture query below passes the stream to the driver.
        stream.driver_handle(NAME)?;
        let align = check_request(bytes, align, 1)?;
        if align > DEFAULT_ALIGNMENT {
            return Err(Error::Unsupported(format!(
                "{NAME} guarantees {DEFAULT_ALIGNMENT}-byte alignment, not {align}"
            )));
        }
        self.inner.device.bind()?;
        // A synchronous allocation while the stream is captured would invalidate the capture.
        crate::driver::capture::refuse_capture(NAME, stream)?;
        let admission = self.inner.ledger.admit(bytes)?;
        // SAFETY: a context is current (bound above).
        let dptr = unsafe { mem::alloc_managed(bytes) }.map_err(|e| {
            if e.is_out_of_memory() {
                Error::OutOfMemory {
                    bytes,
                    resource: NAME,
                    detail: "cuMemAllocManaged found no room".into(),
                }
            } else {
                e
            }
        })?;
        let ptr = NonNull::new(dptr as *mut u8)
            .ok_or_else(|| Error::Unsupported("cuMemAllocManaged returned null".into()))?;
        admission.commit(ptr);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        _stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        self.inner.ledger.release(ptr, bytes, || {
            self.inner.device.bind().and_then(|()| {
                // SAFETY: the ledger confirmed the block is ours and live. cuMemFree waits for the
                // device, which subsumes the stream order.
                unsafe { mem::free(ptr.as_ptr() as sys::CUdeviceptr) }
            })
        })
    }

    fn properties(&self) -> Properties {
        Properties::BOTH
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

impl fmt::Debug for ManagedMemoryResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("device", &self.inner.device.ordinal())
            .field("allocated_bytes", &self.allocated_bytes())
            .finish()
    }
}

/// An owned array of `T` in managed memory, readable and writable from the host as a slice and
/// from kernels through [`device_ptr`](HostBuffer::device_ptr).
pub type ManagedBuffer<T> = HostBuffer<T, ManagedMemoryResource>;

impl<T: Pod> HostBuffer<T, ManagedMemoryResource> {
    /// The address kernels use (the same as the host's; 0 when empty).
    pub fn device_ptr(&self) -> u64 {
        self.host_ptr().map_or(0, |p| p.as_ptr() as u64)
    }

    /// The whole buffer as a managed range ([`Error::ZeroSize`] when empty).
    pub fn range(&self) -> Result<ManagedRange> {
        ManagedRange::new(self.device_ptr(), self.len() * size_of::<T>())
    }

    /// Prefetches the whole buffer to `location` on `stream`.
    pub fn prefetch(&self, location: Location, stream: &Stream) -> Result<()> {
        self.range()?.prefetch(location, stream)
    }

    /// Advises the driver about the whole buffer.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        self.range()?.advise(advice)
    }

    /// The whole buffer's range attributes.
    pub fn attributes(&self) -> Result<RangeAttributes> {
        self.range()?.attributes()
    }
}
