//! `carve._carve.Resource`: a registered carve resource, and the functions that build them.
//! The public classes (`carve.PoolResource`, ...) are Python wrappers in `carve/_resources.py`.

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve_capi::registry::{self, Entry, Handle};
use carve_capi::{make, stats, FfiError};

use crate::errors::{guarded, to_py};
use crate::stream::HeldStream;

/// The most per-thread arenas an arena resource may have: far above any machine's thread
/// count, far below a count whose bookkeeping alone would exhaust memory.
const MAX_ARENAS: usize = 1 << 16;

/// A carve resource. `handle` is its id in carve's C ABI (e.g. CuPy's allocator parameter).
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct Resource {
    /// Taken only by `Drop`.
    pub(crate) entry: ManuallyDrop<Arc<Entry>>,
    handle: Handle,
}

impl Resource {
    /// Registers `entry` under a new handle (forgotten when the Python object goes).
    pub fn register(entry: Arc<Entry>) -> PyResult<Resource> {
        let handle = registry::insert(Arc::clone(&entry)).map_err(to_py)?;
        Ok(Resource {
            entry: ManuallyDrop::new(entry),
            handle,
        })
    }
}

impl Drop for Resource {
    fn drop(&mut self) {
        let _ = registry::remove(self.handle);
        // SAFETY: taken once, here; the field is not used afterwards.
        let entry = unsafe { ManuallyDrop::take(&mut self.entry) };
        // The last reference tears the resource down, which may wait for the device.
        Python::attach(|py| py.detach(move || drop(entry)));
    }
}

/// The carve resource behind `obj`: a `Resource`, or a `carve` wrapper holding one in `_r`.
pub fn resource_of<'py>(obj: &Bound<'py, PyAny>) -> PyResult<PyRef<'py, Resource>> {
    if let Ok(r) = obj.extract::<PyRef<'py, Resource>>() {
        return Ok(r);
    }
    let inner = obj
        .getattr("_r")
        .map_err(|_| PyTypeError::new_err("expected a carve resource"))?;
    inner
        .extract::<PyRef<'py, Resource>>()
        .map_err(|_| PyTypeError::new_err("expected a carve resource"))
}

#[pymethods]
impl Resource {
    /// The kind: "cuda", "pool", "statistics", ... ("current" for a resource set from Rust).
    #[getter]
    fn kind(&self) -> &'static str {
        self.entry.kind_str()
    }

    /// The resource's handle in carve's C ABI.
    #[getter]
    fn handle(&self) -> Handle {
        self.handle
    }

    /// Kernels may dereference its pointers.
    #[getter]
    fn device_accessible(&self) -> bool {
        self.entry.resource.properties().device_accessible
    }

    /// Host code may dereference its pointers.
    #[getter]
    fn host_accessible(&self) -> bool {
        self.entry.resource.properties().host_accessible
    }

    /// The driver pool (`CUmemoryPool`, as an int) of an async resource, else None: share it
    /// with CuPy (`cupy.cuda.MemoryAsyncPool`, one handle per device) or PyTorch's
    /// cudaMallocAsync backend.
    #[getter]
    fn pool_handle(&self) -> Option<usize> {
        self.entry.driver_pool
    }

    /// Allocates `nbytes` aligned to `alignment`, ordered on `stream` (a CUstream as an int or
    /// a stream object); returns the address.
    #[pyo3(signature = (nbytes, alignment = 256, stream = None))]
    fn allocate(
        &self,
        py: Python<'_>,
        nbytes: usize,
        alignment: usize,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<usize> {
        let stream = stream_arg(stream)?;
        py.detach(|| {
            guarded(|| {
                let p = self
                    .entry
                    .resource
                    .allocate(stream.for_call(), nbytes, alignment)?;
                Ok(p.as_ptr() as usize)
            })
        })
    }

    /// Frees a block from `allocate(nbytes, alignment)`, ordered on `stream`. Resources that
    /// track their blocks refuse foreign pointers and double frees (`BadPointerError`).
    #[pyo3(signature = (ptr, nbytes, alignment = 256, stream = None))]
    fn deallocate(
        &self,
        py: Python<'_>,
        ptr: usize,
        nbytes: usize,
        alignment: usize,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let stream = stream_arg(stream)?;
        py.detach(|| {
            guarded(|| {
                let p = NonNull::new(ptr as *mut u8).ok_or_else(|| {
                    FfiError::new(
                        carve_capi::Code::BadPointer,
                        "null pointer passed to deallocate",
                    )
                })?;
                // SAFETY: the Python API promises what the trait asks: `ptr` came from
                // `allocate(nbytes, alignment)` here and is not used afterwards. Resources that
                // can tell refuse a pointer they do not own instead of trusting it.
                unsafe {
                    self.entry
                        .resource
                        .deallocate(stream.for_call(), p, nbytes, alignment)
                }?;
                Ok(())
            })
        })
    }

    /// The resource's statistics as a dict (empty for resources that keep none).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let all = py.detach(|| guarded(|| stats::of(&self.entry)))?;
        let d = PyDict::new(py);
        for (name, value) in all {
            let name = name.to_str().unwrap_or("?");
            if value.fract() == 0.0 && value.abs() < 9.0e15 {
                d.set_item(name, value as i64)?;
            } else {
                d.set_item(name, value)?;
            }
        }
        Ok(d)
    }

    /// Returns unused memory upstream (pool, arena, driver pool); the bytes released.
    fn release(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| guarded(|| make::release(&self.entry)))
    }

    /// True when `other` is the same resource (not merely an equal one).
    fn same_as(&self, other: &Resource) -> bool {
        Arc::ptr_eq(&self.entry, &other.entry)
            || std::ptr::addr_eq(
                Arc::as_ptr(&self.entry.resource),
                Arc::as_ptr(&other.entry.resource),
            )
    }

    fn __repr__(&self) -> String {
        format!(
            "<carve {} resource {:#x}>",
            self.entry.kind_str(),
            self.handle
        )
    }
}

/// A stream argument for the duration of one call (None: the legacy default stream).
fn stream_arg(stream: Option<Bound<'_, PyAny>>) -> PyResult<HeldStream> {
    match stream {
        Some(s) => HeldStream::extract(&s),
        None => Ok(HeldStream::LEGACY),
    }
}

/// Builds a resource with the GIL released (construction may allocate from the device), a
/// panic caught as `CarveError`, and registers it.
pub(crate) fn made(
    py: Python<'_>,
    build: impl FnOnce() -> carve_capi::error::FfiResult<Arc<Entry>> + Send,
) -> PyResult<Resource> {
    Resource::register(py.detach(|| guarded(build))?)
}

/// `cuMemAlloc` on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn make_cuda(py: Python<'_>, device: usize) -> PyResult<Resource> {
    made(py, || make::cuda(device))
}

/// Managed memory on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn make_managed(py: Python<'_>, device: usize) -> PyResult<Resource> {
    made(py, || make::managed(device))
}

/// Pinned host memory.
#[pyfunction]
#[pyo3(signature = (device = 0, portable = false, device_mapped = false, write_combined = false))]
fn make_pinned(
    py: Python<'_>,
    device: usize,
    portable: bool,
    device_mapped: bool,
    write_combined: bool,
) -> PyResult<Resource> {
    let bit = |on: bool, bit: u32| if on { bit } else { 0 };
    let flags = bit(portable, make::PINNED_PORTABLE)
        | bit(device_mapped, make::PINNED_DEVICE_MAPPED)
        | bit(write_combined, make::PINNED_WRITE_COMBINED);
    made(py, || make::pinned(device, flags))
}

/// A new driver pool on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0, initial_size = 0, release_threshold = None, hard_limit = None))]
fn make_async(
    py: Python<'_>,
    device: usize,
    initial_size: usize,
    release_threshold: Option<usize>,
    hard_limit: Option<usize>,
) -> PyResult<Resource> {
    made(py, || {
        make::async_pool(device, initial_size, release_threshold, hard_limit)
    })
}

/// Pageable host memory.
#[pyfunction]
fn make_host(py: Python<'_>) -> PyResult<Resource> {
    made(py, || Ok(make::host()))
}

/// A coalescing pool.
#[pyfunction]
#[pyo3(signature = (upstream, initial_size = 0, maximum_size = None))]
fn make_pool(
    py: Python<'_>,
    upstream: &Resource,
    initial_size: usize,
    maximum_size: Option<usize>,
) -> PyResult<Resource> {
    made(py, || {
        make::pool(&upstream.entry, initial_size, maximum_size)
    })
}

/// Power-of-two bins.
#[pyfunction]
fn make_binning(
    py: Python<'_>,
    upstream: &Resource,
    min_exp: u32,
    max_exp: u32,
) -> PyResult<Resource> {
    made(py, || make::binning(&upstream.entry, min_exp, max_exp))
}

/// Per-thread arenas (at most [`MAX_ARENAS`]).
#[pyfunction]
#[pyo3(signature = (upstream, superblock_size = 0, arenas = 0, maximum_size = None))]
fn make_arena(
    py: Python<'_>,
    upstream: &Resource,
    superblock_size: usize,
    arenas: usize,
    maximum_size: Option<usize>,
) -> PyResult<Resource> {
    if arenas > MAX_ARENAS {
        return Err(to_py(FfiError::invalid(format!(
            "ArenaResource: {arenas} arenas; at most {MAX_ARENAS}"
        ))));
    }
    made(py, || {
        make::arena(&upstream.entry, superblock_size, arenas, maximum_size)
    })
}

/// Fixed-size blocks.
#[pyfunction]
#[pyo3(signature = (upstream, block_size, blocks_per_refill = 0))]
fn make_fixed_size(
    py: Python<'_>,
    upstream: &Resource,
    block_size: usize,
    blocks_per_refill: u32,
) -> PyResult<Resource> {
    made(py, || {
        make::fixed_size(&upstream.entry, block_size, blocks_per_refill)
    })
}

/// A byte limit.
#[pyfunction]
fn make_limiting(py: Python<'_>, upstream: &Resource, limit: usize) -> PyResult<Resource> {
    made(py, || Ok(make::limiting(&upstream.entry, limit)))
}

/// Counters.
#[pyfunction]
fn make_statistics(py: Python<'_>, upstream: &Resource) -> PyResult<Resource> {
    made(py, || Ok(make::statistics(&upstream.entry)))
}

/// Outstanding-block tracking.
#[pyfunction]
#[pyo3(signature = (upstream, capture_backtraces = false))]
fn make_tracking(
    py: Python<'_>,
    upstream: &Resource,
    capture_backtraces: bool,
) -> PyResult<Resource> {
    made(py, || {
        Ok(make::tracking(&upstream.entry, capture_backtraces))
    })
}

/// RMM's CSV log to a new file.
#[pyfunction]
#[pyo3(signature = (upstream, path, auto_flush = false))]
fn make_logging(
    py: Python<'_>,
    upstream: &Resource,
    path: &str,
    auto_flush: bool,
) -> PyResult<Resource> {
    made(py, || make::logging(&upstream.entry, path, auto_flush))
}

/// Adds the `make_*` functions to the module.
pub fn add_constructors(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(make_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(make_managed, m)?)?;
    m.add_function(wrap_pyfunction!(make_pinned, m)?)?;
    m.add_function(wrap_pyfunction!(make_async, m)?)?;
    m.add_function(wrap_pyfunction!(make_host, m)?)?;
    m.add_function(wrap_pyfunction!(make_pool, m)?)?;
    m.add_function(wrap_pyfunction!(make_binning, m)?)?;
    m.add_function(wrap_pyfunction!(make_arena, m)?)?;
    m.add_function(wrap_pyfunction!(make_fixed_size, m)?)?;
    m.add_function(wrap_pyfunction!(make_limiting, m)?)?;
    m.add_function(wrap_pyfunction!(make_statistics, m)?)?;
    m.add_function(wrap_pyfunction!(make_tracking, m)?)?;
    m.add_function(wrap_pyfunction!(make_logging, m)?)?;
    Ok(())
}
