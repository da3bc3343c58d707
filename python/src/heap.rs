//! `carve.DeviceHeap`: a region from any device-accessible resource that kernels allocate from
//! (`carve_slab_alloc` / `carve_bump_alloc`, or their `carve_numba_*` forms, linked from
//! `carve.ptx_path()`).

use std::mem::ManuallyDrop;
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve::heap::HeapKind;
use carve::Device;

use crate::errors::guarded;
use crate::resource::resource_of;

/// A device heap. Build it with `DeviceHeap.slab(...)` or `DeviceHeap.bump(...)`; pass
/// `address` to kernels as a `uint64`.
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct DeviceHeap {
    /// Taken only by `Drop`.
    heap: ManuallyDrop<Mutex<carve::DeviceHeap>>,
    address: u64,
}

impl Drop for DeviceHeap {
    fn drop(&mut self) {
        // SAFETY: taken once, here; the field is not used afterwards.
        let heap = unsafe { ManuallyDrop::take(&mut self.heap) };
        // Freeing the region may wait for the device.
        Python::attach(|py| py.detach(move || drop(heap)));
    }
}

impl DeviceHeap {
    /// Called only with the GIL released: a thread that waits for the lock must not hold the
    /// GIL that the lock's holder needs to return.
    fn lock(&self) -> std::sync::MutexGuard<'_, carve::DeviceHeap> {
        self.heap.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl DeviceHeap {
    /// A slab of `capacity` blocks of `block_size` bytes (a multiple of 16) from `resource`,
    /// ordered on `device`'s default stream.
    #[staticmethod]
    #[pyo3(signature = (resource, capacity, block_size, *, device = 0))]
    fn slab(
        py: Python<'_>,
        resource: &Bound<'_, PyAny>,
        capacity: u64,
        block_size: u64,
        device: usize,
    ) -> PyResult<Self> {
        let r = resource_of(resource)?.entry.resource.clone();
        let heap = py.detach(|| {
            guarded(|| {
                let dev = Device::get(device)?;
                Ok(carve::DeviceHeap::slab(
                    r,
                    &dev.default_stream(),
                    capacity,
                    block_size,
                )?)
            })
        })?;
        let address = heap.device_ptr();
        Ok(DeviceHeap {
            heap: ManuallyDrop::new(Mutex::new(heap)),
            address,
        })
    }

    /// A bump arena of `capacity` bytes from `resource`.
    #[staticmethod]
    #[pyo3(signature = (resource, capacity, *, device = 0))]
    fn bump(
        py: Python<'_>,
        resource: &Bound<'_, PyAny>,
        capacity: u64,
        device: usize,
    ) -> PyResult<Self> {
        let r = resource_of(resource)?.entry.resource.clone();
        let heap = py.detach(|| {
            guarded(|| {
                let dev = Device::get(device)?;
                Ok(carve::DeviceHeap::bump(r, &dev.default_stream(), capacity)?)
            })
        })?;
        let address = heap.device_ptr();
        Ok(DeviceHeap {
            heap: ManuallyDrop::new(Mutex::new(heap)),
            address,
        })
    }

    /// The device address to pass to kernels.
    #[getter]
    fn address(&self) -> u64 {
        self.address
    }

    /// "slab" or "bump".
    #[getter]
    fn kind(&self, py: Python<'_>) -> &'static str {
        match py.detach(|| self.lock().kind()) {
            HeapKind::Slab { .. } => "slab",
            HeapKind::Bump => "bump",
            HeapKind::General { .. } => "general",
        }
    }

    /// Blocks (slab) or bytes (bump) over all segments.
    #[getter]
    fn capacity(&self, py: Python<'_>) -> u64 {
        py.detach(|| self.lock().capacity())
    }

    /// Reads the statistics back (waits for the heap's stream): capacity, in_use, high_water,
    /// failed_allocs, double_frees, foreign_frees.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| guarded(|| Ok(self.lock().stats()?)))?;
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("high_water", s.high_water)?;
        d.set_item("failed_allocs", s.failed_allocs)?;
        d.set_item("double_frees", s.double_frees)?;
        d.set_item("foreign_frees", s.foreign_frees)?;
        Ok(d)
    }

    /// Forgets every allocation (and the statistics). No kernel may be using the heap.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| guarded(|| Ok(self.lock().reset()?)))
    }

    /// Adds `capacity` more blocks (slab) or bytes (bump). No kernel may be using the heap.
    fn grow(&self, py: Python<'_>, capacity: u64) -> PyResult<()> {
        py.detach(|| guarded(|| Ok(self.lock().grow(capacity)?)))
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "<carve.DeviceHeap {} at {:#x}>",
            self.kind(py),
            self.address
        )
    }
}
