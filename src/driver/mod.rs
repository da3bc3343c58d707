//! Driver glue over cudarc: loading libcuda, devices, contexts, streams, events, carve's
//! embedded kernel module, and the JIT linker that joins it with kernels in other languages.
//!
//! cudarc loads libcuda lazily and panics when it is missing; [`init`] checks first, so no carve
//! call panics on a machine without a driver. Devices are interned: [`Device::get`] returns the
//! same handle (and the same loaded module) for an ordinal every time.

pub mod capture;
mod device;
mod link;
pub(crate) mod mem;
mod module;
mod stream;
pub(crate) mod vmm;

pub use device::{Device, DeviceProperties, MemInfo};
pub use link::{link_ptx, LinkedModule, PtxInput};
pub use module::{exported_symbols, kernel_names, Kernels, PTX, SHIPPED_SYMBOLS};
pub use stream::{Event, Stream};

use std::sync::OnceLock;

use cudarc::driver::{result, sys};

use crate::error::{Error, Result};

/// Loads libcuda and initialises the driver, once. Later calls return the first outcome.
pub fn init() -> Result<()> {
    INIT.get_or_init(|| {
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda could not be loaded".to_owned());
        }
        result::init().map_err(|e| format!("cuInit failed: {e:?}"))
    })
    .clone()
    .map_err(Error::NoDriver)
}

static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// True when [`init`] has run and succeeded; never loads the driver itself (a probe for a
/// library that is absent costs about a millisecond, which host-only callers need not pay).
pub(crate) fn driver_initialised() -> bool {
    INIT.get().is_some_and(|r| r.is_ok())
}

/// Free and total memory of device `ordinal` (`cuMemGetInfo`).
pub fn mem_info(ordinal: usize) -> Result<MemInfo> {
    Device::get(ordinal)?.mem_info()
}

/// True when a driver loads and reports at least one device.
pub fn is_available() -> bool {
    Device::count().is_ok_and(|n| n > 0)
}

/// Whether GPU tests must fail rather than skip when no device is found (`CARVE_REQUIRE_GPU=1`).
pub fn gpu_required() -> bool {
    std::env::var_os("CARVE_REQUIRE_GPU").is_some_and(|v| v == "1")
}
