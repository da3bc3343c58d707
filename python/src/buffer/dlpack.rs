//! The DLPack structs (dlpack.h: the legacy and the 1.0 managed tensors) and the capsule
//! protocol.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;

use super::block::Block;

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
    let (tensor, versioned) = unsafe {
        let found = if ffi::PyCapsule_IsValid(capsule, NAME.as_ptr()) == 1 {
            (ffi::PyCapsule_GetPointer(capsule, NAME.as_ptr()), false)
        } else if ffi::PyCapsule_IsValid(capsule, NAME_V1.as_ptr()) == 1 {
            (ffi::PyCapsule_GetPointer(capsule, NAME_V1.as_ptr()), true)
        } else {
            (std::ptr::null_mut(), false)
        };
        // IsValid sets no error, but clear defensively: destructors must not leave one.
        if !ffi::PyErr_Occurred().is_null() {
            ffi::PyErr_Clear();
        }
        found
    };
    if tensor.is_null() {
        return;
    }
    let tensor = tensor as usize;
    // SAFETY: Python holds the GIL while it runs a capsule's destructor.
    let py = unsafe { Python::assume_attached() };
    // The free may wait for the device: other Python threads run meanwhile.
    py.detach(move || {
        // SAFETY: the capsule's own tensor, not taken by a consumer, so deleted once (here).
        unsafe {
            if versioned {
                deleter_v1(tensor as *mut DLManagedTensorVersioned);
            } else {
                deleter(tensor as *mut DLManagedTensor);
            }
        }
    });
}

/// A capsule for `block` as a 1-D `uint8` tensor: "dltensor_versioned" (1.0, writable) when
/// `versioned`, else the legacy "dltensor".
///
/// # Safety
/// `block` must describe live memory on the given device.
pub unsafe fn capsule(
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
