//! Devices and their primary contexts.

use std::sync::{Arc, OnceLock};

use cudarc::driver::{result, sys, CudaContext};

use super::{init, Kernels, Stream};
use crate::error::{Error, Result};

/// A CUDA device with its primary context retained. Cheap to clone; one handle per ordinal.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    kernels: OnceLock<Result<Kernels, String>>,
}

/// What `carve info` prints about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProperties {
    /// The device ordinal.
    pub ordinal: usize,
    /// The device's name, as the driver reports it.
    pub name: String,
    /// (major, minor)
    pub compute_capability: (i32, i32),
    /// Device memory in bytes.
    pub total_memory: usize,
    /// Free device memory in bytes, when queried.
    pub free_memory: usize,
    /// Streaming multiprocessors.
    pub multiprocessors: i32,
}

/// Free and total device memory (`cuMemGetInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    /// Free bytes.
    pub free: usize,
    /// Total bytes.
    pub total: usize,
}

impl Device {
    /// Number of CUDA devices; [`Error::NoDriver`] without libcuda.
    pub fn count() -> Result<usize> {
        init()?;
        let n = result::device::get_count().map_err(|e| Error::driver("cuDeviceGetCount", e))?;
        Ok(n.max(0) as usize)
    }

    /// The device `ordinal`, its primary context retained on first use.
    pub fn get(ordinal: usize) -> Result<Device> {
        static DEVICES: OnceLock<Vec<OnceLock<Device>>> = OnceLock::new();
        let count = Device::count()?;
        if count == 0 {
            return Err(Error::NoDevice);
        }
        let slots = DEVICES.get_or_init(|| (0..count).map(|_| OnceLock::new()).collect());
        let slot = slots
            .get(ordinal)
            .ok_or(Error::InvalidDevice { ordinal, count })?;
        if let Some(dev) = slot.get() {
            return Ok(dev.clone());
        }
        let ctx =
            CudaContext::new(ordinal).map_err(|e| Error::driver("cuDevicePrimaryCtxRetain", e))?;
        let dev = Device {
            inner: Arc::new(Inner {
                ordinal,
                ctx,
                kernels: OnceLock::new(),
            }),
        };
        Ok(slot.get_or_init(|| dev).clone())
    }

    /// The device whose context is current on this thread, else device 0.
    pub fn current() -> Result<Device> {
        init()?;
        // SAFETY: plain queries of the calling thread's context.
        let ordinal = unsafe {
            match result::ctx::get_current().map_err(|e| Error::driver("cuCtxGetCurrent", e))? {
                Some(_) => {
                    let mut dev = 0;
                    sys::cuCtxGetDevice(&mut dev)
                        .result()
                        .map_err(|e| Error::driver("cuCtxGetDevice", e))?;
                    dev as usize
                }
                None => 0,
            }
        };
        Device::get(ordinal)
    }

    /// This device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The cudarc context, for launching cudarc kernels beside carve.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.ctx
    }

    /// Makes this device's context current on the calling thread (a no-op when it already is).
    pub fn bind(&self) -> Result<()> {
        self.inner
            .ctx
            .bind_to_thread()
            .map_err(|e| Error::driver("cuCtxSetCurrent", e))
    }

    /// Name, compute capability and memory.
    pub fn properties(&self) -> Result<DeviceProperties> {
        let ctx = &self.inner.ctx;
        let name = ctx
            .name()
            .map_err(|e| Error::driver("cuDeviceGetName", e))?;
        let compute_capability = ctx
            .compute_capability()
            .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        let multiprocessors =
            self.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
        let MemInfo { free, total } = self.mem_info()?;
        Ok(DeviceProperties {
            ordinal: self.ordinal(),
            name,
            compute_capability,
            total_memory: total,
            free_memory: free,
            multiprocessors,
        })
    }

    /// A device attribute (`cuDeviceGetAttribute`).
    pub fn attribute(&self, attr: sys::CUdevice_attribute) -> Result<i32> {
        self.inner
            .ctx
            .attribute(attr)
            .map_err(|e| Error::driver("cuDeviceGetAttribute", e))
    }

    /// Free and total memory on this device.
    pub fn mem_info(&self) -> Result<MemInfo> {
        let (free, total) = self
            .inner
            .ctx
            .mem_get_info()
            .map_err(|e| Error::driver("cuMemGetInfo", e))?;
        Ok(MemInfo { free, total })
    }

    /// The legacy default stream of this device's context.
    pub fn default_stream(&self) -> Stream {
        Stream::from_cudarc(self.clone(), self.inner.ctx.default_stream())
    }

    /// A new non-blocking stream.
    pub fn new_stream(&self) -> Result<Stream> {
        let s = self
            .inner
            .ctx
            .new_stream()
            .map_err(|e| Error::driver("cuStreamCreate", e))?;
        Ok(Stream::from_cudarc(self.clone(), s))
    }

    /// Waits for all work on this device's context.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .ctx
            .synchronize()
            .map_err(|e| Error::driver("cuCtxSynchronize", e))
    }

    /// True when kernels on this device can access memory on `peer` once peer access is
    /// enabled (`cuDeviceCanAccessPeer`). A device is its own peer.
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if self == peer {
            return Ok(true);
        }
        let mut can = 0;
        // SAFETY: a valid out-slot and two device handles.
        unsafe {
            sys::cuDeviceCanAccessPeer(
                &mut can,
                self.inner.ctx.cu_device(),
                peer.inner.ctx.cu_device(),
            )
        }
        .result()
        .map_err(|e| Error::driver("cuDeviceCanAccessPeer", e))?;
        Ok(can != 0)
    }

    /// Lets kernels and copies in this device's context access `peer`'s `cuMemAlloc` memory
    /// (`cuCtxEnablePeerAccess`); a no-op when already enabled or when `peer` is this device.
    /// Driver pools grant access per pool instead
    /// ([`AsyncMemoryResource::set_access`](crate::AsyncMemoryResource::set_access)).
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if self == peer {
            return Ok(());
        }
        if !self.can_access_peer(peer)? {
            return Err(Error::Unsupported(format!(
                "device {} cannot access device {}'s memory",
                self.ordinal(),
                peer.ordinal()
            )));
        }
        self.bind()?;
        // SAFETY: this device's context is current (bound above); `peer`'s context is retained
        // for the process's life.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.inner.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            e => Err(Error::driver(
                "cuCtxEnablePeerAccess",
                cudarc::driver::DriverError(e),
            )),
        }
    }

    /// Waits for the legacy default stream of this device's context (not the calling thread's
    /// current one).
    pub fn synchronize_default_stream(&self) -> Result<()> {
        self.bind()?;
        // SAFETY: the null stream is always valid in a current context (bound above).
        unsafe { result::stream::synchronize(std::ptr::null_mut()) }
            .map_err(|e| Error::driver("cuStreamSynchronize", e))
    }

    /// carve's shipped module ([`super::PTX`]), loaded into this context on first use.
    pub fn kernels(&self) -> Result<&Kernels> {
        self.inner
            .kernels
            .get_or_init(|| Kernels::load(self, super::PTX).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| Error::Unsupported(format!("loading carve's PTX module: {e}")))
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        self.ordinal() == other.ordinal()
    }
}
impl Eq for Device {}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("ordinal", &self.ordinal())
            .finish()
    }
}
