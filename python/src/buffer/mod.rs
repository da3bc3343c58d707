//! `carve.DeviceBuffer`: bytes from a carve resource, shared without a copy through
//! `__cuda_array_interface__` (v3) and DLPack (`__dlpack__`, `__dlpack_device__`).
//!
//! The block is owned by an `Arc<Block>`. The Python object holds one reference and every
//! DLPack capsule handed out holds another, so the block is freed (through its resource, on
//! its stream, after its consumers' work: see [`block`]) when the last of them goes, on
//! whatever thread that happens.

mod block;
mod copy;
mod dlpack;

use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::{
    PyAttributeError, PyBufferError, PyRuntimeError, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PySlice, PyTuple};

use carve::resource::DEFAULT_ALIGNMENT;
use carve::{Device, Event, StreamRef};

use self::block::{Block, Consumer};
use crate::errors::guarded;
use crate::resource::resource_of;
use crate::stream::HeldStream;

/// DLPack device types (dlpack.h).
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_MANAGED: i32 = 13;

/// `nbytes` bytes from `resource` (default: the current resource of `device`), ordered on
/// `stream`: a CUstream as an int (0: the legacy default stream) or a stream object, which the
/// buffer holds until its free. Freed through the same resource when the buffer and every
/// DLPack view are gone, after the work its consumers queued (see [`block`]).
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct DeviceBuffer {
    /// Taken only by `Drop`.
    block: ManuallyDrop<Arc<Block>>,
    resource: Py<PyAny>,
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used afterwards.
        let block = unsafe { ManuallyDrop::take(&mut self.block) };
        // The free may wait for the device: other Python threads run meanwhile.
        Python::attach(|py| py.detach(move || drop(block)));
    }
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    #[pyo3(signature = (nbytes = None, resource = None, *, size = None, stream = None, mr = None, device = 0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        nbytes: Option<usize>,
        resource: Option<Bound<'_, PyAny>>,
        size: Option<usize>,
        stream: Option<Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyAny>>,
        device: usize,
    ) -> PyResult<Self> {
        let nbytes = match (nbytes, size) {
            (Some(_), Some(_)) => {
                return Err(PyTypeError::new_err(
                    "DeviceBuffer: give the size once (nbytes or size=)",
                ))
            }
            (n, s) => n.or(s).unwrap_or(0),
        };
        Self::allocate(py, nbytes, one_resource(resource, mr)?, stream, device)
    }

    /// A new buffer holding a copy of `host` (bytes, or any object with the buffer protocol,
    /// such as a numpy array, copied as its bytes in C order), allocated from `mr` (default:
    /// the current resource of `device`) and copied on `stream`, which the buffer keeps.
    #[staticmethod]
    #[pyo3(signature = (host, stream = None, mr = None, *, device = 0))]
    fn to_device(
        py: Python<'_>,
        host: Bound<'_, PyAny>,
        stream: Option<Bound<'_, PyAny>>,
        mr: Option<Bound<'_, PyAny>>,
        device: usize,
    ) -> PyResult<Self> {
        let data = host_bytes(&host)?;
        let buf = Self::allocate(py, data.as_bytes().len(), mr, stream, device)?;
        buf.copy_from_host(py, data.as_any(), None)?;
        Ok(buf)
    }

    /// Copies `host` (as [`to_device`](Self::to_device) reads it) to the start of the buffer,
    /// on `stream` (default: the buffer's), and waits for the copy.
    #[pyo3(signature = (host, stream = None))]
    fn copy_from_host(
        &self,
        py: Python<'_>,
        host: &Bound<'_, PyAny>,
        stream: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let data = host_bytes(host)?;
        let src = data.as_bytes();
        let held = stream.map(|s| HeldStream::extract(&s)).transpose()?;
        let block = &**self.block;
        py.detach(|| {
            let on = held
                .as_ref()
                .map_or(block.stream.for_call(), HeldStream::for_call);
            guarded(|| Ok(copy::host_to_block(block, src, on)?))
        })
    }

    /// The buffer's bytes, copied on `stream` (default: the buffer's) after the work queued
    /// there.
    #[pyo3(signature = (stream = None))]
    fn tobytes<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let held = stream.map(|s| HeldStream::extract(&s)).transpose()?;
        let block = &**self.block;
        PyBytes::new_with(py, block.size, |dst| {
            py.detach(|| {
                let on = held
                    .as_ref()
                    .map_or(block.stream.for_call(), HeldStream::for_call);
                guarded(|| Ok(copy::block_to_host(block, dst, on)?))
            })
        })
    }

    /// Copies the buffer to the host: into `out` (any writable C-contiguous buffer of at least
    /// `size` bytes), returned; without `out`, into a new numpy `uint8` array (a `bytearray`
    /// when numpy is missing). On `stream` (default: the buffer's).
    #[pyo3(signature = (out = None, stream = None))]
    fn copy_to_host<'py>(
        &self,
        py: Python<'py>,
        out: Option<Bound<'py, PyAny>>,
        stream: Option<Bound<'py, PyAny>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let n = self.block.size;
        let Some(out) = out else {
            let held = stream.map(|s| HeldStream::extract(&s)).transpose()?;
            let block = &**self.block;
            // A new bytearray that no other thread can reach until it is returned.
            let array = PyByteArray::new_with(py, n, |dst| {
                py.detach(|| {
                    let on = held
                        .as_ref()
                        .map_or(block.stream.for_call(), HeldStream::for_call);
                    guarded(|| Ok(copy::block_to_host(block, dst, on)?))
                })
            })?;
            return match py.import("numpy") {
                Ok(np) => np.call_method1("frombuffer", (array, "uint8")),
                Err(_) => Ok(array.into_any()),
            };
        };
        let view = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((&out,))?
            .call_method1("cast", ("B",))?;
        let room = view.len()?;
        if room < n {
            return Err(PyValueError::new_err(format!(
                "copy_to_host: `out` has {room} bytes; the buffer has {n}"
            )));
        }
        let data = self.tobytes(py, stream)?;
        view.set_item(PySlice::new(py, 0, n as isize, 1), data)?;
        Ok(out)
    }

    /// The block's address.
    #[getter]
    fn ptr(&self) -> usize {
        self.block.ptr.as_ptr() as usize
    }

    /// Its size in bytes.
    #[getter]
    fn nbytes(&self) -> usize {
        self.block.size
    }

    /// Its size in bytes (RMM's name).
    #[getter]
    fn size(&self) -> usize {
        self.block.size
    }

    /// The device ordinal it was allocated for.
    #[getter]
    fn device(&self) -> usize {
        self.block.device
    }

    /// The stream it is ordered on (a CUstream as an int; 0: the legacy default stream).
    #[getter]
    fn stream(&self) -> usize {
        self.block.stream.raw()
    }

    /// The resource it came from (and frees through).
    #[getter]
    fn resource(&self, py: Python<'_>) -> Py<PyAny> {
        self.resource.clone_ref(py)
    }

    fn __len__(&self) -> usize {
        self.block.size
    }

    /// CUDA Array Interface v3: a 1-D `uint8` array; `stream` is where the data is ready. The
    /// interface does not say which stream the consumer uses, so from now on the buffer's free
    /// waits for the whole device.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        if !self.block.entry.resource.properties().device_accessible {
            return Err(PyAttributeError::new_err(
                "__cuda_array_interface__: this buffer's memory is not device-accessible",
            ));
        }
        let d = PyDict::new(py);
        d.set_item("shape", (self.block.size,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr(), false))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        // v3: 1 names the legacy default stream (0 is not allowed).
        let s = self.block.stream.raw();
        d.set_item("stream", if s == 0 { 1 } else { s })?;
        self.block.used_on(Consumer::Unknown);
        Ok(d)
    }

    /// `(device_type, device_id)` for DLPack.
    fn __dlpack_device__(&self) -> (i32, usize) {
        let p = self.block.entry.resource.properties();
        match (p.device_accessible, p.host_accessible) {
            (true, true) => (KDL_CUDA_MANAGED, self.block.device),
            (true, false) => (KDL_CUDA, self.block.device),
            _ => (KDL_CPU, 0),
        }
    }

    /// A DLPack capsule ("dltensor") over the buffer, as a 1-D `uint8` tensor. With a consumer
    /// `stream` other than the buffer's, the consumer's stream waits for the buffer's (an
    /// event), as the DLPack protocol asks, and the buffer's free waits for the consumer's.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<isize>,
        max_version: Option<Bound<'_, PyTuple>>,
        dl_device: Option<(i32, usize)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
        if matches!(stream, Some(s) if s < -1) {
            return Err(crate::errors::to_py(carve_capi::FfiError::invalid(
                format!(
                    "__dlpack__: stream {} is not a stream (-1, None or a CUstream handle)",
                    stream.unwrap_or_default()
                ),
            )));
        }
        // DLPack 1.0 ("dltensor_versioned") when the consumer accepts it: legacy capsules
        // carry no read-only flag, so consumers such as NumPy import them read-only.
        let versioned = match max_version {
            Some(v) => v.get_item(0)?.extract::<u32>()? >= 1,
            None => false,
        };
        let (dev_type, dev_id) = self.__dlpack_device__();
        if let Some(d) = dl_device {
            if d != (dev_type, dev_id) {
                return Err(PyBufferError::new_err(format!(
                    "__dlpack__: the buffer is on device {:?}, not {d:?}",
                    (dev_type, dev_id)
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "__dlpack__: carve buffers are shared, not copied",
            ));
        }
        if dev_type != KDL_CPU {
            py.detach(|| self.order_for(stream))?;
            let consumer = match stream {
                // -1: the consumer orders itself after the buffer, on a stream it does not name.
                Some(-1) => Consumer::Unknown,
                s => self.block.consumer_of(s),
            };
            self.block.used_on(consumer);
        }
        // SAFETY: the tensor points into `self.block`, which the capsule keeps alive.
        unsafe { dlpack::capsule(py, Arc::clone(&self.block), dev_type, dev_id, versioned) }
    }

    fn __repr__(&self) -> String {
        format!(
            "<carve.DeviceBuffer {} bytes at {:#x} on device {}>",
            self.block.size,
            self.ptr(),
            self.block.device
        )
    }
}

impl DeviceBuffer {
    /// `nbytes` bytes from `resource` (default: the current resource of `device`) on `stream`.
    fn allocate(
        py: Python<'_>,
        nbytes: usize,
        resource: Option<Bound<'_, PyAny>>,
        stream: Option<Bound<'_, PyAny>>,
        device: usize,
    ) -> PyResult<Self> {
        let (entry, resource) = match resource {
            Some(obj) => (Arc::clone(&resource_of(&obj)?.entry), obj.unbind()),
            None => {
                // The package's wrapper, so `buffer.resource` is the object users set.
                let obj = py
                    .import("carve")?
                    .call_method1("get_current_resource", (device,))?;
                (Arc::clone(&resource_of(&obj)?.entry), obj.unbind())
            }
        };
        let stream = match stream {
            Some(s) => HeldStream::extract(&s)?,
            None => HeldStream::LEGACY,
        };
        let addr = py.detach(|| {
            guarded(|| {
                let p = entry
                    .resource
                    .allocate(stream.for_call(), nbytes, DEFAULT_ALIGNMENT)?;
                Ok(p.as_ptr() as usize)
            })
        })?;
        let ptr = NonNull::new(addr as *mut u8)
            .ok_or_else(|| PyRuntimeError::new_err("carve: the resource returned null"))?;
        Ok(DeviceBuffer {
            block: ManuallyDrop::new(Arc::new(Block::new(entry, ptr, nbytes, device, stream))),
            resource,
        })
    }

    /// Makes consumer stream `stream` wait for the buffer's stream (DLPack's rule). -1 means
    /// "no synchronisation"; `None` and 1 the legacy default stream, 2 the per-thread one.
    fn order_for(&self, stream: Option<isize>) -> PyResult<()> {
        let consumer = match stream {
            Some(-1) => return Ok(()),
            None | Some(1) | Some(0) => StreamRef::DEFAULT,
            Some(2) => StreamRef::PER_THREAD,
            // SAFETY: the consumer passes a stream that is valid for this call.
            Some(s) => unsafe { StreamRef::from_raw(s as usize as _) },
        };
        guarded(|| {
            let dev = Device::get(self.block.device)?;
            dev.bind()?;
            match self.block.stream.later() {
                Some(producer) if producer == consumer => {}
                Some(producer) => {
                    let ev = Event::new(&dev, false)?;
                    ev.record(producer)?;
                    ev.wait_on(consumer)?;
                }
                // A bare handle, or another thread's per-thread stream: not nameable here.
                None => dev.synchronize()?,
            }
            Ok(())
        })
    }
}

/// The resource given as `resource` or RMM's `mr` (not both).
fn one_resource<'py>(
    resource: Option<Bound<'py, PyAny>>,
    mr: Option<Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    match (resource, mr) {
        (Some(_), Some(_)) => Err(PyTypeError::new_err(
            "DeviceBuffer: give the resource once (resource or mr=)",
        )),
        (r, m) => Ok(r.or(m)),
    }
}

/// `host`'s bytes: itself when it is `bytes`, else its buffer's bytes in C order (TypeError
/// for an object without the buffer protocol).
fn host_bytes<'py>(host: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
    if let Ok(b) = host.cast::<PyBytes>() {
        return Ok(b.clone());
    }
    let py = host.py();
    Ok(py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((host,))?
        .call_method0("tobytes")?
        .cast_into::<PyBytes>()?)
}
