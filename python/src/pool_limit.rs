//! The pool behind `carve.PoolResource`: a coalescing pool whose upstream sits behind a
//! [`LimitingResourceAdaptor`], so that CuPy's `set_limit`/`get_limit` bound the bytes the pool
//! holds (CuPy's `total_bytes()`), and the counters CuPy's pool methods read.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve::adaptor::{LimitBudget, LimitingResourceAdaptor};
use carve::resource::{PoolMemoryResource, PoolOptions, DEFAULT_ALIGNMENT};
use carve_capi::registry::Entry;

use crate::errors::{guarded, to_py};
use crate::resource::Resource;

/// The byte limit on what a pool takes from its upstream.
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct PoolLimit {
    budget: LimitBudget,
    device: Option<usize>,
}

#[pymethods]
impl PoolLimit {
    /// The limit in bytes; None when unlimited.
    #[getter]
    fn limit(&self) -> Option<usize> {
        Some(self.budget.limit()).filter(|&l| l != usize::MAX)
    }

    /// Changes the limit (None: unlimited). Memory the pool already holds stays; growth past the
    /// limit fails.
    #[pyo3(signature = (limit))]
    fn set_limit(&self, limit: Option<usize>) {
        self.budget.set_limit(limit.unwrap_or(usize::MAX));
    }

    /// Bytes the pool holds from its upstream, as counted against the limit.
    #[getter]
    fn held_bytes(&self) -> usize {
        self.budget.allocated_bytes()
    }

    /// The ordinal of the device whose memory the pool holds; None for host memory.
    #[getter]
    fn device(&self) -> Option<usize> {
        self.device
    }
}

/// A pool over `upstream` whose growth counts against a limit (none until set); returns the
/// pool and its limit.
#[pyfunction]
#[pyo3(signature = (upstream, initial_size = 0, maximum_size = None))]
fn make_limited_pool(
    py: Python<'_>,
    upstream: &Resource,
    initial_size: usize,
    maximum_size: Option<usize>,
) -> PyResult<(Resource, PoolLimit)> {
    let upstream = upstream.entry.resource.clone();
    let (entry, budget, device) = py.detach(|| {
        guarded(|| {
            let budget = LimitBudget::new(usize::MAX, DEFAULT_ALIGNMENT)?;
            let device = upstream.device().map(|d| d.ordinal());
            let limited = LimitingResourceAdaptor::with_budget(upstream, budget.clone());
            let mut options = PoolOptions::new(initial_size);
            options.maximum_size = maximum_size;
            let pool = PoolMemoryResource::new(limited, options)?;
            Ok((Entry::new(c"pool", Arc::new(pool)), budget, device))
        })
    })?;
    Ok((Resource::register(entry)?, PoolLimit { budget, device }))
}

/// The counters every resource reports through `MemoryResource::memory_stats`, as a dict with
/// `bytes_in_use`, `bytes_reserved`, `peak_bytes` and `live_blocks` (None where the resource
/// does not keep one); None for resources that keep no counters.
#[pyfunction]
fn memory_stats<'py>(py: Python<'py>, resource: &Resource) -> PyResult<Option<Bound<'py, PyDict>>> {
    let entry = Arc::clone(&resource.entry);
    let stats = py
        .detach(|| entry.resource.memory_stats())
        .map_err(|e| to_py(e.into()))?;
    let Some(s) = stats else {
        return Ok(None);
    };
    let d = PyDict::new(py);
    d.set_item("bytes_in_use", s.bytes_in_use)?;
    d.set_item("bytes_reserved", s.bytes_reserved)?;
    d.set_item("peak_bytes", s.peak_bytes)?;
    d.set_item("live_blocks", s.live_blocks)?;
    Ok(Some(d))
}

/// Adds the pool-limit class and functions to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PoolLimit>()?;
    m.add_function(wrap_pyfunction!(make_limited_pool, m)?)?;
    m.add_function(wrap_pyfunction!(memory_stats, m)?)?;
    Ok(())
}
