//! Stream arguments: a `CUstream` as an int (0 and 1: the legacy default stream, 2: the
//! per-thread default stream), or a stream object: `__cuda_stream__()` (CUDA Python's protocol),
//! or a `cuda_stream` (PyTorch), `ptr` (CuPy) or `handle` (Numba) attribute.
//!
//! A buffer keeps its stream until its free. A stream object is held, so its stream lives that
//! long; a bare int may name a stream that is destroyed before the free, so such a buffer's free
//! does not use it (see `buffer::block`).

use std::thread::ThreadId;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyTuple};

use carve::StreamRef;

use crate::errors::to_py;

/// `CU_STREAM_LEGACY`: the legacy default stream, like 0.
const LEGACY_HANDLE: usize = 1;
/// `CU_STREAM_PER_THREAD`.
const PER_THREAD_HANDLE: usize = 2;

/// What keeps a stream valid until a buffer's free.
#[derive(Debug)]
pub enum Life {
    /// The legacy default stream: valid in every context for the process's life.
    Legacy,
    /// The per-thread default stream of this thread (another thread's is another stream).
    PerThread(ThreadId),
    /// A stream object's handle: the object is held, so the stream is not destroyed.
    Held,
    /// A bare int: nothing says when the stream is destroyed.
    Bare,
}

/// A stream argument, with what keeps it alive.
#[derive(Debug)]
pub struct HeldStream {
    raw: usize,
    life: Life,
    /// The stream object it came from, held until the buffer's free.
    _owner: Option<Py<PyAny>>,
}

impl HeldStream {
    /// The legacy default stream.
    pub const LEGACY: HeldStream = HeldStream {
        raw: 0,
        life: Life::Legacy,
        _owner: None,
    };

    /// Reads a stream argument: an int or a stream object (held).
    pub fn extract(obj: &Bound<'_, PyAny>) -> PyResult<HeldStream> {
        let (raw, owner) = if obj.is_instance_of::<PyInt>() {
            (handle_int(obj)?, None)
        } else {
            (object_handle(obj)?, Some(obj.clone().unbind()))
        };
        let life = match (raw, &owner) {
            (0 | LEGACY_HANDLE, _) => Life::Legacy,
            (PER_THREAD_HANDLE, _) => Life::PerThread(std::thread::current().id()),
            (_, Some(_)) => Life::Held,
            (_, None) => Life::Bare,
        };
        Ok(HeldStream {
            raw,
            life,
            _owner: owner,
        })
    }

    /// The handle as an int (0 for the legacy default stream).
    pub fn raw(&self) -> usize {
        if matches!(self.life, Life::Legacy) {
            0
        } else {
            self.raw
        }
    }

    /// The stream, for the duration of a call made while its argument is alive.
    pub fn for_call(&self) -> StreamRef<'_> {
        // SAFETY: a handle the caller passed for this call; Python keeps the argument (and a
        // stream object the handle came from) alive until the call returns.
        unsafe { StreamRef::from_raw(self.raw() as _) }
    }

    /// The stream as the calling thread can name it at a later time (a free), or None when it
    /// cannot: a bare int that may have been destroyed, or another thread's per-thread stream.
    pub fn later(&self) -> Option<StreamRef<'_>> {
        match &self.life {
            Life::Legacy => Some(StreamRef::DEFAULT),
            Life::PerThread(t) if *t == std::thread::current().id() => Some(StreamRef::PER_THREAD),
            Life::PerThread(_) | Life::Bare => None,
            // SAFETY: the stream object is held by `self`, so its stream is not destroyed.
            Life::Held => Some(unsafe { StreamRef::from_raw(self.raw as _) }),
        }
    }
}

/// A handle given as an int: 0 ..= 2^64-1 (negative values are no stream).
fn handle_int(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    obj.extract::<usize>().map_err(|_| {
        to_py(carve_capi::FfiError::invalid(format!(
            "stream {obj} is not a CUstream handle (an int from 0 to 2**64-1)"
        )))
    })
}

/// The handle of a stream object.
fn object_handle(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    let bad = || {
        PyTypeError::new_err(format!(
            "stream must be an int (a CUstream) or a stream object (__cuda_stream__, \
             .cuda_stream, .ptr or .handle), not {}",
            obj.get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_default()
        ))
    };
    let value = if obj.hasattr("__cuda_stream__")? {
        let t = obj.call_method0("__cuda_stream__")?;
        let t = t.cast::<PyTuple>().map_err(|_| bad())?;
        t.get_item(1)?
    } else if obj.hasattr("cuda_stream")? {
        obj.getattr("cuda_stream")?
    } else if obj.hasattr("ptr")? {
        obj.getattr("ptr")?
    } else if obj.hasattr("handle")? {
        let h = obj.getattr("handle")?;
        if h.hasattr("value")? {
            // Numba: a ctypes c_void_p (None for the null stream).
            let v = h.getattr("value")?;
            if v.is_none() {
                return Ok(0);
            }
            v
        } else {
            h
        }
    } else {
        return Err(bad());
    };
    if !value.is_instance_of::<PyInt>() {
        return Err(bad());
    }
    handle_int(&value)
}
