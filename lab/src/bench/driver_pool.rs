//! The device's default driver pool (`cuMemAllocAsync`), as a bench-only baseline resource. Its
//! release threshold is raised so the pool keeps memory, as RMM's async resource does.

use std::ptr::NonNull;

use carve::cudarc::driver::{result, sys};
use carve::error::DriverCode;
use carve::resource::Properties;
use carve::{Device, Error, MemoryResource, StreamRef};

#[derive(Debug)]
pub struct DriverPool {
    device: Device,
}

fn driver(call: &'static str, e: carve::cudarc::driver::DriverError) -> Error {
    Error::Driver {
        call,
        code: DriverCode(e.0),
    }
}

impl DriverPool {
    pub fn new(device: &Device) -> carve::Result<Self> {
        device.bind()?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut threshold: u64 = u64::MAX;
        // SAFETY: plain driver queries/settings on a live device with its context bound.
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&mut pool, device.ordinal() as sys::CUdevice)
                .result()
                .map_err(|e| driver("cuDeviceGetDefaultMemPool", e))?;
            sys::cuMemPoolSetAttribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut threshold as *mut u64).cast(),
            )
            .result()
            .map_err(|e| driver("cuMemPoolSetAttribute", e))?;
        }
        Ok(DriverPool {
            device: device.clone(),
        })
    }
}

// SAFETY: the driver pool returns distinct, live, 256-byte-aligned blocks ordered on the stream.
unsafe impl MemoryResource for DriverPool {
    fn allocate(
        &self,
        stream: StreamRef<'_>,
        bytes: usize,
        align: usize,
    ) -> carve::Result<NonNull<u8>> {
        carve::resource::check_request(bytes, align, 1)?;
        self.device.bind()?;
        // SAFETY: context bound; the stream is valid by `StreamRef`'s contract.
        let p = unsafe { result::malloc_async(stream.as_raw(), bytes) }
            .map_err(|e| driver("cuMemAllocAsync", e))?;
        NonNull::new(p as *mut u8).ok_or_else(|| Error::Unsupported("null from the pool".into()))
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        _bytes: usize,
        _align: usize,
    ) -> carve::Result<()> {
        // SAFETY: the caller's contract: a block of this pool, freed once.
        unsafe { result::free_async(ptr.as_ptr() as sys::CUdeviceptr, stream.as_raw()) }
            .map_err(|e| driver("cuMemFreeAsync", e))
    }

    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
    fn device(&self) -> Option<carve::Device> {
        Some(self.device.clone())
    }
}
