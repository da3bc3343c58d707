//! carve's PTX module: built from `kernels/` (or taken from `src/driver/ptx/`) by `build.rs`,
//! embedded here, loaded per device.
//!
//! [`PTX`] is what carve ships: exactly the device-heap ABI of `kernels/carve_heap.h` and its
//! Numba forms ([`SHIPPED_SYMBOLS`]). The smoke, test and benchmark kernels are a module of
//! their own, which only the lab (`carve-lab`) embeds and loads with [`Kernels::load`].

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::Device;
use crate::error::{Error, Result};

/// The shipped PTX module, for loading or JIT-linking with CUDA C++ and Numba kernels.
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/carve.ptx"));

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

/// A PTX module loaded into one device's context: carve's own ([`Device::kernels`]) or any
/// other ([`Kernels::load`]).
#[derive(Debug)]
pub struct Kernels {
    module: Arc<CudaModule>,
}

impl Kernels {
    /// Loads the PTX text `ptx` into `device`'s context (`cuModuleLoadData`). carve's own module
    /// is loaded once per device by [`Device::kernels`]; each call here loads a new copy.
    pub fn load(device: &Device, ptx: &str) -> Result<Kernels> {
        if ptx.contains('\0') {
            return Err(Error::InvalidArgument(
                "a PTX text cannot contain a NUL byte".into(),
            ));
        }
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
}
