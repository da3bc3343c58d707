//! carve errors as Python exceptions. The classes live in `carve/_errors.py` (they need
//! multiple inheritance, e.g. `OutOfMemoryError(CarveError, MemoryError)`).

use carve_capi::{Code, FfiError};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

fn class_name(code: Code) -> &'static str {
    match code {
        Code::Ok | Code::Panic => "CarveError",
        Code::InvalidHandle => "InvalidHandleError",
        Code::InvalidArgument => "InvalidArgumentError",
        Code::OutOfMemory => "OutOfMemoryError",
        Code::NoDevice => "NoDeviceError",
        Code::Driver => "DriverError",
        Code::BadPointer => "BadPointerError",
        Code::Unsupported => "UnsupportedError",
        Code::Io => "CarveIOError",
    }
}

/// The Python exception for `e`, with carve's message.
pub fn to_py(e: FfiError) -> PyErr {
    Python::attach(|py| {
        let made = py
            .import("carve._errors")
            .and_then(|m| m.getattr(class_name(e.code)))
            .and_then(|cls| cls.call1((e.message.clone(),)));
        match made {
            Ok(inst) => PyErr::from_value(inst),
            Err(_) => PyRuntimeError::new_err(e.message),
        }
    })
}

/// Runs `f`, catching panics (as `CarveError`), and converts its error.
pub fn guarded<T>(f: impl FnOnce() -> carve_capi::error::FfiResult<T>) -> PyResult<T> {
    carve_capi::error::catch_error(f).map_err(to_py)
}
