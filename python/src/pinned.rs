//! Page-locked host memory for numpy, as PyCUDA's `pagelocked_empty`: a [`PinnedBuffer`]
//! exposed through `__array_interface__`, so the array's `base` is this object, which keeps
//! the memory alive and frees it when collected.

use std::mem::ManuallyDrop;
use std::sync::OnceLock;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use carve::{Device, PinnedBuffer, PinnedFlags, PinnedHostMemoryResource};
use carve_capi::FfiError;

use crate::errors::{guarded, to_py};

/// `CU_MEMHOSTALLOC_PORTABLE`, PyCUDA's `host_alloc_flags.PORTABLE`.
const PORTABLE: u32 = 1;
/// `CU_MEMHOSTALLOC_DEVICEMAP`, PyCUDA's `host_alloc_flags.DEVICEMAP`.
const DEVICEMAP: u32 = 2;
/// `CU_MEMHOSTALLOC_WRITECOMBINED`, PyCUDA's `host_alloc_flags.WRITECOMBINED`.
const WRITECOMBINED: u32 = 4;

/// The device `device` names, or the one whose context is current on this thread (else 0).
fn device_or_current(device: Option<usize>) -> carve::Result<Device> {
    match device {
        Some(d) => Device::get(d),
        None => Device::current(),
    }
}

/// `nbytes` bytes of pinned host memory (zeroed) from `cuMemHostAlloc` with `flags`
/// (`PORTABLE | DEVICEMAP | WRITECOMBINED`), in `device`'s context.
#[pyclass(frozen, weakref, module = "carve._carve")]
#[derive(Debug)]
pub struct PagelockedAllocation {
    /// Taken only by `Drop`. Never empty: a zero-byte request pins one byte, so every
    /// allocation has an address.
    buffer: ManuallyDrop<PinnedBuffer<u8>>,
    nbytes: usize,
    flags: u32,
    /// What `numpy.asarray(self)` returns: shape, typestr and strides (None: C order). Unset,
    /// the bytes as `uint8`.
    layout: OnceLock<ArrayLayout>,
}

/// The array numpy makes of the allocation, so that the allocation itself is the array's
/// `base` (as PyCUDA's `HostAllocation` is), not an intermediate `uint8` view.
#[derive(Debug)]
struct ArrayLayout {
    shape: Vec<usize>,
    typestr: String,
    strides: Option<Vec<usize>>,
}

#[pymethods]
impl PagelockedAllocation {
    #[new]
    #[pyo3(signature = (nbytes, flags = 0, device = None))]
    fn new(py: Python<'_>, nbytes: usize, flags: u32, device: Option<usize>) -> PyResult<Self> {
        if flags & !(PORTABLE | DEVICEMAP | WRITECOMBINED) != 0 {
            return Err(to_py(FfiError::invalid(format!(
                "unknown host_alloc_flags {flags:#x} (PORTABLE=1, DEVICEMAP=2, WRITECOMBINED=4)"
            ))));
        }
        let buffer = py.detach(|| {
            guarded(|| {
                let resource = PinnedHostMemoryResource::new(
                    &device_or_current(device)?,
                    PinnedFlags::from_alloc_bits(flags),
                )?;
                Ok(PinnedBuffer::<u8>::zeroed(&resource, nbytes.max(1))?)
            })
        })?;
        Ok(PagelockedAllocation {
            buffer: ManuallyDrop::new(buffer),
            nbytes,
            flags,
            layout: OnceLock::new(),
        })
    }

    /// Sets what `numpy.asarray(self)` returns: `shape` of items of numpy's `typestr`, each
    /// `itemsize` bytes, in C order or with byte `strides`; once, and it must fit the allocation.
    #[pyo3(signature = (shape, typestr, itemsize, strides = None))]
    fn set_array_layout(
        &self,
        shape: Vec<usize>,
        typestr: String,
        itemsize: usize,
        strides: Option<Vec<usize>>,
    ) -> PyResult<()> {
        let bytes = shape
            .iter()
            .try_fold(itemsize, |n, &d| n.checked_mul(d))
            .filter(|&n| n <= self.nbytes);
        if bytes.is_none() || strides.as_ref().is_some_and(|s| s.len() != shape.len()) {
            return Err(to_py(FfiError::invalid(format!(
                "an array of shape {shape:?} and {itemsize}-byte items does not fit {} bytes",
                self.nbytes
            ))));
        }
        self.layout
            .set(ArrayLayout {
                shape,
                typestr,
                strides,
            })
            .map_err(|_| to_py(FfiError::invalid("the array layout is set once".to_owned())))
    }

    /// The host address.
    #[getter]
    fn ptr(&self) -> usize {
        self.buffer.host_ptr().map_or(0, |p| p.as_ptr() as usize)
    }

    /// The bytes requested.
    #[getter]
    fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// The flags requested (`host_alloc_flags` bits).
    #[getter]
    fn mem_flags(&self) -> u32 {
        self.flags
    }

    /// The ordinal of the device whose context allocated it.
    #[getter]
    fn device(&self) -> usize {
        self.buffer.resource().device().ordinal()
    }

    /// The flags the driver records for this memory (`cuMemHostGetFlags`), as PyCUDA's
    /// `get_flags()`.
    fn get_flags(&self, py: Python<'_>) -> PyResult<u32> {
        let b = &*self.buffer;
        py.detach(|| b.driver_flags())
            .map(PinnedFlags::alloc_bits)
            .map_err(|e| to_py(e.into()))
    }

    /// The address kernels use to reach this memory without a copy
    /// (`cuMemHostGetDevicePointer`); `UnsupportedError` unless allocated with `DEVICEMAP`.
    fn get_device_pointer(&self, py: Python<'_>) -> PyResult<u64> {
        let b = &*self.buffer;
        py.detach(|| b.device_ptr()).map_err(|e| to_py(e.into()))
    }

    /// The array for numpy (`numpy.asarray(self)`): the layout set by `set_array_layout`, else
    /// the bytes as a one-dimensional `uint8` array.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        match self.layout.get() {
            Some(l) => {
                d.set_item("shape", PyTuple::new(py, &l.shape)?)?;
                d.set_item("typestr", l.typestr.as_str())?;
                if let Some(strides) = &l.strides {
                    d.set_item("strides", PyTuple::new(py, strides)?)?;
                }
            }
            None => {
                d.set_item("shape", (self.nbytes,))?;
                d.set_item("typestr", "|u1")?;
            }
        }
        d.set_item("data", (self.ptr(), false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    fn __len__(&self) -> usize {
        self.nbytes
    }

    fn __repr__(&self) -> String {
        format!(
            "<carve.PagelockedAllocation {} bytes at {:#x}, flags {:#x}>",
            self.nbytes,
            self.ptr(),
            self.flags
        )
    }
}

impl Drop for PagelockedAllocation {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used afterwards.
        let buffer = unsafe { ManuallyDrop::take(&mut self.buffer) };
        // The free waits for the device's default stream: without the GIL. A failed free is
        // recorded for `take_deferred_error`.
        Python::attach(|py| py.detach(move || drop(buffer)));
    }
}

/// Adds the page-locked allocation class and its flag values to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HOST_ALLOC_PORTABLE", PORTABLE)?;
    m.add("HOST_ALLOC_DEVICEMAP", DEVICEMAP)?;
    m.add("HOST_ALLOC_WRITECOMBINED", WRITECOMBINED)?;
    m.add_class::<PagelockedAllocation>()?;
    Ok(())
}
