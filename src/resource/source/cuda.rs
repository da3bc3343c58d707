//! `cuMemAlloc` / `cuMemFree`: the plain device-memory resource and the default current resource.

use std::ptr::NonNull;

use cudarc::driver::sys;

use crate::driver::{mem, Device};
use crate::error::{DriverCode, Error, Result};
use crate::resource::memory_resource::{
    check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT,
};
use crate::stream::StreamRef;

const NAME: &str = "CudaMemoryResource";

/// Device memory straight from the driver. Each call is a synchronous driver call, so this is the
/// slow baseline the pools are measured against.
#[derive(Clone, Debug)]
pub struct CudaMemoryResource {
    device: Device,
}

impl CudaMemoryResource {
    /// A resource on `device`.
    pub fn new(device: &Device) -> Self {
        CudaMemoryResource {
            device: device.clone(),
        }
    }

    /// A resource on device `ordinal`.
    pub fn on(ordinal: usize) -> Result<Self> {
        Ok(Self::new(&Device::get(ordinal)?))
    }

    /// The device it allocates on.
    pub fn device(&self) -> &Device {
        &self.device
    }
}

// SAFETY: the driver returns distinct, live, 256-byte-aligned allocations of the requested size;
// larger alignments are refused rather than silently unmet.
unsafe impl MemoryResource for CudaMemoryResource {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        // The capture query below passes the stream to the driver.
        stream.driver_handle(NAME)?;
        let align = check_request(bytes, align, 1)?;
        if align > DEFAULT_ALIGNMENT {
            return Err(Error::Unsupported(format!(
                "{NAME} guarantees {DEFAULT_ALIGNMENT}-byte alignment, not {align}; wrap it in an \
                 aligning adaptor"
            )));
        }
        self.device.bind()?;
        // cuMemAlloc while the stream is captured would invalidate the capture.
        crate::driver::capture::refuse_capture(NAME, stream)?;
        // SAFETY: a context is current (bound above).
        match unsafe { mem::alloc(bytes) } {
            Ok(ptr) => NonNull::new(ptr as *mut u8)
                .ok_or_else(|| Error::Unsupported("cuMemAlloc returned a null pointer".to_owned())),
            Err(e) if e.is_out_of_memory() => {
                let detail = match self.device.mem_info() {
                    Ok(m) => format!(
                        "device {} has {} of {} bytes free",
                        self.device.ordinal(),
                        m.free,
                        m.total
                    ),
                    Err(_) => format!("device {}", self.device.ordinal()),
                };
                Err(Error::OutOfMemory {
                    bytes,
                    resource: NAME,
                    detail,
                })
            }
            Err(e) => Err(e),
        }
    }

    unsafe fn deallocate(
        &self,
        _stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        _bytes: usize,
        _align: usize,
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller passes a pointer from `allocate`; the driver rejects others with
        // CUDA_ERROR_INVALID_VALUE rather than corrupting anything. cuMemFree waits for the
        // device, which subsumes the stream order.
        match unsafe { mem::free(ptr.as_ptr() as sys::CUdeviceptr) } {
            Ok(()) => Ok(()),
            Err(Error::Driver {
                code: DriverCode(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
                ..
            }) => Err(Error::UnknownPointer {
                resource: NAME,
                ptr: ptr.as_ptr() as usize,
            }),
            Err(e) => Err(e),
        }
    }

    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
    fn device(&self) -> Option<Device> {
        Some(self.device.clone())
    }
}
