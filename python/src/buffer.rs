//! `carve.DeviceBuffer`: bytes from a carve resource, shared without a copy through
//! `__cuda_array_interface__` (v3) and DLPack (`__dlpack__`, `__dlpack_device__`).
//!
//! The block is owned by an `Arc<Block>`. The Python object holds one reference and every
//! DLPack capsule handed out holds another, so the block is freed (through its resource, on
//! its stream) when the last of them goes, on whatever thread that happens.

use std::ffi::{c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use pyo3::exceptions::{PyAttributeError, PyBufferError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use carve::resource::DEFAULT_ALIGNMENT;
use carve::{Device, Event, StreamRef};
use carve_capi::registry::Entry;

use crate::errors::guarded;
use crate::resource::{resource_of, stream_ref};

/// DLPack device types (dlpack.h).
const KDL_CPU: i32 = 1;
const KDL_CUDA: i32 = 2;
const KDL_CUDA_MANAGED: i32 = 13;

#[derive(Debug)]
struct Block {
    entry: Arc<Entry>,
    ptr: NonNull<u8>,
    size: usize,
    /// Python's stream, which the caller promised outlives the buffer (see `stream_ref`).
    stream: StreamRef<'static>,
}

// SAFETY: the block is plain memory owned by this value; resources are Send + Sync.
unsafe impl Send for Block {}
// SAFETY: as above; `&Block` exposes only the address.
unsafe impl Sync for Block {}

impl Drop for Block {
    fn drop(&mut self) {
        // SAFETY: allocated from this entry with this size and alignment, freed once (here).
        // A failure cannot be reported from a destructor; the resource keeps its state.
        let _ = unsafe {
            self.entry
                .resource
                .deallocate(self.stream, self.ptr, self.size, DEFAULT_ALIGNMENT)
        };
    }
}

/// `nbytes` bytes from `resource` (default: the current resource of `device`), ordered on
/// `stream` (a CUstream as an int, 0 for the legacy default stream; it must outlive the
/// buffer). Freed through the same resource when the buffer and every DLPack view are gone.
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct DeviceBuffer {
    block: Arc<Block>,
    device: usize,
    resource: Py<PyAny>,
}

#[pymethods]
impl DeviceBuffer {
    #[new]
    #[pyo3(signature = (nbytes, resource = None, *, stream = 0, device = 0))]
    fn new(
        py: Python<'_>,
        nbytes: usize,
        resource: Option<Bound<'_, PyAny>>,
        stream: usize,
        device: usize,
    ) -> PyResult<Self> {
        let (entry, resource) = match resource {
            Some(obj) => (resource_of(&obj)?.entry.clone(), obj.unbind()),
            None => {
                // The package's wrapper, so `buffer.resource` is the object users set.
                let obj = py
                    .import("carve")?
                    .call_method1("get_current_resource", (device,))?;
                (resource_of(&obj)?.entry.clone(), obj.unbind())
            }
        };
        let s = stream_ref(stream);
        let ptr = guarded(|| Ok(entry.resource.allocate(s, nbytes, DEFAULT_ALIGNMENT)?))?;
        Ok(DeviceBuffer {
            block: Arc::new(Block {
                entry,
                ptr,
                size: nbytes,
                stream: s,
            }),
            device,
            resource,
        })
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

    /// The device ordinal it was allocated for.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// The stream it is ordered on (a CUstream as an int).
    #[getter]
    fn stream(&self) -> usize {
        self.block.stream.raw_value()
    }

    /// The resource it came from (and frees through).
    #[getter]
    fn resource(&self, py: Python<'_>) -> Py<PyAny> {
        self.resource.clone_ref(py)
    }

    fn __len__(&self) -> usize {
        self.block.size
    }

    /// CUDA Array Interface v3: a 1-D `uint8` array; `stream` is where the data is ready.
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
        let s = self.block.stream.raw_value();
        d.set_item("stream", if s == 0 { 1 } else { s })?;
        Ok(d)
    }

    /// `(device_type, device_id)` for DLPack.
    fn __dlpack_device__(&self) -> (i32, usize) {
        let p = self.block.entry.resource.properties();
        match (p.device_accessible, p.host_accessible) {
            (true, true) => (KDL_CUDA_MANAGED, self.device),
            (true, false) => (KDL_CUDA, self.device),
            _ => (KDL_CPU, 0),
        }
    }

    /// A DLPack capsule ("dltensor") over the buffer, as a 1-D `uint8` tensor. With a consumer
    /// `stream` other than the buffer's, the consumer's stream waits for the buffer's (an
    /// event), as the DLPack protocol asks.
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__(
        &self,
        py: Python<'_>,
        stream: Option<isize>,
        max_version: Option<Bound<'_, PyTuple>>,
        dl_device: Option<(i32, usize)>,
        copy: Option<bool>,
    ) -> PyResult<Py<PyAny>> {
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
            self.order_for(stream)?;
        }
        // SAFETY: the tensor points into `self.block`, which the capsule keeps alive.
        unsafe { dlpack::capsule(py, self.block.clone(), dev_type, dev_id, versioned) }
    }

    fn __repr__(&self) -> String {
        format!(
            "<carve.DeviceBuffer {} bytes at {:#x} on device {}>",
            self.block.size,
            self.ptr(),
            self.device
        )
    }
}

impl DeviceBuffer {
    /// Makes consumer stream `stream` wait for the buffer's stream (DLPack's rule). -1 means
    /// "no synchronisation"; `None` and 1 the legacy default stream, 2 the per-thread one.
    fn order_for(&self, stream: Option<isize>) -> PyResult<()> {
        let consumer = match stream {
            Some(-1) => return Ok(()),
            None | Some(1) | Some(0) => StreamRef::DEFAULT,
            Some(2) => StreamRef::PER_THREAD,
            Some(s) => stream_ref(s as usize),
        };
        if consumer == self.block.stream {
            return Ok(());
        }
        guarded(|| {
            let dev = Device::get(self.device)?;
            dev.bind()?;
            let ev = Event::new(&dev, false)?;
            ev.record(self.block.stream)?;
            ev.wait_on(consumer)?;
            Ok(())
        })
    }
}

mod dlpack {
    //! The DLPack structs (dlpack.h: the legacy and the 1.0 managed tensors) and the capsule
    //! protocol.

    use super::*;
    use pyo3::ffi;

    #[repr(C)]
    struct DLDevice {
        device_type: i32,
        device_id: i32,
    }

    #[repr(C)]
    struct DLDataType {
        code: u8,
        bits: u8,
        lanes: u16,
    }

    #[repr(C)]
    struct DLTensor {
        data: *mut c_void,
        device: DLDevice,
        ndim: i32,
        dtype: DLDataType,
        shape: *mut i64,
        strides: *mut i64,
        byte_offset: u64,
    }

    #[repr(C)]
    struct DLManagedTensor {
        dl_tensor: DLTensor,
        manager_ctx: *mut c_void,
        deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
    }

    #[repr(C)]
    struct DLPackVersion {
        major: u32,
        minor: u32,
    }

    #[repr(C)]
    struct DLManagedTensorVersioned {
        version: DLPackVersion,
        manager_ctx: *mut c_void,
        deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
        flags: u64,
        dl_tensor: DLTensor,
    }

    /// What `manager_ctx` owns: the block and the shape array the tensor points to.
    struct Context {
        _block: Arc<Block>,
        shape: [i64; 1],
    }

    const NAME: &CStr = c"dltensor";
    const NAME_V1: &CStr = c"dltensor_versioned";

    /// Frees a legacy tensor built by [`capsule`]; called once, by the consumer or by the
    /// capsule's destructor. Never unwinds.
    unsafe extern "C" fn deleter(t: *mut DLManagedTensor) {
        if t.is_null() {
            return;
        }
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: `t` and its context come from `Box::into_raw` in `capsule`, freed once.
            unsafe {
                let t = Box::from_raw(t);
                drop(Box::from_raw(t.manager_ctx.cast::<Context>()));
            }
        });
    }

    /// As [`deleter`], for the 1.0 tensor.
    unsafe extern "C" fn deleter_v1(t: *mut DLManagedTensorVersioned) {
        if t.is_null() {
            return;
        }
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: as in `deleter`.
            unsafe {
                let t = Box::from_raw(t);
                drop(Box::from_raw(t.manager_ctx.cast::<Context>()));
            }
        });
    }

    /// The capsule's destructor: frees the tensor only if no consumer renamed (took) it.
    unsafe extern "C" fn capsule_destructor(capsule: *mut ffi::PyObject) {
        // SAFETY: called by Python with the GIL held, on a capsule made by `capsule`. A name
        // other than ours means a consumer took the tensor and owns its deleter call.
        unsafe {
            if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
                deleter(ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()).cast());
            } else if ffi::PyCapsule_IsValid(capsule, NAME_V1.as_ptr()) == 1 {
                deleter_v1(ffi::PyCapsule_GetPointer(capsule, NAME_V1.as_ptr()).cast());
            }
            // IsValid sets no error, but clear defensively: destructors must not leave one.
            if !ffi::PyErr_Occurred().is_null() {
                ffi::PyErr_Clear();
            }
        }
    }

    /// A capsule for `block` as a 1-D `uint8` tensor: "dltensor_versioned" (1.0, writable) when
    /// `versioned`, else the legacy "dltensor".
    ///
    /// # Safety
    /// `block` must describe live memory on the given device.
    pub(super) unsafe fn capsule(
        py: Python<'_>,
        block: Arc<Block>,
        dev_type: i32,
        dev_id: usize,
        versioned: bool,
    ) -> PyResult<Py<PyAny>> {
        let data = block.ptr.as_ptr().cast::<c_void>();
        let mut ctx = Box::new(Context {
            shape: [block.size as i64],
            _block: block,
        });
        let shape = ctx.shape.as_mut_ptr();
        let ctx = Box::into_raw(ctx).cast::<c_void>();
        let tensor = DLTensor {
            data,
            device: DLDevice {
                device_type: dev_type,
                device_id: dev_id as i32,
            },
            ndim: 1,
            dtype: DLDataType {
                code: 1, // kDLUInt
                bits: 8,
                lanes: 1,
            },
            shape,
            strides: std::ptr::null_mut(),
            byte_offset: 0,
        };
        let (ptr, name, free): (*mut c_void, &CStr, Box<dyn Fn()>) = if versioned {
            let t = Box::into_raw(Box::new(DLManagedTensorVersioned {
                version: DLPackVersion { major: 1, minor: 0 },
                manager_ctx: ctx,
                deleter: Some(deleter_v1),
                flags: 0,
                dl_tensor: tensor,
            }));
            // SAFETY: frees `t` only on the error path below, where nothing else owns it.
            (
                t.cast(),
                NAME_V1,
                Box::new(move || unsafe { deleter_v1(t) }),
            )
        } else {
            let t = Box::into_raw(Box::new(DLManagedTensor {
                dl_tensor: tensor,
                manager_ctx: ctx,
                deleter: Some(deleter),
            }));
            // SAFETY: as above.
            (t.cast(), NAME, Box::new(move || unsafe { deleter(t) }))
        };
        // SAFETY: `ptr` is valid and freed once (by the consumer or our destructor); the name
        // is a static C string.
        let raw = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(capsule_destructor)) };
        if raw.is_null() {
            free();
            return Err(PyErr::fetch(py));
        }
        // SAFETY: `raw` is a new reference we own.
        Ok(unsafe { Bound::from_owned_ptr(py, raw) }.unbind())
    }
}
