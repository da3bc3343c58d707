//! carve's PTX modules: built from `kernels/` (or taken from `src/driver/ptx/`) by `build.rs`,
//! embedded here, loaded per device.
//!
//! [`PTX`] is what carve ships: exactly the device-heap ABI of `kernels/carve_heap.h` and its
//! Numba forms ([`SHIPPED_SYMBOLS`]). The smoke, test and benchmark kernels live in a second
//! module, [`TEST_PTX`], which only carve's tests and benchmarks load.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

use super::{Device, Stream};
use crate::error::{Error, Result};

/// The shipped PTX module, for loading or JIT-linking with CUDA C++ and Numba kernels.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/carve.ptx"));

/// The test and benchmark kernels: a module of its own, loaded only by carve's tests and
/// benchmarks (through [`Device::test_kernels`]).
#[doc(hidden)]
pub const TEST_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/carve_test.ptx"));

/// What [`PTX`] exports, and all it exports: the functions of `kernels/carve_heap.h` and their
/// Numba-convention forms.
pub const SHIPPED_SYMBOLS: [&str; 12] = [
    "carve_slab_alloc",
    "carve_slab_free",
    "carve_bump_alloc",
    "carve_bump_alloc_block",
    "carve_malloc",
    "carve_free",
    "carve_numba_slab_alloc",
    "carve_numba_slab_free",
    "carve_numba_bump_alloc",
    "carve_numba_bump_alloc_block",
    "carve_numba_malloc",
    "carve_numba_free",
];

/// The `.visible` symbols (kernels, device functions, globals) of a PTX text, in order.
pub fn exported_symbols(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines().filter_map(|l| {
        let rest = l.trim().strip_prefix(".visible ")?;
        // `.visible .entry name(`, `.visible .func (.param ...) name(`, `.visible .global .u32 x;`
        let head = rest.split('(').find(|part| {
            let last = part.split_whitespace().last().unwrap_or("");
            !last.is_empty() && !last.starts_with('.')
        })?;
        let name = head.split_whitespace().last()?;
        Some(name.trim_end_matches(';'))
    })
}

/// Names of the kernel entry points (`.entry`) in a PTX text.
pub fn kernel_names(ptx: &str) -> impl Iterator<Item = &str> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or(rest).trim())
}

/// One of carve's PTX modules, loaded into one device's context.
#[derive(Debug)]
pub struct Kernels {
    module: Arc<CudaModule>,
}

impl Kernels {
    pub(crate) fn load(device: &Device, ptx: &str) -> Result<Kernels> {
        let module = device
            .context()
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| Error::driver("cuModuleLoadData", e))?;
        Ok(Kernels { module })
    }

    /// A kernel or device function of the module, by its exported name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module
            .load_function(name)
            .map_err(|e| Error::driver("cuModuleGetFunction", e))
    }

    /// Launches the smoke kernel (test module): `out[i] = carve_kernels::smoke::pattern(i)` for `i < n`.
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
