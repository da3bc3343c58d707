//! The C constructors of the virtual-memory resources, the graph-safe resource and the
//! aligning, prefetching and failure-callback adaptors, over host memory (no GPU needed).

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::sync::atomic::{AtomicUsize, Ordering};

use carve_capi::ffi::*;
use carve_capi::ffi_more::*;

const OK: i32 = 0;
const INVALID_HANDLE: i32 = 1;
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

fn kind(r: carve_resource_t) -> String {
    // SAFETY: a live handle's kind is a static C string.
    unsafe { CStr::from_ptr(carve_resource_kind(r)) }
        .to_string_lossy()
        .into_owned()
}

fn host() -> carve_resource_t {
    let mut h = ptr::null_mut();
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_host_resource_create(&mut h) }, OK);
    h
}

/// Allocates, writes and reads every byte, frees.
fn round_trip(r: carve_resource_t, bytes: usize, align: usize) {
    let mut p: *mut c_void = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(r, bytes, align, ptr::null_mut(), &mut p) };
    assert_eq!(code, OK, "{}", last());
    assert_eq!(p as usize % align, 0);
    // SAFETY: a host-accessible block of `bytes` bytes that nothing else uses.
    unsafe {
        ptr::write_bytes(p.cast::<u8>(), 0xA5, bytes);
        assert_eq!(*p.cast::<u8>().add(bytes - 1), 0xA5);
    }
    assert_eq!(
        // SAFETY: the block from the allocation above.
        unsafe { carve_deallocate(r, p, bytes, align, ptr::null_mut()) },
        OK
    );
}

#[test]
fn expandable_and_virtual_memory_build_over_host_virtual_memory() {
    let mut e = ptr::null_mut();
    // SAFETY: the output is writable.
    let code = unsafe {
        carve_expandable_host_resource_create(
            64 << 10,
            64 * MIB,
            SIZE_NONE,
            SIZE_NONE,
            SIZE_NONE,
            -1.0,
            &mut e,
        )
    };
    assert_eq!(code, OK, "{}", last());
    assert_eq!(kind(e), "expandable");
    round_trip(e, 3 * MIB + 17, 256);
    assert_eq!(carve_resource_destroy(e), OK);

    let mut v = ptr::null_mut();
    // SAFETY: the output is writable.
    let code = unsafe {
        carve_virtual_host_resource_create(64 << 10, 16 * MIB, SIZE_NONE, SIZE_NONE, &mut v)
    };
    assert_eq!(code, OK, "{}", last());
    assert_eq!(kind(v), "virtual");
    round_trip(v, 100 << 10, 4096);
    // Past the maximum: out of memory, typed.
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(v, 32 * MIB, 256, ptr::null_mut(), &mut p) };
    assert_eq!(code, OUT_OF_MEMORY, "{}", last());
    assert_eq!(carve_resource_destroy(v), OK);
}

#[test]
fn bad_virtual_memory_options_are_typed_errors() {
    let mut out = ptr::null_mut();
    let none = SIZE_NONE;
    // SAFETY: each output is a writable local or null; every call checks it.
    unsafe {
        // No maximum on host memory.
        assert_eq!(
            carve_expandable_host_resource_create(64 << 10, none, none, none, none, -1.0, &mut out),
            INVALID_ARGUMENT
        );
        assert!(last().contains("maximum"), "{}", last());
        // Granularity not a power of two.
        assert_eq!(
            carve_expandable_host_resource_create(3000, MIB, none, none, none, -1.0, &mut out),
            INVALID_ARGUMENT
        );
        // Headroom outside [0, 1], NaN included.
        assert_eq!(
            carve_expandable_host_resource_create(64 << 10, MIB, none, none, none, 2.0, &mut out),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_expandable_host_resource_create(
                64 << 10,
                MIB,
                none,
                none,
                none,
                f64::NAN,
                &mut out
            ),
            INVALID_ARGUMENT
        );
        // A chunk that is not a multiple of the granularity.
        assert_eq!(
            carve_virtual_host_resource_create(64 << 10, 4 * MIB, 3 << 10, none, &mut out),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_virtual_host_resource_create(64 << 10, none, none, none, &mut out),
            INVALID_ARGUMENT
        );
        // Null output.
        assert_eq!(
            carve_virtual_host_resource_create(64 << 10, MIB, none, none, ptr::null_mut()),
            INVALID_ARGUMENT
        );
        // Negative device ordinals.
        assert_eq!(
            carve_expandable_resource_create(-1, none, none, none, none, -1.0, 0, &mut out),
            NO_DEVICE
        );
        assert_eq!(
            carve_virtual_resource_create(-1, none, none, none, VM_EXPORTABLE, &mut out),
            NO_DEVICE
        );
        // Unknown flags, refused before any device is asked for.
        assert_eq!(
            carve_expandable_resource_create(0, none, none, none, none, -1.0, 1 << 8, &mut out),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_virtual_resource_create(0, none, none, none, 1 << 31, &mut out),
            INVALID_ARGUMENT
        );
    }
    assert!(out.is_null());
}

#[test]
fn aligned_adaptor_over_aligns_large_requests_and_refuses_bad_alignments() {
    let h = host();
    let mut a = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_aligned_adaptor_create(h, 1 << 16, 4096, &mut a) },
        OK,
        "{}",
        last()
    );
    assert_eq!(kind(a), "aligned");
    let mut p = ptr::null_mut();
    assert_eq!(
        // SAFETY: `p` is writable.
        unsafe { carve_allocate(a, 8192, 256, ptr::null_mut(), &mut p) },
        OK
    );
    assert_eq!(p as usize % (1 << 16), 0);
    assert_eq!(
        // SAFETY: the block just allocated.
        unsafe { carve_deallocate(a, p, 8192, 256, ptr::null_mut()) },
        OK
    );
    let mut bad = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_aligned_adaptor_create(h, 3000, 0, &mut bad) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_aligned_adaptor_create(ptr::null_mut(), 4096, 0, &mut bad) },
        INVALID_HANDLE
    );
    assert!(bad.is_null());
    for r in [a, h] {
        assert_eq!(carve_resource_destroy(r), OK);
    }
}

#[test]
fn prefetch_needs_a_device_and_a_live_upstream() {
    let h = host();
    let mut out = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_prefetch_adaptor_create(h, -1, &mut out) },
        NO_DEVICE
    );
    assert_eq!(
        // SAFETY: outputs are writable locals; handles and blocks come from the calls above.
        unsafe { carve_prefetch_adaptor_create(ptr::null_mut(), 0, &mut out) },
        INVALID_HANDLE
    );
    assert!(out.is_null());
    assert_eq!(carve_resource_destroy(h), OK);
}

static CALLS: AtomicUsize = AtomicUsize::new(0);

/// Retries twice, then gives up; counts its calls in `user_data` (an AtomicUsize).
unsafe extern "C" fn retry_twice(_bytes: usize, user_data: *mut c_void) -> c_int {
    // SAFETY: the test passes a pointer to a static AtomicUsize.
    let n = unsafe { &*user_data.cast::<AtomicUsize>() }.fetch_add(1, Ordering::SeqCst);
    c_int::from(n < 2)
}

#[test]
fn failure_callback_is_asked_on_out_of_memory_and_null_callbacks_are_refused() {
    let h = host();
    let mut lim = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_limiting_adaptor_create(h, 4096, &mut lim) },
        OK
    );
    let mut f = ptr::null_mut();
    let data = ptr::from_ref(&CALLS).cast_mut().cast::<c_void>();
    assert_eq!(
        // SAFETY: a thread-safe callback whose user data (a static) outlives the adaptor.
        unsafe { carve_failure_callback_adaptor_create(lim, Some(retry_twice), data, &mut f) },
        OK
    );
    assert_eq!(kind(f), "failure_callback");
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(f, 1 << 20, 256, ptr::null_mut(), &mut p) };
    assert_eq!(code, OUT_OF_MEMORY);
    assert_eq!(CALLS.load(Ordering::SeqCst), 3, "two retries, then no");
    round_trip(f, 1024, 256);
    let mut bad = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable; no callback is given.
        unsafe { carve_failure_callback_adaptor_create(lim, None, ptr::null_mut(), &mut bad) },
        INVALID_ARGUMENT
    );
    assert!(bad.is_null());
    for r in [f, lim, h] {
        assert_eq!(carve_resource_destroy(r), OK);
    }
}

#[test]
fn graph_safe_builds_over_any_upstream() {
    let h = host();
    let mut g = ptr::null_mut();
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_graph_safe_resource_create(h, &mut g) }, OK);
    assert_eq!(kind(g), "graph_safe");
    let mut bad = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_graph_safe_resource_create(ptr::null_mut(), &mut bad) },
        INVALID_HANDLE
    );
    for r in [g, h] {
        assert_eq!(carve_resource_destroy(r), OK);
    }
}
