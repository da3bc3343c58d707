//! Sharing virtual-memory chunks between processes: `export_chunk` of a virtual-memory
//! resource gives a POSIX file descriptor; `ImportedChunk` maps it in another process. Both
//! wrap carve's `export_chunk` and `ImportedChunk::import` through `carve_capi::vm_share`.

use std::os::fd::{BorrowedFd, IntoRawFd};
use std::sync::{Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;

use carve::resource::ImportedChunk as Chunk;
use carve_capi::{vm_share, Code, FfiError};

use crate::errors::{guarded, to_py};
use crate::resource::Resource;

/// `(fd, chunk_start, chunk_size)` for the physical chunk holding `ptr`, a live block of
/// `resource` (a virtual or expandable resource created exportable). The descriptor is the
/// caller's to close.
#[pyfunction]
fn vm_export_chunk(
    py: Python<'_>,
    resource: &Resource,
    ptr: usize,
) -> PyResult<(i32, usize, usize)> {
    let entry = &resource.entry;
    let (fd, start, size) = py.detach(|| guarded(|| vm_share::export(entry, ptr)))?;
    Ok((fd.into_raw_fd(), start, size))
}

/// Another process's chunk (from `export_chunk`), mapped read-write on `device` in this
/// process until `close()` (or the end of a `with` block). `fd` stays the caller's.
#[pyclass(frozen, module = "carve._carve")]
#[derive(Debug)]
pub struct ImportedChunk {
    chunk: Mutex<Option<Chunk>>,
    ptr: usize,
    size: usize,
    device: usize,
}

impl ImportedChunk {
    fn held(&self) -> MutexGuard<'_, Option<Chunk>> {
        // Critical sections only take or read the chunk: a poisoned lock holds consistent data.
        self.chunk.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn open(&self) -> PyResult<()> {
        match self.held().is_some() {
            true => Ok(()),
            false => Err(to_py(FfiError::new(
                Code::InvalidHandle,
                "the imported chunk is closed",
            ))),
        }
    }
}

#[pymethods]
impl ImportedChunk {
    #[new]
    #[pyo3(signature = (fd, size, device = 0))]
    fn new(py: Python<'_>, fd: i32, size: usize, device: usize) -> PyResult<Self> {
        if fd < 0 {
            return Err(to_py(FfiError::invalid(format!(
                "ImportedChunk: file descriptor {fd}"
            ))));
        }
        let chunk = py.detach(|| {
            guarded(|| {
                // SAFETY: the borrow lives only for this import, which hands the descriptor to
                // the driver; a descriptor the caller closed makes the driver refuse it.
                let fd = unsafe { BorrowedFd::borrow_raw(fd) };
                vm_share::import(fd, size, device)
            })
        })?;
        Ok(ImportedChunk {
            ptr: chunk.as_ptr().as_ptr() as usize,
            size: chunk.len(),
            device,
            chunk: Mutex::new(Some(chunk)),
        })
    }

    /// The chunk's address in this process (not the exporter's).
    #[getter]
    fn ptr(&self) -> PyResult<usize> {
        self.open()?;
        Ok(self.ptr)
    }

    /// The chunk's size in bytes.
    #[getter]
    fn size(&self) -> usize {
        self.size
    }

    /// The device it is mapped on.
    #[getter]
    fn device(&self) -> usize {
        self.device
    }

    /// Whether `close()` ran.
    #[getter]
    fn closed(&self) -> bool {
        self.held().is_none()
    }

    /// Waits for the device, then unmaps the chunk here (the exporter's mapping stays).
    /// Closing twice does nothing.
    fn close(&self, py: Python<'_>) {
        let taken = self.held().take();
        py.detach(move || drop(taken));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) -> bool {
        self.close(py);
        false
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!(
            "ImportedChunk(ptr={:#x}, size={}, device={}{state})",
            self.ptr, self.size, self.device
        )
    }
}

impl Drop for ImportedChunk {
    fn drop(&mut self) {
        let taken = self.held().take();
        if taken.is_some() {
            // Unmapping waits for the device: without the GIL.
            Python::attach(|py| py.detach(move || drop(taken)));
        }
    }
}

/// Adds chunk sharing to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<ImportedChunk>()?;
    m.add_function(wrap_pyfunction!(vm_export_chunk, m)?)?;
    Ok(())
}
