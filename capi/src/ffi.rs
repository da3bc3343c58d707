//! The `extern "C"` functions of `include/carve.h` (resources, allocation, statistics, the
//! current resource, errors). Each body runs inside [`guard`], so nothing unwinds into C, and
//! returns a `CARVE_ERROR_*` code with the message in `carve_last_error()`.
//!
//! Functions that write or read through a pointer the caller passes, or hand a stream to the
//! driver, are `unsafe`, with their contract under "Safety". Those that take only handles and
//! values are safe: a handle is a registry id, checked and never dereferenced.

#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::ptr::NonNull;
use std::sync::Arc;

use carve::StreamRef;

use crate::error::{guard, last_error_ptr, Code, FfiError, FfiResult};
use crate::registry::{self, Entry, Handle};
use crate::{current, make, stats};

/// `carve_resource_t`: an opaque handle (a registry id, never dereferenced).
pub type carve_resource_t = *mut c_void;
/// `carve_stream_t`: a `CUstream` / `cudaStream_t` (null: the legacy default stream).
pub type carve_stream_t = *mut c_void;

/// `carve_stat_t`: one statistic; `name` is a static string.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct carve_stat_t {
    /// The statistic's name (static, NUL-terminated).
    pub name: *const c_char,
    /// Its value (bytes and counts are exact below 2^53).
    pub value: f64,
}

/// `CARVE_SIZE_NONE`: "no bound" for optional sizes.
pub const SIZE_NONE: usize = usize::MAX;

/// The handle as the registry sees it.
pub fn handle_of(r: carve_resource_t) -> Handle {
    r as usize as Handle
}

/// The registry id as C sees it.
pub fn to_c(h: Handle) -> carve_resource_t {
    h as usize as carve_resource_t
}

fn entry(r: carve_resource_t) -> FfiResult<Arc<Entry>> {
    registry::get(handle_of(r))
}

pub(crate) fn opt(size: usize) -> Option<usize> {
    (size != SIZE_NONE).then_some(size)
}

pub(crate) fn device(d: c_int) -> FfiResult<usize> {
    usize::try_from(d).map_err(|_| FfiError::new(Code::NoDevice, format!("device ordinal {d}")))
}

pub(crate) fn check_out<T>(out: *mut T) -> FfiResult<()> {
    if out.is_null() {
        Err(FfiError::invalid("null output pointer"))
    } else {
        Ok(())
    }
}

/// Registers `make()`'s entry and writes its handle to `out` (checked before anything is built).
///
/// # Safety
/// `out` must be null or writable.
pub(crate) unsafe fn create(
    out: *mut carve_resource_t,
    make: impl FnOnce() -> FfiResult<Arc<Entry>>,
) -> c_int {
    guard(|| {
        check_out(out)?;
        let h = registry::insert(make()?)?;
        // SAFETY: `out` is non-null (checked) and the caller promises it is writable.
        unsafe { out.write(to_c(h)) };
        Ok(())
    })
}

/// Adaptor or suballocator over `upstream`.
///
/// # Safety
/// `out` must be null or writable.
pub(crate) unsafe fn create_over(
    upstream: carve_resource_t,
    out: *mut carve_resource_t,
    make: impl FnOnce(&Entry) -> FfiResult<Arc<Entry>>,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make(&*entry(upstream)?)) }
}

/// `carve_last_error`: this thread's last error message ("" when none).
#[no_mangle]
pub extern "C" fn carve_last_error() -> *const c_char {
    last_error_ptr()
}

/// `carve_error_name`: the `CARVE_*` name of an error code.
#[no_mangle]
pub extern "C" fn carve_error_name(code: c_int) -> *const c_char {
    Code::name(code).as_ptr()
}

/// `carve_resource_destroy`: forgets a handle.
#[no_mangle]
pub extern "C" fn carve_resource_destroy(r: carve_resource_t) -> c_int {
    guard(|| registry::remove(handle_of(r)).map(drop))
}

/// `carve_cuda_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_cuda_resource_create(
    dev: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make::cuda(device(dev)?)) }
}

/// `carve_managed_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_managed_resource_create(
    dev: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make::managed(device(dev)?)) }
}

/// `carve_pinned_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_pinned_resource_create(
    dev: c_int,
    flags: c_uint,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || make::pinned(device(dev)?, flags)) }
}

/// `carve_async_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_async_resource_create(
    dev: c_int,
    initial_size: usize,
    release_threshold: usize,
    hard_limit: usize,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create(out, || {
            make::async_pool(
                device(dev)?,
                initial_size,
                opt(release_threshold),
                opt(hard_limit),
            )
        })
    }
}

/// `carve_host_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_host_resource_create(out: *mut carve_resource_t) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || Ok(make::host())) }
}

/// `carve_pool_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_pool_resource_create(
    upstream: carve_resource_t,
    initial_size: usize,
    maximum_size: usize,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create_over(upstream, out, |u| {
            make::pool(u, initial_size, opt(maximum_size))
        })
    }
}

/// `carve_binning_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_binning_resource_create(
    upstream: carve_resource_t,
    min_exp: c_uint,
    max_exp: c_uint,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, |u| make::binning(u, min_exp, max_exp)) }
}

/// `carve_arena_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_arena_resource_create(
    upstream: carve_resource_t,
    superblock_size: usize,
    arenas: usize,
    maximum_size: usize,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create_over(upstream, out, |u| {
            make::arena(u, superblock_size, arenas, opt(maximum_size))
        })
    }
}

/// `carve_fixed_size_resource_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_fixed_size_resource_create(
    upstream: carve_resource_t,
    block_size: usize,
    blocks_per_refill: c_uint,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create_over(upstream, out, |u| {
            make::fixed_size(u, block_size, blocks_per_refill)
        })
    }
}

/// `carve_limiting_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_limiting_adaptor_create(
    upstream: carve_resource_t,
    limit: usize,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, |u| Ok(make::limiting(u, limit))) }
}

/// `carve_statistics_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_statistics_adaptor_create(
    upstream: carve_resource_t,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, |u| Ok(make::statistics(u))) }
}

/// `carve_tracking_adaptor_create`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_tracking_adaptor_create(
    upstream: carve_resource_t,
    capture_backtraces: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe {
        create_over(upstream, out, |u| {
            Ok(make::tracking(u, capture_backtraces != 0))
        })
    }
}

/// `carve_logging_adaptor_create`.
///
/// # Safety
/// `path` must be null or a NUL-terminated string; `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_logging_adaptor_create(
    upstream: carve_resource_t,
    path: *const c_char,
    auto_flush: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    let make = |u: &Entry| {
        if path.is_null() {
            return Err(FfiError::invalid("null log path"));
        }
        // SAFETY: non-null, and the caller promises a NUL-terminated string.
        let path = unsafe { CStr::from_ptr(path) }
            .to_str()
            .map_err(|_| FfiError::invalid("the log path is not UTF-8"))?;
        make::logging(u, path, auto_flush != 0)
    };
    // SAFETY: forwarded caller contract.
    unsafe { create_over(upstream, out, make) }
}

/// `carve_resource_kind`: the kind's name ("pool", "cuda", ...), static; null on a bad handle.
#[no_mangle]
pub extern "C" fn carve_resource_kind(r: carve_resource_t) -> *const c_char {
    match crate::error::catch(|| Ok(entry(r)?.kind)) {
        Ok(k) => k.as_ptr(),
        Err(_) => std::ptr::null(),
    }
}

/// `carve_allocate`.
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_allocate(
    r: carve_resource_t,
    bytes: usize,
    alignment: usize,
    stream: carve_stream_t,
    out: *mut *mut c_void,
) -> c_int {
    guard(|| {
        check_out(out)?;
        let e = entry(r)?;
        // SAFETY: the caller names a stream that is valid for this call (carve.h contract).
        let s = unsafe { StreamRef::from_raw(stream.cast()) };
        let p = e.resource.allocate(s, bytes, alignment)?;
        // SAFETY: non-null (checked), writable by the caller's contract.
        unsafe { out.write(p.as_ptr().cast()) };
        Ok(())
    })
}

/// `carve_deallocate`.
///
/// # Safety
/// `ptr` must come from `carve_allocate(r, bytes, alignment, ..)` and be unused after this
/// (except by work already queued on `stream`). Resources that track their blocks refuse
/// foreign pointers and double frees with `CARVE_ERROR_BAD_POINTER`; others cannot tell.
#[no_mangle]
pub unsafe extern "C" fn carve_deallocate(
    r: carve_resource_t,
    ptr: *mut c_void,
    bytes: usize,
    alignment: usize,
    stream: carve_stream_t,
) -> c_int {
    guard(|| {
        let e = entry(r)?;
        let p = NonNull::new(ptr.cast::<u8>())
            .ok_or_else(|| FfiError::new(Code::BadPointer, "null pointer passed to deallocate"))?;
        // SAFETY: the caller names a valid stream (carve.h contract).
        let s = unsafe { StreamRef::from_raw(stream.cast()) };
        // SAFETY: forwarded caller contract.
        unsafe { e.resource.deallocate(s, p, bytes, alignment) }?;
        Ok(())
    })
}

/// `carve_resource_stats`: writes up to `capacity` statistics and their total count.
///
/// # Safety
/// `out` must be null (with `capacity` 0) or point to `capacity` writable entries; `count`
/// must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_resource_stats(
    r: carve_resource_t,
    out: *mut carve_stat_t,
    capacity: usize,
    count: *mut usize,
) -> c_int {
    guard(|| {
        check_out(count)?;
        if out.is_null() && capacity != 0 {
            return Err(FfiError::invalid(
                "null statistics array with a non-zero capacity",
            ));
        }
        let all = stats::of(&*entry(r)?)?;
        for (i, (name, value)) in all.iter().take(capacity).enumerate() {
            // SAFETY: i < capacity entries, writable by the caller's contract.
            unsafe {
                out.add(i).write(carve_stat_t {
                    name: name.as_ptr(),
                    value: *value,
                })
            };
        }
        // SAFETY: non-null (checked), writable.
        unsafe { count.write(all.len()) };
        Ok(())
    })
}

/// `carve_resource_release`: returns unused memory upstream (pool, arena, driver pool).
///
/// # Safety
/// `released` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_resource_release(
    r: carve_resource_t,
    released: *mut usize,
) -> c_int {
    guard(|| {
        let n = make::release(&*entry(r)?)?;
        if !released.is_null() {
            // SAFETY: non-null, writable by the caller's contract.
            unsafe { released.write(n) };
        }
        Ok(())
    })
}

/// `carve_set_current_resource`: makes `r` current for `device`; writes a new handle to the
/// previous resource to `previous` when it is not null (destroy it when done).
///
/// # Safety
/// `previous` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_set_current_resource(
    dev: c_int,
    r: carve_resource_t,
    previous: *mut carve_resource_t,
) -> c_int {
    guard(|| {
        let e = entry(r)?;
        let before = current::set(device(dev)?, e)?;
        if !previous.is_null() {
            let h = registry::insert(before)?;
            // SAFETY: non-null, writable by the caller's contract.
            unsafe { previous.write(to_c(h)) };
        }
        Ok(())
    })
}

/// `carve_get_current_resource`: a new handle to `device`'s current resource (destroy it).
///
/// # Safety
/// `out` must be null or writable.
#[no_mangle]
pub unsafe extern "C" fn carve_get_current_resource(
    dev: c_int,
    out: *mut carve_resource_t,
) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { create(out, || current::get(device(dev)?)) }
}

/// `carve_live_handles`: how many handles are live (for leak checks in tests).
#[no_mangle]
pub extern "C" fn carve_live_handles() -> usize {
    crate::error::catch(|| Ok(registry::live())).unwrap_or(0)
}
