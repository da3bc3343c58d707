//! A statistics adaptor whose counter scopes Python can push and pop (`rmm.statistics`'s
//! `push_statistics` / `pop_statistics`), over carve's `StatisticsResourceAdaptor`.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve::adaptor::{Counter, StatisticsResourceAdaptor};
use carve::SharedResource;
use carve_capi::registry::Entry;

use crate::errors::to_py;
use crate::resource::Resource;

/// The counter scopes of one statistics adaptor (it shares the adaptor's counters).
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct StatisticsScopes {
    adaptor: StatisticsResourceAdaptor<SharedResource>,
}

fn counts<'py>(
    py: Python<'py>,
    (bytes, allocs): (Counter, Counter),
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("current_bytes", bytes.value)?;
    d.set_item("current_count", allocs.value)?;
    d.set_item("peak_bytes", bytes.peak)?;
    d.set_item("peak_count", allocs.peak)?;
    d.set_item("total_bytes", bytes.total)?;
    d.set_item("total_count", allocs.total)?;
    Ok(d)
}

#[pymethods]
impl StatisticsScopes {
    /// The counters of the innermost scope.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counts(
            py,
            (
                self.adaptor.bytes_counter(),
                self.adaptor.allocations_counter(),
            ),
        )
    }

    /// Opens a scope with zeroed counters; returns the counters of the scope below it.
    fn push<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        counts(py, self.adaptor.push_counters())
    }

    /// Closes the innermost scope and returns its counters (the scope below absorbs them);
    /// `InvalidArgumentError` without a matching push.
    fn pop<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let popped = self.adaptor.pop_counters().map_err(|e| to_py(e.into()))?;
        counts(py, popped)
    }

    /// Open scopes above the base one.
    #[getter]
    fn depth(&self) -> usize {
        self.adaptor.depth()
    }
}

/// A statistics adaptor over `upstream`, and its scopes.
#[pyfunction]
pub fn make_statistics_scoped(upstream: &Resource) -> PyResult<(Resource, StatisticsScopes)> {
    let adaptor = StatisticsResourceAdaptor::new(upstream.entry.resource.clone());
    let entry = Entry::new(c"statistics", Arc::new(adaptor.clone()));
    Ok((Resource::register(entry)?, StatisticsScopes { adaptor }))
}
