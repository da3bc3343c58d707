//! The C ABI on a GPU: device resources, stream-ordered allocation, the current resource and
//! the framework symbols. Skips without a GPU (fails with `CARVE_REQUIRE_GPU=1`).

use std::ffi::{c_void, CStr};
use std::ptr;

use carve::require_gpu;
use carve_capi::ffi::*;
use carve_capi::frameworks::*;

const OK: i32 = 0;
const INVALID_ARGUMENT: i32 = 2;
const OUT_OF_MEMORY: i32 = 3;
const NO_DEVICE: i32 = 4;
const MIB: usize = 1 << 20;

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn alloc(r: carve_resource_t, bytes: usize, stream: carve_stream_t) -> (i32, *mut c_void) {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable; `stream` is null or a live stream of the caller.
    let code = unsafe { carve_allocate(r, bytes, 256, stream, &mut p) };
    (code, p)
}

fn free(r: carve_resource_t, p: *mut c_void, bytes: usize, stream: carve_stream_t) -> i32 {
    // SAFETY: `p` came from `alloc(r, bytes)` and is freed once.
    unsafe { carve_deallocate(r, p, bytes, 256, stream) }
}

#[test]
fn device_resources_allocate_on_streams_through_the_c_abi() {
    let dev = require_gpu!();
    let stream = dev.new_stream().unwrap();
    let raw: carve_stream_t = stream.as_ref().as_raw().cast();
    let (mut cuda, mut pool, mut managed, mut asynch) = (
        ptr::null_mut(),
        ptr::null_mut(),
        ptr::null_mut(),
        ptr::null_mut(),
    );
    // SAFETY: each output is writable.
    unsafe {
        assert_eq!(carve_cuda_resource_create(0, &mut cuda), OK, "{}", last());
        assert_eq!(
            carve_pool_resource_create(cuda, 16 * MIB, 64 * MIB, &mut pool),
            OK
        );
        assert_eq!(
            carve_managed_resource_create(0, &mut managed),
            OK,
            "{}",
            last()
        );
        assert_eq!(
            carve_async_resource_create(0, 0, SIZE_NONE, 4 * MIB, &mut asynch),
            OK,
            "{}",
            last()
        );
    }
    for (r, s) in [
        (cuda, ptr::null_mut()),
        (pool, raw),
        (managed, ptr::null_mut()),
        (asynch, raw),
    ] {
        let (code, p) = alloc(r, MIB, s);
        assert_eq!(code, OK, "{}", last());
        assert!(!p.is_null() && p as usize % 256 == 0);
        assert_eq!(free(r, p, MIB, s), OK, "{}", last());
    }
    assert_eq!(
        alloc(asynch, 8 * MIB, raw).0,
        OUT_OF_MEMORY,
        "the hard limit"
    );
    assert_eq!(
        alloc(pool, 128 * MIB, raw).0,
        OUT_OF_MEMORY,
        "the pool maximum"
    );
    assert!(last().contains("out of memory"), "{}", last());
    stream.synchronize().unwrap();
    let mut out = ptr::null_mut();
    // SAFETY: `out` is writable.
    unsafe {
        assert_eq!(carve_cuda_resource_create(4096, &mut out), NO_DEVICE);
        assert_eq!(
            carve_pinned_resource_create(0, 0x100, &mut out),
            INVALID_ARGUMENT
        );
    }
    for r in [asynch, managed, pool, cuda] {
        assert_eq!(carve_resource_destroy(r), OK);
    }
}

#[test]
fn framework_symbols_use_the_current_resource_on_a_device() {
    let _dev = require_gpu!();
    let (mut cuda, mut pool) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: both outputs are writable.
    unsafe {
        assert_eq!(carve_cuda_resource_create(0, &mut cuda), OK, "{}", last());
        assert_eq!(
            carve_pool_resource_create(cuda, 0, SIZE_NONE, &mut pool),
            OK
        );
    }
    let mut previous = ptr::null_mut();
    // SAFETY: `previous` is writable.
    let code = unsafe { carve_set_current_resource(0, pool, &mut previous) };
    assert_eq!(code, OK, "{}", last());
    let mut current = ptr::null_mut();
    // SAFETY: `current` is writable.
    assert_eq!(unsafe { carve_get_current_resource(0, &mut current) }, OK);
    // SAFETY: a static string for a live handle.
    let kind = unsafe { CStr::from_ptr(carve_resource_kind(current)) };
    assert_eq!(kind, c"pool");

    let before = carve_framework_outstanding();
    // SAFETY: the legacy default stream.
    let t = unsafe { carve_torch_alloc(3 * MIB as isize, 0, ptr::null_mut()) };
    assert!(!t.is_null(), "{}", last());
    let c = carve_cupy_malloc(0, MIB, 0);
    assert_ne!(c, 0, "{}", last());
    let o = carve_ort_alloc(MIB);
    assert!(!o.is_null(), "{}", last());
    assert_eq!(carve_framework_outstanding(), before + 3);
    // SAFETY: each block's one free; nothing uses them.
    unsafe {
        carve_torch_free(t, 3 * MIB as isize, 0, ptr::null_mut());
        carve_cupy_free(0, c, 0);
        carve_ort_free(o);
    }
    assert_eq!(carve_framework_outstanding(), before);

    // A memory fraction turns large requests into null (PyTorch then reports out of memory).
    carve_torch_set_memory_fraction(1e-9, 0);
    // SAFETY: the legacy default stream.
    let refused = unsafe { carve_torch_alloc(64 * MIB as isize, 0, ptr::null_mut()) };
    assert!(refused.is_null());
    assert!(last().contains("memory fraction"), "{}", last());
    carve_torch_set_memory_fraction(0.0, 0);

    // SAFETY: restoring the resource that was current; no output wanted.
    let code = unsafe { carve_set_current_resource(0, previous, ptr::null_mut()) };
    assert_eq!(code, OK);
    for r in [current, previous, pool, cuda] {
        assert_eq!(carve_resource_destroy(r), OK);
    }
}
