//! Page-locked host memory for numpy, as PyCUDA's `pagelocked_empty`: a [`PinnedBuffer`]
//! exposed through `__array_interface__`, so the array's `base` is this object, which keeps
//! the memory alive and frees it when collected. Also `mem_get_info`.

use std::mem::ManuallyDrop;

use pyo3::prelude::*;
use pyo3::types::PyDict;

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
        })
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

    /// The bytes as a one-dimensional `uint8` array for numpy (`numpy.asarray(self)`).
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.nbytes,))?;
        d.set_item("typestr", "|u1")?;
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

/// `(free, total)` bytes of `device` (None: the device whose context is current on this
/// thread, else 0), as PyCUDA's and CuPy's `mem_get_info`.
#[pyfunction]
#[pyo3(signature = (device = None))]
fn mem_get_info(py: Python<'_>, device: Option<usize>) -> PyResult<(usize, usize)> {
    let m = py
        .detach(|| device_or_current(device)?.mem_info())
        .map_err(|e| to_py(e.into()))?;
    Ok((m.free, m.total))
}

/// Adds the page-locked allocation class, its flag values and `mem_get_info` to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("HOST_ALLOC_PORTABLE", PORTABLE)?;
    m.add("HOST_ALLOC_DEVICEMAP", DEVICEMAP)?;
    m.add("HOST_ALLOC_WRITECOMBINED", WRITECOMBINED)?;
    m.add_class::<PagelockedAllocation>()?;
    m.add_function(wrap_pyfunction!(mem_get_info, m)?)?;
    Ok(())
}
