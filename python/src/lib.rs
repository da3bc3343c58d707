//! `carve._carve`: the Python extension module. The public package (`carve/`) wraps it.
//!
//! The module is also carve's C library: it links `carve-capi`, so every symbol of
//! `include/carve.h` (the PyTorch, CuPy and ONNX Runtime allocator functions included) is
//! exported from this shared object, and `carve.lib_path()` names it.

mod buffer;
mod cache;
mod errors;
mod heap;
mod managed;
mod pinned;
mod pool_limit;
mod reinit;
mod resource;
mod resource_vm;
mod scopes;
mod stream;
mod torch_oom;
mod vm_segments;
mod vm_share;

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve_capi::frameworks;

use crate::errors::to_py;
use crate::resource::Resource;

/// Makes `resource` current for `device`; returns the resource it replaces.
#[pyfunction]
fn set_current_resource(py: Python<'_>, device: usize, resource: &Resource) -> PyResult<Resource> {
    let entry = Arc::clone(&resource.entry);
    let previous = py
        .detach(|| carve_capi::current::set(device, entry))
        .map_err(to_py)?;
    Resource::register(previous)
}

/// The current resource of `device` (a cuda resource until one is set).
#[pyfunction]
fn get_current_resource(py: Python<'_>, device: usize) -> PyResult<Resource> {
    Resource::register(
        py.detach(|| carve_capi::current::get(device))
            .map_err(to_py)?,
    )
}

/// `(free, total)` bytes of `device` (`cuMemGetInfo`).
#[pyfunction]
fn mem_info(py: Python<'_>, device: usize) -> PyResult<(usize, usize)> {
    let m = py
        .detach(|| carve::current::mem_info(device))
        .map_err(|e| to_py(e.into()))?;
    Ok((m.free, m.total))
}

/// Number of CUDA devices; raises `NoDeviceError` without a driver.
#[pyfunction]
fn device_count(py: Python<'_>) -> PyResult<usize> {
    py.detach(carve::Device::count).map_err(|e| to_py(e.into()))
}

/// True when a CUDA driver loads and reports a device.
#[pyfunction]
fn is_available(py: Python<'_>) -> bool {
    py.detach(carve::driver::is_available)
}

fn io_error(e: std::io::Error) -> PyErr {
    to_py(carve::Error::Io(e).into())
}

/// carve's per-user cache folder (created `0700`; refused unless this user owns it and no one
/// else can write it).
#[pyfunction]
fn cache_dir(py: Python<'_>) -> PyResult<String> {
    let dir = py.detach(cache::dir).map_err(io_error)?;
    Ok(dir.to_string_lossy().into_owned())
}

/// Writes carve's PTX (the device heap's functions) to the per-user cache once; returns its
/// path.
#[pyfunction]
fn ptx_path(py: Python<'_>) -> PyResult<String> {
    let ptx = carve::driver::PTX;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    ptx.hash(&mut h);
    let name = format!("carve-{:016x}.ptx", h.finish());
    let path = py
        .detach(|| cache::write(&cache::dir()?, &name, ptx.as_bytes()))
        .map_err(io_error)?;
    Ok(path.to_string_lossy().into_owned())
}

/// Takes the first error recorded where nothing could raise it (a buffer's free, a resource's
/// teardown) since the last call, as an exception instance (not raised); None when none.
#[pyfunction]
fn take_deferred_error(py: Python<'_>) -> Option<Py<PyAny>> {
    let e = carve::take_deferred_error()?;
    let mut ffi = carve_capi::FfiError::from(e.error);
    ffi.message = format!("{}: {}", e.context, ffi.message);
    Some(to_py(ffi).into_value(py).into_any())
}

/// How many such errors were recorded since the process started (taken or not).
#[pyfunction]
fn deferred_error_count() -> u64 {
    carve::deferred_error_count()
}

/// Binds PyTorch slot `slot` (`carve_torch_alloc_<slot>`) to `resource` (None unbinds).
#[pyfunction]
#[pyo3(signature = (slot, resource))]
fn torch_bind_slot(py: Python<'_>, slot: usize, resource: Option<&Resource>) -> PyResult<()> {
    let entry = resource.map(|r| Arc::clone(&r.entry));
    py.detach(|| frameworks::bind_torch_slot(slot, entry))
        .map_err(to_py)
}

/// Binds ONNX Runtime's allocator symbols to `resource` (None: the current resource).
#[pyfunction]
#[pyo3(signature = (resource = None))]
fn ort_set_resource(py: Python<'_>, resource: Option<&Resource>) {
    let entry = resource.map(|r| Arc::clone(&r.entry));
    py.detach(|| frameworks::bind_ort(entry));
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
    m.add_class::<scopes::StatisticsScopes>()?;
    m.add_function(wrap_pyfunction!(scopes::make_statistics_scoped, m)?)?;
    m.add_function(wrap_pyfunction!(reinit::reinitialize, m)?)?;
    m.add_function(wrap_pyfunction!(torch_oom::torch_oom_thrower, m)?)?;
    m.add_function(wrap_pyfunction!(reinit::current_device, m)?)?;
    resource::add_constructors(m)?;
    resource_vm::add_constructors(m)?;
    vm_share::add(m)?;
    vm_segments::add(m)?;
    managed::add(m)?;
    pool_limit::add(m)?;
    pinned::add(m)?;
    m.add_function(wrap_pyfunction!(set_current_resource, m)?)?;
    m.add_function(wrap_pyfunction!(get_current_resource, m)?)?;
    m.add_function(wrap_pyfunction!(mem_info, m)?)?;
    m.add_function(wrap_pyfunction!(device_count, m)?)?;
    m.add_function(wrap_pyfunction!(is_available, m)?)?;
    m.add_function(wrap_pyfunction!(ptx_path, m)?)?;
    m.add_function(wrap_pyfunction!(cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(take_deferred_error, m)?)?;
    m.add_function(wrap_pyfunction!(deferred_error_count, m)?)?;
    m.add_function(wrap_pyfunction!(torch_bind_slot, m)?)?;
    m.add_function(wrap_pyfunction!(ort_set_resource, m)?)?;
    m.add_function(wrap_pyfunction!(framework_outstanding, m)?)?;
    m.add_function(wrap_pyfunction!(last_error, m)?)?;
    m.add_function(wrap_pyfunction!(function_addresses, m)?)?;
    Ok(())
}
