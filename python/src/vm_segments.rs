//! `vm_set_segment_callback`: a Python callable told of every chunk a virtual-memory resource
//! maps and unmaps, `callback(ptr, size, mapped)`, with the GIL held. Exceptions (and panics)
//! are kept for the caller, never raised into carve.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, PoisonError};

use pyo3::prelude::*;

use carve::resource::{SegmentCallback, SegmentChange, SegmentEvent};
use carve_capi::vm_segments;

use crate::errors::guarded;
use crate::resource::Resource;
use crate::resource_vm::CallbackErrors;

/// Calls `callback(ptr, size, mapped)` with the GIL; keeps the last exception in `errors`.
fn tell(callback: &Py<PyAny>, errors: &CallbackErrors, e: SegmentEvent) {
    let run = || {
        Python::attach(|py| {
            let mapped = e.change == SegmentChange::Mapped;
            if let Err(err) = callback.call1(py, (e.addr, e.size, mapped)) {
                *errors.last.lock().unwrap_or_else(PoisonError::into_inner) = Some(err);
            }
        })
    };
    // A panic here (none expected) is caught by carve's delivery loop too; catching it here
    // keeps the GIL state PyO3's to restore.
    let _ = catch_unwind(AssertUnwindSafe(run));
}

/// Sets `callback` (None removes it) on the virtual-memory resource `resource`; returns where
/// its exceptions are kept.
#[pyfunction]
#[pyo3(signature = (resource, callback = None))]
fn vm_set_segment_callback(
    py: Python<'_>,
    resource: &Resource,
    callback: Option<Py<PyAny>>,
) -> PyResult<Py<CallbackErrors>> {
    let errors = Py::new(py, CallbackErrors::default())?;
    let kept = errors.clone_ref(py);
    let cb = callback
        .map(|f| Arc::new(move |e: SegmentEvent| tell(&f, kept.get(), e)) as SegmentCallback);
    let entry = &resource.entry;
    // Without the GIL: the new callback first hears of the chunks mapped now, and takes it.
    py.detach(|| guarded(|| vm_segments::set(entry, cb)))?;
    Ok(errors)
}

/// Adds `vm_set_segment_callback` to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(vm_set_segment_callback, m)?)
}
