//! The `extern "C"` constructors of the virtual-memory resources, the graph-safe resource and
//! the aligning, prefetching and failure-callback adaptors. Each runs inside the guard of
//! [`crate::ffi`]'s `create` helpers: nothing unwinds into C.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_uint, c_void};

use carve::resource::{Fabric, Granularity};

use crate::error::{FfiError, FfiResult};
use crate::ffi::{carve_resource_t, create, create_over, device, opt};
use crate::make_vm::{ExpandableSizes, VirtualSizes};
use crate::{make_adapt, make_vm};

/// `carve_failure_callback_t`: asked on out-of-memory; non-zero retries the request.
pub type carve_failure_callback_t =
    Option<unsafe extern "C" fn(bytes: usize, user_data: *mut c_void) -> c_int>;

/// Negative headroom picks the default.
fn headroom(h: f64) -> Option<f64> {
    (h >= 0.0 || h.is_nan()).then_some(h)
}

/// `CARVE_VM_EXPORTABLE`: chunks exportable as POSIX file descriptors.
pub const VM_EXPORTABLE: c_uint = 1;
/// `CARVE_VM_FABRIC`: chunks with fabric handles, or `CARVE_ERROR_UNSUPPORTED`.
pub const VM_FABRIC: c_uint = 2;
/// `CARVE_VM_RECOMMENDED_GRANULARITY`: chunks at the driver's recommended granularity.
pub const VM_RECOMMENDED_GRANULARITY: c_uint = 4;
/// `CARVE_VM_FABRIC_WHERE_SUPPORTED`: fabric handles where the device can create them.
pub const VM_FABRIC_WHERE_SUPPORTED: c_uint = 8;

/// The backing options `flags` (of the device virtual-memory constructors) ask for:
/// exportable, fabric handles, granularity.
fn vm_flags(flags: c_uint) -> FfiResult<(bool, Fabric, Granularity)> {
    let known = VM_EXPORTABLE | VM_FABRIC | VM_RECOMMENDED_GRANULARITY | VM_FABRIC_WHERE_SUPPORTED;
    if flags & !known != 0 {
        return Err(FfiError::invalid(format!(
            "unknown virtual-memory flags {flags:#x}"
        )));
    }
    let fabric = match (
        flags & VM_FABRIC != 0,
        flags & VM_FABRIC_WHERE_SUPPORTED != 0,
    ) {
        (true, true) => {
            return Err(FfiError::invalid(
                "CARVE_VM_FABRIC and CARVE_VM_FABRIC_WHERE_SUPPORTED together",
            ))
        }
        (true, false) => Fabric::Required,
        (false, true) => Fabric::WhereSupported,
        (false, false) => Fabric::Off,
    };
    let granularity = if flags & VM_RECOMMENDED_GRANULARITY != 0 {
        Granularity::Recommended
    } else {
        Granularity::Minimum
    };
    Ok((flags & VM_EXPORTABLE != 0, fabric, granularity))
}

fn expandable_sizes(
    maximum: usize,
    small_limit: usize,
    small_chunk: usize,
    large_chunk: usize,
    h: f64,
) -> ExpandableSizes {
    ExpandableSizes {
        maximum: opt(maximum),
        small_limit: opt(small_limit),
        small_chunk: opt(small_chunk),
        large_chunk: opt(large_chunk),
        headroom: headroom(h),
        ..ExpandableSizes::default()
    }
}

/// `carve_expandable_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_expandable_resource_create(
    dev: c_int,
    maximum: usize,
    small_limit: usize,
    small_chunk: usize,
    large_chunk: usize,
    headroom: f64,
    flags: c_uint,
    out: *mut carve_resource_t,
) -> c_int {
    let mut sizes = expandable_sizes(maximum, small_limit, small_chunk, large_chunk, headroom);
    let make = || {
        (sizes.exportable, sizes.fabric, sizes.granularity) = vm_flags(flags)?;
        make_vm::expandable(device(dev)?, &sizes)
    };
    // SAFETY: forwarded caller contract.
    unsafe { create(out, make) }
}

/// `carve_expandable_host_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_expandable_host_resource_create(
    granularity: usize,
    maximum: usize,
    small_limit: usize,
    small_chunk: usize,
    large_chunk: usize,
    headroom: f64,
    out: *mut carve_resource_t,
) -> c_int {
    let sizes = expandable_sizes(maximum, small_limit, small_chunk, large_chunk, headroom);
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make_vm::expandable_host(granularity, &sizes)) }
}

fn virtual_sizes(maximum: usize, chunk_size: usize, reserve: usize) -> VirtualSizes {
    VirtualSizes {
        maximum: opt(maximum),
        chunk_size: opt(chunk_size),
        reserve: opt(reserve),
        ..VirtualSizes::default()
    }
}

/// `carve_virtual_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_virtual_resource_create(
    dev: c_int,
    maximum: usize,
    chunk_size: usize,
    reserve: usize,
    flags: c_uint,
    out: *mut carve_resource_t,
) -> c_int {
    let mut sizes = virtual_sizes(maximum, chunk_size, reserve);
    let make = || {
        (sizes.exportable, sizes.fabric, sizes.granularity) = vm_flags(flags)?;
        make_vm::virtual_memory(device(dev)?, &sizes)
    };
    // SAFETY: forwarded caller contract.
    unsafe { create(out, make) }
}

/// `carve_virtual_host_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_virtual_host_resource_create(
    granularity: usize,
    maximum: usize,
    chunk_size: usize,
    reserve: usize,
    out: *mut carve_resource_t,
) -> c_int {
    let sizes = virtual_sizes(maximum, chunk_size, reserve);
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make_vm::virtual_host(granularity, &sizes)) }
}

/// `carve_graph_safe_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_graph_safe_resource_create(
    upstream: carve_resource_t,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, |u| Ok(make_vm::graph_safe(u))) }
}

/// `carve_aligned_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_aligned_adaptor_create(
    upstream: carve_resource_t,
    alignment: usize,
    threshold: usize,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create_over(upstream, out, |u| {
            make_adapt::aligned(u, alignment, threshold)
        })
    }
}

/// `carve_prefetch_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_prefetch_adaptor_create(
    upstream: carve_resource_t,
    dev: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, |u| make_adapt::prefetch(u, device(dev)?)) }
}

/// A C callback and its user data.
struct CCallback {
    f: unsafe extern "C" fn(usize, *mut c_void) -> c_int,
    user_data: *mut c_void,
}

// SAFETY: carve.h requires the callback to be callable from any thread with its user data.
unsafe impl Send for CCallback {}
// SAFETY: as above; the callback is only called, never mutated.
unsafe impl Sync for CCallback {}

impl CCallback {
    fn call(&self, bytes: usize) -> bool {
        // SAFETY: carve.h's contract: a valid function that takes `user_data`, callable from
        // any thread while the adaptor lives, and that does not unwind.
        unsafe { (self.f)(bytes, self.user_data) != 0 }
    }
}

/// `carve_failure_callback_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable; `callback` must be null or a function callable from any
/// thread with `user_data` for as long as the adaptor lives, that does not unwind.
#[no_mangle]
pub unsafe extern "C" fn carve_failure_callback_adaptor_create(
    upstream: carve_resource_t,
    callback: carve_failure_callback_t,
    user_data: *mut c_void,
    out: *mut carve_resource_t,
) -> c_int {
    let make = |u: &crate::registry::Entry| {
        let f = callback.ok_or_else(|| FfiError::invalid("null failure callback"))?;
        let cb = CCallback { f, user_data };
        Ok(make_adapt::failure_callback(u, move |bytes| cb.call(bytes)))
    };
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, make) }
}
