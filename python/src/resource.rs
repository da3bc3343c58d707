//! `carve._carve.Resource`: a registered carve resource, and the functions that build them.
//! The public classes (`carve.PoolResource`, ...) are Python wrappers in `carve/_resources.py`.

use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve::StreamRef;
use carve_capi::registry::{self, Entry, Handle};
use carve_capi::{make, stats, FfiError};

use crate::errors::{guarded, to_py};

/// A carve resource. `handle` is its id in carve's C ABI (e.g. CuPy's allocator parameter).
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct Resource {
    pub(crate) entry: Arc<Entry>,
    handle: Handle,
}

impl Resource {
    /// Registers `entry` under a new handle (forgotten when the Python object goes).
    pub fn register(entry: Arc<Entry>) -> PyResult<Resource> {
        let handle = registry::insert(entry.clone()).map_err(to_py)?;
        Ok(Resource { entry, handle })
    }
}

impl Drop for Resource {
    fn drop(&mut self) {
        let _ = registry::remove(self.handle);
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

/// A stream argument: a `CUstream` as an int (0: the legacy default stream). Python cannot
/// lend a borrow, so the handle is `'static`: every method that takes a stream documents
/// that it must outlive its use (a buffer's, for as long as the buffer lives).
pub fn stream_ref(stream: usize) -> StreamRef<'static> {
    // SAFETY: the caller names a stream that outlives its use (documented on every method).
    unsafe { StreamRef::from_raw(stream as _) }
}

#[pymethods]
impl Resource {
    /// The kind: "cuda", "pool", "statistics", ... ("current" for a resource set from Rust).
    #[getter]
    fn kind(&self) -> &'static str {
        self.entry.kind
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
    /// with CuPy (`cupy.cuda.MemoryAsyncPool(handle)`) or PyTorch's cudaMallocAsync backend.
    #[getter]
    fn pool_handle(&self) -> Option<usize> {
        match &self.entry.typed {
            carve_capi::registry::Typed::Async(a) => Some(a.handle() as usize),
            _ => None,
        }
    }

    /// Allocates `nbytes` aligned to `alignment`, ordered on `stream` (a CUstream as an int,
    /// which must outlive the block); returns the address.
    #[pyo3(signature = (nbytes, alignment = 256, stream = 0))]
    fn allocate(&self, nbytes: usize, alignment: usize, stream: usize) -> PyResult<usize> {
        guarded(|| {
            let p = self
                .entry
                .resource
                .allocate(stream_ref(stream), nbytes, alignment)?;
            Ok(p.as_ptr() as usize)
        })
    }

    /// Frees a block from `allocate(nbytes, alignment)`, ordered on `stream`. Resources that
    /// track their blocks refuse foreign pointers and double frees (`BadPointerError`).
    #[pyo3(signature = (ptr, nbytes, alignment = 256, stream = 0))]
    fn deallocate(
        &self,
        ptr: usize,
        nbytes: usize,
        alignment: usize,
        stream: usize,
    ) -> PyResult<()> {
        guarded(|| {
            let p = NonNull::new(ptr as *mut u8).ok_or_else(|| {
                FfiError::new(
                    carve_capi::Code::BadPointer,
                    "null pointer passed to deallocate",
                )
            })?;
            // SAFETY: the Python API promises what the trait asks: `ptr` came from
            // `allocate(nbytes, alignment)` here and is not used afterwards. Resources that can
            // tell refuse a pointer they do not own instead of trusting it.
            unsafe {
                self.entry
                    .resource
                    .deallocate(stream_ref(stream), p, nbytes, alignment)
            }?;
            Ok(())
        })
    }

    /// The resource's statistics as a dict (empty for resources that keep none).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let all = guarded(|| stats::of(&self.entry))?;
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
    fn release(&self) -> PyResult<usize> {
        guarded(|| make::release(&self.entry))
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
        format!("<carve {} resource {:#x}>", self.entry.kind, self.handle)
    }
}

fn made(r: carve_capi::error::FfiResult<Arc<Entry>>) -> PyResult<Resource> {
    Resource::register(carve_capi::error::catch_error(|| r).map_err(to_py)?)
}

/// `cuMemAlloc` on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn make_cuda(device: usize) -> PyResult<Resource> {
    made(make::cuda(device))
}

/// Managed memory on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
fn make_managed(device: usize) -> PyResult<Resource> {
    made(make::managed(device))
}

/// Pinned host memory.
#[pyfunction]
#[pyo3(signature = (device = 0, portable = false, device_mapped = false, write_combined = false))]
fn make_pinned(
    device: usize,
    portable: bool,
    device_mapped: bool,
    write_combined: bool,
) -> PyResult<Resource> {
    let bit = |on: bool, bit: u32| if on { bit } else { 0 };
    let flags = bit(portable, make::PINNED_PORTABLE)
        | bit(device_mapped, make::PINNED_DEVICE_MAPPED)
        | bit(write_combined, make::PINNED_WRITE_COMBINED);
    made(make::pinned(device, flags))
}

/// A new driver pool on `device`.
#[pyfunction]
#[pyo3(signature = (device = 0, initial_size = 0, release_threshold = None, hard_limit = None))]
fn make_async(
    device: usize,
    initial_size: usize,
    release_threshold: Option<usize>,
    hard_limit: Option<usize>,
) -> PyResult<Resource> {
    made(make::async_pool(
        device,
        initial_size,
        release_threshold,
        hard_limit,
    ))
}

/// Pageable host memory.
#[pyfunction]
fn make_host() -> PyResult<Resource> {
    made(Ok(make::host()))
}

/// A coalescing pool.
#[pyfunction]
#[pyo3(signature = (upstream, initial_size = 0, maximum_size = None))]
fn make_pool(
    upstream: &Resource,
    initial_size: usize,
    maximum_size: Option<usize>,
) -> PyResult<Resource> {
    made(make::pool(&upstream.entry, initial_size, maximum_size))
}

/// Power-of-two bins.
#[pyfunction]
fn make_binning(upstream: &Resource, min_exp: u32, max_exp: u32) -> PyResult<Resource> {
    made(make::binning(&upstream.entry, min_exp, max_exp))
}

/// Per-thread arenas.
#[pyfunction]
#[pyo3(signature = (upstream, superblock_size = 0, arenas = 0, maximum_size = None))]
fn make_arena(
    upstream: &Resource,
    superblock_size: usize,
    arenas: usize,
    maximum_size: Option<usize>,
) -> PyResult<Resource> {
    made(make::arena(
        &upstream.entry,
        superblock_size,
        arenas,
        maximum_size,
    ))
}

/// Fixed-size blocks.
#[pyfunction]
#[pyo3(signature = (upstream, block_size, blocks_per_refill = 0))]
fn make_fixed_size(
    upstream: &Resource,
    block_size: usize,
    blocks_per_refill: u32,
) -> PyResult<Resource> {
    made(make::fixed_size(
        &upstream.entry,
        block_size,
        blocks_per_refill,
    ))
}

/// A byte limit.
#[pyfunction]
fn make_limiting(upstream: &Resource, limit: usize) -> PyResult<Resource> {
    made(Ok(make::limiting(&upstream.entry, limit)))
}

/// Counters.
#[pyfunction]
fn make_statistics(upstream: &Resource) -> PyResult<Resource> {
    made(Ok(make::statistics(&upstream.entry)))
}

/// Outstanding-block tracking.
#[pyfunction]
#[pyo3(signature = (upstream, capture_backtraces = false))]
fn make_tracking(upstream: &Resource, capture_backtraces: bool) -> PyResult<Resource> {
    made(Ok(make::tracking(&upstream.entry, capture_backtraces)))
}

/// RMM's CSV log to a new file.
#[pyfunction]
#[pyo3(signature = (upstream, path, auto_flush = false))]
fn make_logging(upstream: &Resource, path: &str, auto_flush: bool) -> PyResult<Resource> {
    made(make::logging(&upstream.entry, path, auto_flush))
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
