//! Constructors of the virtual-memory resources (device or host-backed), the graph-safe
//! resource, and the aligning, prefetching and failure-callback adaptors.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Mutex, PoisonError};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use carve::resource::{Fabric, Granularity};
use carve_capi::make_vm::{ExpandableSizes, VirtualSizes};
use carve_capi::{make_adapt, make_vm};

use crate::resource::{made, Resource};

/// `fabric`: "off", "auto" (where the device can) or "required"; `granularity`: "minimum" or
/// "recommended".
fn nccl_options(fabric: &str, granularity: &str) -> PyResult<(Fabric, Granularity)> {
    let fabric = match fabric {
        "off" => Fabric::Off,
        "auto" => Fabric::WhereSupported,
        "required" => Fabric::Required,
        f => {
            return Err(PyValueError::new_err(format!(
                "fabric {f:?}: False, True or \"auto\""
            )))
        }
    };
    let granularity = match granularity {
        "minimum" => Granularity::Minimum,
        "recommended" => Granularity::Recommended,
        g => {
            return Err(PyValueError::new_err(format!(
                "granularity {g:?}: \"minimum\" or \"recommended\""
            )))
        }
    };
    Ok((fabric, granularity))
}

/// The expandable pool on `device`; `exportable`: chunks can be exported to other processes;
/// `fabric`, `granularity`: see `nccl_options`.
#[pyfunction]
#[pyo3(signature = (device = 0, maximum = None, small_limit = None, small_chunk = None,
    large_chunk = None, headroom = None, exportable = false, fabric = "off",
    granularity = "minimum"))]
#[allow(clippy::too_many_arguments)]
fn make_expandable(
    py: Python<'_>,
    device: usize,
    maximum: Option<usize>,
    small_limit: Option<usize>,
    small_chunk: Option<usize>,
    large_chunk: Option<usize>,
    headroom: Option<f64>,
    exportable: bool,
    fabric: &str,
    granularity: &str,
) -> PyResult<Resource> {
    let (fabric, granularity) = nccl_options(fabric, granularity)?;
    let sizes = ExpandableSizes {
        maximum,
        small_limit,
        small_chunk,
        large_chunk,
        headroom,
        exportable,
        fabric,
        granularity,
    };
    made(py, || make_vm::expandable(device, &sizes))
}

/// The expandable pool over host virtual memory (pages of `granularity` bytes).
#[pyfunction]
#[pyo3(signature = (granularity, maximum, small_limit = None, small_chunk = None,
    large_chunk = None, headroom = None))]
fn make_expandable_host(
    py: Python<'_>,
    granularity: usize,
    maximum: usize,
    small_limit: Option<usize>,
    small_chunk: Option<usize>,
    large_chunk: Option<usize>,
    headroom: Option<f64>,
) -> PyResult<Resource> {
    let sizes = ExpandableSizes {
        maximum: Some(maximum),
        small_limit,
        small_chunk,
        large_chunk,
        headroom,
        ..ExpandableSizes::default()
    };
    made(py, || make_vm::expandable_host(granularity, &sizes))
}

/// Whole-chunk virtual memory on `device`; `exportable`: chunks can be exported to other
/// processes; `fabric`, `granularity`: see `nccl_options`.
#[pyfunction]
#[pyo3(signature = (device = 0, maximum = None, chunk_size = None, reserve = None,
    exportable = false, fabric = "off", granularity = "minimum"))]
#[allow(clippy::too_many_arguments)]
fn make_virtual(
    py: Python<'_>,
    device: usize,
    maximum: Option<usize>,
    chunk_size: Option<usize>,
    reserve: Option<usize>,
    exportable: bool,
    fabric: &str,
    granularity: &str,
) -> PyResult<Resource> {
    let (fabric, granularity) = nccl_options(fabric, granularity)?;
    let sizes = VirtualSizes {
        maximum,
        chunk_size,
        reserve,
        exportable,
        fabric,
        granularity,
    };
    made(py, || make_vm::virtual_memory(device, &sizes))
}

/// Whole-chunk virtual memory over host virtual memory (pages of `granularity` bytes).
#[pyfunction]
#[pyo3(signature = (granularity, maximum, chunk_size = None, reserve = None))]
fn make_virtual_host(
    py: Python<'_>,
    granularity: usize,
    maximum: usize,
    chunk_size: Option<usize>,
    reserve: Option<usize>,
) -> PyResult<Resource> {
    let sizes = VirtualSizes {
        maximum: Some(maximum),
        chunk_size,
        reserve,
        ..VirtualSizes::default()
    };
    made(py, || make_vm::virtual_host(granularity, &sizes))
}

/// Graph-safe allocation over `upstream`.
#[pyfunction]
fn make_graph_safe(py: Python<'_>, upstream: &Resource) -> PyResult<Resource> {
    made(py, || Ok(make_vm::graph_safe(&upstream.entry)))
}

/// Over-aligns requests of `threshold` bytes or more.
#[pyfunction]
#[pyo3(signature = (upstream, alignment, threshold = 0))]
fn make_aligned(
    py: Python<'_>,
    upstream: &Resource,
    alignment: usize,
    threshold: usize,
) -> PyResult<Resource> {
    made(py, || {
        make_adapt::aligned(&upstream.entry, alignment, threshold)
    })
}

/// Prefetches blocks to `device`.
#[pyfunction]
#[pyo3(signature = (upstream, device = 0))]
fn make_prefetch(py: Python<'_>, upstream: &Resource, device: usize) -> PyResult<Resource> {
    made(py, || make_adapt::prefetch(&upstream.entry, device))
}

/// The exception a failure callback raised last, kept for the caller of `allocate`.
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug, Default)]
pub struct CallbackErrors {
    pub(crate) last: Mutex<Option<PyErr>>,
}

#[pymethods]
impl CallbackErrors {
    /// The exception the callback raised last (cleared), or None.
    fn take(&self) -> Option<PyErr> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

/// Calls `callback(nbytes)` with the GIL; an exception (or a panic) is recorded and means "do
/// not retry".
fn ask(callback: &Py<PyAny>, errors: &CallbackErrors, bytes: usize) -> bool {
    let run = || {
        Python::attach(
            |py| match callback.call1(py, (bytes,)).and_then(|r| r.is_truthy(py)) {
                Ok(retry) => retry,
                Err(e) => {
                    *errors.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
                    false
                }
            },
        )
    };
    catch_unwind(AssertUnwindSafe(run)).unwrap_or(false)
}

/// On out-of-memory, calls `callback(nbytes)` and retries while it returns true. Returns the
/// resource and where the callback's exceptions are kept.
#[pyfunction]
fn make_failure_callback(
    py: Python<'_>,
    upstream: &Resource,
    callback: Py<PyAny>,
) -> PyResult<(Resource, Py<CallbackErrors>)> {
    let errors = Py::new(py, CallbackErrors::default())?;
    let kept = errors.clone_ref(py);
    let r = made(py, || {
        Ok(make_adapt::failure_callback(
            &upstream.entry,
            move |bytes| ask(&callback, kept.get(), bytes),
        ))
    })?;
    Ok((r, errors))
}

/// Adds these constructors to the module.
pub fn add_constructors(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CallbackErrors>()?;
    m.add_function(wrap_pyfunction!(make_expandable, m)?)?;
    m.add_function(wrap_pyfunction!(make_expandable_host, m)?)?;
    m.add_function(wrap_pyfunction!(make_virtual, m)?)?;
    m.add_function(wrap_pyfunction!(make_virtual_host, m)?)?;
    m.add_function(wrap_pyfunction!(make_graph_safe, m)?)?;
    m.add_function(wrap_pyfunction!(make_aligned, m)?)?;
    m.add_function(wrap_pyfunction!(make_prefetch, m)?)?;
    m.add_function(wrap_pyfunction!(make_failure_callback, m)?)?;
    Ok(())
}
