//! `carve._carve`: the Python extension module. The public package (`carve/`) wraps it.
//!
//! The module is also carve's C library: it links `carve-capi`, so every symbol of
//! `include/carve.h` (the PyTorch, CuPy and ONNX Runtime allocator functions included) is
//! exported from this shared object, and `carve.lib_path()` names it.

mod buffer;
mod errors;
mod heap;
mod resource;

use std::hash::{Hash, Hasher};
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve_capi::frameworks;

use crate::errors::to_py;
use crate::resource::Resource;

/// Makes `resource` current for `device`; returns the resource it replaces.
#[pyfunction]
fn set_current_resource(device: usize, resource: &Resource) -> PyResult<Resource> {
    let previous = carve_capi::current::set(device, resource.entry.clone()).map_err(to_py)?;
    Resource::register(previous)
}

/// The current resource of `device` (a cuda resource until one is set).
#[pyfunction]
fn get_current_resource(device: usize) -> PyResult<Resource> {
    Resource::register(carve_capi::current::get(device).map_err(to_py)?)
}

/// `(free, total)` bytes of `device` (`cuMemGetInfo`).
#[pyfunction]
fn mem_info(device: usize) -> PyResult<(usize, usize)> {
    let m = carve::current::mem_info(device).map_err(|e| to_py(e.into()))?;
    Ok((m.free, m.total))
}

/// Number of CUDA devices; raises `NoDeviceError` without a driver.
#[pyfunction]
fn device_count() -> PyResult<usize> {
    carve::Device::count().map_err(|e| to_py(e.into()))
}

/// True when a CUDA driver loads and reports a device.
#[pyfunction]
fn is_available() -> bool {
    carve::driver::is_available()
}

/// Writes carve's PTX (the device heap's functions) to a cache file once; returns its path.
#[pyfunction]
fn ptx_path() -> PyResult<String> {
    let ptx = carve::driver::PTX;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ptx.hash(&mut h);
    let dir = std::env::var_os("CARVE_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("carve"));
    let path = dir.join(format!("carve-{:016x}.ptx", h.finish()));
    if std::fs::read_to_string(&path).ok().as_deref() != Some(ptx) {
        std::fs::create_dir_all(&dir)?;
        // Write then rename, so a concurrent reader never sees half a file.
        let tmp = dir.join(format!(".carve-{}.ptx.tmp", std::process::id()));
        std::fs::write(&tmp, ptx)?;
        std::fs::rename(&tmp, &path)?;
    }
    Ok(path.to_string_lossy().into_owned())
}

/// Binds PyTorch slot `slot` (`carve_torch_alloc_<slot>`) to `resource` (None unbinds).
#[pyfunction]
#[pyo3(signature = (slot, resource))]
fn torch_bind_slot(slot: usize, resource: Option<&Resource>) -> PyResult<()> {
    frameworks::bind_torch_slot(slot, resource.map(|r| r.entry.clone())).map_err(to_py)
}

/// Binds ONNX Runtime's allocator symbols to `resource` (None: the current resource).
#[pyfunction]
#[pyo3(signature = (resource = None))]
fn ort_set_resource(resource: Option<&Resource>) {
    frameworks::bind_ort(resource.map(|r| r.entry.clone()));
}

/// Blocks handed to frameworks through the C symbols and not yet freed.
#[pyfunction]
fn framework_outstanding() -> usize {
    frameworks::outstanding_blocks()
}

/// This thread's last error from the C symbols (frameworks' allocators report through it).
#[pyfunction]
fn last_error() -> String {
    carve_capi::error::last_error()
}

/// Addresses of the allocator functions, for frameworks that take function pointers.
#[pyfunction]
fn function_addresses(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item(
        "carve_cupy_malloc",
        frameworks::carve_cupy_malloc as *const () as usize,
    )?;
    d.set_item(
        "carve_cupy_free",
        frameworks::carve_cupy_free as *const () as usize,
    )?;
    d.set_item(
        "carve_ort_alloc",
        frameworks::carve_ort_alloc as *const () as usize,
    )?;
    d.set_item(
        "carve_ort_free",
        frameworks::carve_ort_free as *const () as usize,
    )?;
    d.set_item(
        "carve_ort_empty_cache",
        frameworks::carve_ort_empty_cache as *const () as usize,
    )?;
    d.set_item(
        "carve_torch_alloc",
        frameworks::carve_torch_alloc as *const () as usize,
    )?;
    d.set_item(
        "carve_torch_free",
        frameworks::carve_torch_free as *const () as usize,
    )?;
    Ok(d)
}

#[pymodule]
fn _carve(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TORCH_SLOTS", frameworks::TORCH_SLOTS)?;
    m.add_class::<Resource>()?;
    m.add_class::<buffer::DeviceBuffer>()?;
    m.add_class::<heap::DeviceHeap>()?;
    resource::add_constructors(m)?;
    m.add_function(wrap_pyfunction!(set_current_resource, m)?)?;
    m.add_function(wrap_pyfunction!(get_current_resource, m)?)?;
    m.add_function(wrap_pyfunction!(mem_info, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(is_available, m)?)?;
    m.add_function(wrap_pyfunction!(ptx_path, m)?)?;
    m.add_function(wrap_pyfunction!(torch_bind_slot, m)?)?;
    m.add_function(wrap_pyfunction!(ort_set_resource, m)?)?;
    m.add_function(wrap_pyfunction!(framework_outstanding, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_function(wrap_pyfunction!(function_addresses, m)?)?;
    Ok(())
}
