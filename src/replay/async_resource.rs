//! The driver's default memory pool (`cuMemAllocAsync` / `cuMemFreeAsync`), for
//! `carve replay --resource async`.
//!
//! Minimal on purpose: when the project's own async (driver pool) resource lands, the replay
//! target should use it and this file goes.

use std::ptr::NonNull;

use cudarc::driver::{result, sys};

use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::{check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT};
use crate::stream::StreamRef;

const NAME: &str = "driver default pool (cuMemAllocAsync)";

/// Stream-ordered allocation from the device's default memory pool.
#[derive(Clone, Debug)]
pub(crate) struct DefaultPoolResource {
    device: Device,
}

impl DefaultPoolResource {
    pub(crate) fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
        }
    }
}

// SAFETY: the driver's pool returns distinct, live, 256-byte-aligned blocks of the requested
// size, usable in `stream`'s order; larger alignments are refused.
unsafe impl MemoryResource for DefaultPoolResource {
    fn allocate(&self, stream: StreamRef, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, 1)?;
        if align > DEFAULT_ALIGNMENT {
            return Err(Error::Unsupported(format!(
                "{NAME} guarantees {DEFAULT_ALIGNMENT}-byte alignment, not {align}"
            )));
        }
        self.device.bind()?;
        // SAFETY: a context is current; the stream is valid by `StreamRef`'s contract.
        match unsafe { result::malloc_async(stream.as_raw(), bytes) } {
            Ok(p) => NonNull::new(p as *mut u8)
                .ok_or_else(|| Error::Unsupported("cuMemAllocAsync returned null".to_owned())),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: format!("device {}", self.device.ordinal()),
            }),
            Err(e) => Err(Error::driver("cuMemAllocAsync", e)),
        }
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef,
        ptr: NonNull<u8>,
        _bytes: usize,
        _align: usize,
    ) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller passes a block from `allocate`; the free is ordered on `stream`.
        unsafe { result::free_async(ptr.as_ptr() as sys::CUdeviceptr, stream.as_raw()) }
            .map_err(|e| Error::driver("cuMemFreeAsync", e))
    }

    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
}
