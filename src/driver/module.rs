//! carve's PTX module: built from `kernels/` by `build.rs`, embedded here, loaded per device.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::{Device, Stream};
use crate::error::{Error, Result};

/// The PTX text of `kernels/`, for loading or JIT-linking with CUDA C++ and Numba kernels.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/carve_kernels.ptx"));

/// Names of the kernel entry points in [`PTX`].
pub fn kernel_names() -> impl Iterator<Item = &'static str> {
    PTX.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or(rest).trim())
}

/// carve's kernels, loaded into one device's context.
#[derive(Debug)]
pub struct Kernels {
    module: Arc<CudaModule>,
}

impl Kernels {
    pub(crate) fn load(device: &Device) -> Result<Kernels> {
        let module = device
            .context()
            .load_module(Ptx::from_src(PTX))
            .map_err(|e| Error::driver("cuModuleLoadData", e))?;
        Ok(Kernels { module })
    }

    /// A kernel or device function of the module, by its exported name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module
            .load_function(name)
            .map_err(|e| Error::driver("cuModuleGetFunction", e))
    }

    /// Launches the smoke kernel: `out[i] = carve_kernels::smoke::pattern(i)` for `i < n`.
    ///
    /// # Safety
    /// `out` must be device-accessible memory of at least `n` `u32`s, not used concurrently by
    /// other work, and valid until the launch completes on `stream`.
    pub unsafe fn smoke_fill(&self, stream: &Stream, out: u64, n: u32) -> Result<()> {
        let f = self.function("carve_smoke_fill")?;
        let cfg = LaunchConfig::for_num_elems(n.max(1));
        let mut launch = stream.cudarc().launch_builder(&f);
        launch.arg(&out).arg(&n);
        // SAFETY: the signature matches `carve_smoke_fill(*mut u32, u32)`; the caller vouches
        // for the memory.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::driver("cuLaunchKernel", e))
    }

    /// Launches the read-modify-write smoke kernel: `data[i] = data[i].wrapping_add(delta)` for
    /// `i < n`.
    ///
    /// # Safety
    /// `data` must be device-accessible memory of at least `n` initialised `u32`s, not used
    /// concurrently by other work, and valid until the launch completes on `stream`.
    pub unsafe fn smoke_add(&self, stream: &Stream, data: u64, n: u32, delta: u32) -> Result<()> {
        let f = self.function("carve_smoke_add")?;
        let cfg = LaunchConfig::for_num_elems(n.max(1));
        let mut launch = stream.cudarc().launch_builder(&f);
        launch.arg(&data).arg(&n).arg(&delta);
        // SAFETY: the signature matches `carve_smoke_add(*mut u32, u32, u32)`; the caller vouches
        // for the memory.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(|e| Error::driver("cuLaunchKernel", e))
    }
}
