//! `carve._carve.reinitialize`: `carve::current::reinitialize`, with an optional RMM CSV log per
//! device in front of each new resource.

use std::sync::Arc;

use pyo3::prelude::*;

use carve::adaptor::LoggingResourceAdaptor;
use carve::current::ReinitializeOptions;
use carve::SharedResource;
use carve_capi::registry::Entry;
use carve_capi::FfiError;

use crate::errors::{guarded, to_py};
use crate::resource::Resource;

/// The ordinal of the device whose context is current on this thread, else 0, asked of the
/// CUDA driver (`cuCtxGetDevice`): frameworks' own current-device queries may initialise their
/// CUDA state, and PyTorch's initialises its allocator with it.
#[pyfunction]
pub fn current_device(py: Python<'_>) -> PyResult<usize> {
    py.detach(|| guarded(|| Ok(carve::Device::current()?.ordinal())))
}

/// Sets the current resource of every device in `devices` (see `carve.reinitialize`); with
/// `log_files` (one path per device, in order) each logs RMM's CSV to its file. Returns the new current
/// resources as `(device, resource)`, in device order. Nothing changes on error.
#[pyfunction]
#[pyo3(signature = (pool, managed, initial_size, maximum_size, devices, log_files = None))]
pub fn reinitialize(
    py: Python<'_>,
    pool: bool,
    managed: bool,
    initial_size: Option<usize>,
    maximum_size: Option<usize>,
    devices: Vec<usize>,
    log_files: Option<Vec<String>>,
) -> PyResult<Vec<(usize, Resource)>> {
    if let Some(files) = &log_files {
        if files.len() != devices.len() {
            return Err(to_py(FfiError::invalid(format!(
                "reinitialize: {} log files for {} devices",
                files.len(),
                devices.len()
            ))));
        }
    }
    let kind = match (pool, managed, log_files.is_some()) {
        (_, _, true) => c"logging",
        (false, false, _) => c"cuda",
        (false, true, _) => c"managed",
        (true, false, _) => c"async",
        (true, true, _) => c"pool",
    };
    let options = ReinitializeOptions {
        pool,
        managed,
        initial_size,
        maximum_size,
        devices: devices.clone(),
    };
    let set = py.detach(|| {
        guarded(|| {
            let wrap = |d: usize, r: SharedResource| -> carve::Result<SharedResource> {
                let Some(files) = &log_files else {
                    return Ok(r);
                };
                let i = devices.iter().position(|&x| x == d).unwrap_or(0);
                // Flushed per line, so the log can be read while the process runs.
                Ok(Arc::new(LoggingResourceAdaptor::to_file(
                    r, &files[i], true,
                )?))
            };
            let previous = carve::current::reinitialize_with(&options, wrap)?;
            let now = previous
                .iter()
                .map(|&(d, _)| Ok((d, carve::current::get(d)?)))
                .collect::<carve::Result<Vec<_>>>()?;
            Ok(now)
        })
    })?;
    set.into_iter()
        .map(|(d, r)| Ok((d, Resource::register(Entry::new(kind, r))?)))
        .collect()
}
