//! The C ABI's error paths and composition, over host memory (no GPU needed).

use std::ffi::{c_void, CStr};
use std::ptr;

use carve_capi::ffi::*;
use carve_capi::frameworks::*;

#[path = "c/harness.rs"]
mod harness;

const OK: i32 = 0;
const INVALID_HANDLE: i32 = 1;
const INVALID_ARGUMENT: i32 = 2;
const OUT_OF_MEMORY: i32 = 3;
const NO_DEVICE: i32 = 4;
const BAD_POINTER: i32 = 6;
const UNSUPPORTED: i32 = 7;
const IO: i32 = 8;

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn host() -> carve_resource_t {
    let mut h = ptr::null_mut();
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_host_resource_create(&mut h) }, OK);
    h
}

fn alloc(r: carve_resource_t, bytes: usize, align: usize) -> (i32, *mut c_void) {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(r, bytes, align, ptr::null_mut(), &mut p) };
    (code, p)
}

fn stats(r: carve_resource_t) -> Vec<(String, f64)> {
    let mut n = 0;
    assert_eq!(
        // SAFETY: asking for the count only.
        unsafe { carve_resource_stats(r, ptr::null_mut(), 0, &mut n) },
        OK
    );
    let mut v = vec![
        carve_stat_t {
            name: ptr::null(),
            value: 0.0
        };
        n
    ];
    assert_eq!(
        // SAFETY: `v` has `n` entries.
        unsafe { carve_resource_stats(r, v.as_mut_ptr(), n, &mut n) },
        OK
    );
    v.iter()
        .map(|s| {
            (
                // SAFETY: names are static C strings.
                unsafe { CStr::from_ptr(s.name) }
                    .to_string_lossy()
                    .into_owned(),
                s.value,
            )
        })
        .collect()
}

fn stat(r: carve_resource_t, name: &str) -> f64 {
    stats(r)
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no statistic {name}"))
        .1
}

#[test]
fn null_destroyed_and_forged_handles_are_errors() {
    let (code, p) = alloc(ptr::null_mut(), 64, 256);
    assert_eq!(code, INVALID_HANDLE);
    assert!(p.is_null());
    assert!(last().contains("null carve resource handle"), "{}", last());

    let h = host();
    assert_eq!(carve_resource_destroy(h), OK);
    assert_eq!(carve_resource_destroy(h), INVALID_HANDLE);
    assert!(last().contains("not live"), "{}", last());
    assert_eq!(alloc(h, 64, 256).0, INVALID_HANDLE);
    // SAFETY: the call refuses the handle before touching the pointer.
    let freed = unsafe { carve_deallocate(h, 0x1000 as *mut c_void, 64, 256, ptr::null_mut()) };
    assert_eq!(freed, INVALID_HANDLE);
    let mut n = 0;
    assert_eq!(
        // SAFETY: count is writable.
        unsafe { carve_resource_stats(h, ptr::null_mut(), 0, &mut n) },
        INVALID_HANDLE
    );
    let mut out = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_pool_resource_create(h, 0, SIZE_NONE, &mut out) },
        INVALID_HANDLE
    );
    assert!(out.is_null());
    assert!(carve_resource_kind(h).is_null());
    assert_eq!(
        alloc(0xdead_beef_usize as carve_resource_t, 64, 256).0,
        INVALID_HANDLE
    );
    assert_eq!(
        alloc(usize::MAX as carve_resource_t, 64, 256).0,
        INVALID_HANDLE
    );
}

#[test]
fn bad_sizes_alignments_and_outputs_are_errors() {
    let h = host();
    assert_eq!(alloc(h, 0, 256).0, INVALID_ARGUMENT);
    assert!(last().contains("zero-byte"), "{}", last());
    assert_eq!(alloc(h, 64, 3).0, INVALID_ARGUMENT);
    assert!(last().contains("not a power of two"), "{}", last());
    assert_eq!(alloc(h, 64, 0).0, INVALID_ARGUMENT);
    assert_eq!(alloc(h, usize::MAX, 256).0, INVALID_ARGUMENT);
    // SAFETY: null output on purpose; refused before anything is allocated.
    let code = unsafe { carve_allocate(h, 64, 256, ptr::null_mut(), ptr::null_mut()) };
    assert_eq!(code, INVALID_ARGUMENT);
    assert_eq!(
        // SAFETY: a null output on purpose; refused before anything is written.
        unsafe { carve_host_resource_create(ptr::null_mut()) },
        INVALID_ARGUMENT
    );
    let mut n = 0;
    assert_eq!(
        // SAFETY: null array with a capacity on purpose.
        unsafe { carve_resource_stats(h, ptr::null_mut(), 4, &mut n) },
        INVALID_ARGUMENT
    );
    let mut out = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_binning_resource_create(h, 12, 3, &mut out) },
        INVALID_ARGUMENT
    );
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_pinned_resource_create(0, 0x80, &mut out) },
        INVALID_ARGUMENT
    );
    assert_eq!(carve_resource_destroy(h), OK);
}

#[test]
fn foreign_double_and_mismatched_frees_are_refused_and_leave_the_resource_intact() {
    let h = host();
    let (code, p) = alloc(h, 100, 256);
    assert_eq!(code, OK);
    let mut local = 0u64;
    // SAFETY: foreign pointer on purpose; the host resource refuses it untouched.
    let foreign = unsafe {
        carve_deallocate(
            h,
            (&mut local as *mut u64).cast(),
            100,
            256,
            ptr::null_mut(),
        )
    };
    assert_eq!(foreign, BAD_POINTER);
    assert_eq!(
        // SAFETY: wrong size on purpose; refused.
        unsafe { carve_deallocate(h, p, 50, 256, ptr::null_mut()) },
        BAD_POINTER
    );
    assert!(last().contains("allocated as 100 bytes"), "{}", last());
    assert_eq!(
        // SAFETY: null pointer on purpose.
        unsafe { carve_deallocate(h, ptr::null_mut(), 100, 256, ptr::null_mut()) },
        BAD_POINTER
    );
    assert_eq!(stat(h, "allocation_count"), 1.0);
    assert_eq!(
        // SAFETY: the block's one correct free.
        unsafe { carve_deallocate(h, p, 100, 256, ptr::null_mut()) },
        OK
    );
    assert_eq!(
        // SAFETY: a double free on purpose; refused.
        unsafe { carve_deallocate(h, p, 100, 256, ptr::null_mut()) },
        BAD_POINTER
    );
    assert_eq!(stat(h, "allocation_count"), 0.0);
    assert_eq!(carve_resource_destroy(h), OK);
}

#[test]
fn adaptors_compose_and_outlive_their_upstream_handles() {
    let h = host();
    let mut pool = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_pool_resource_create(h, 1 << 20, 4 << 20, &mut pool) },
        OK
    );
    let mut limited = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_limiting_adaptor_create(pool, 1 << 20, &mut limited) },
        OK
    );
    let mut st = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_statistics_adaptor_create(limited, &mut st) },
        OK
    );
    // Destroying the inner handles keeps the stack alive (the adaptor holds them).
    assert_eq!(carve_resource_destroy(h), OK);
    assert_eq!(carve_resource_destroy(limited), OK);
    assert_eq!(
        // SAFETY: static string.
        unsafe { CStr::from_ptr(carve_resource_kind(st)) },
        c"statistics"
    );

    let (c1, a) = alloc(st, 4096, 256);
    let (c2, b) = alloc(st, 8192, 256);
    assert_eq!((c1, c2), (OK, OK));
    assert_eq!(stat(st, "current_bytes"), 12288.0);
    assert_eq!(stat(st, "current_count"), 2.0);
    assert_eq!(stat(pool, "bytes_in_use"), 12288.0);
    // Past the limit: out of memory, with carve's message, and nothing changes.
    let (code, p) = alloc(st, 1 << 20, 256);
    assert_eq!(code, OUT_OF_MEMORY);
    assert!(p.is_null());
    assert!(last().contains("out of memory"), "{}", last());
    assert_eq!(stat(st, "current_count"), 2.0);
    // SAFETY: both blocks came from `st` with these sizes.
    unsafe {
        assert_eq!(carve_deallocate(st, a, 4096, 256, ptr::null_mut()), OK);
        assert_eq!(carve_deallocate(st, b, 8192, 256, ptr::null_mut()), OK);
    }
    assert_eq!(stat(st, "current_bytes"), 0.0);
    assert_eq!(stat(st, "peak_bytes"), 12288.0);
    let mut released = 0;
    // SAFETY: `released` is writable.
    assert_eq!(unsafe { carve_resource_release(pool, &mut released) }, OK);
    assert_eq!(
        // SAFETY: statistics adaptors hold nothing to release.
        unsafe { carve_resource_release(st, ptr::null_mut()) },
        UNSUPPORTED
    );
    assert_eq!(carve_resource_destroy(st), OK);
    assert_eq!(carve_resource_destroy(pool), OK);
}

#[test]
fn every_suballocator_and_adaptor_builds_over_host_memory() {
    let h = host();
    let dir = std::env::temp_dir().join(format!("carve-capi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("log.csv");
    let log_c = std::ffi::CString::new(log.to_str().unwrap()).unwrap();
    let mut made = Vec::new();
    let mut out = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_pool_resource_create(h, 0, SIZE_NONE, &mut out) },
        OK
    );
    made.push(out);
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_binning_resource_create(h, 8, 12, &mut out) },
        OK
    );
    made.push(out);
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_arena_resource_create(h, 1 << 20, 2, SIZE_NONE, &mut out) },
        OK
    );
    made.push(out);
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_fixed_size_resource_create(h, 4096, 4, &mut out) },
        OK
    );
    made.push(out);
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_tracking_adaptor_create(h, 0, &mut out) }, OK);
    made.push(out);
    assert_eq!(
        // SAFETY: a NUL-terminated path.
        unsafe { carve_logging_adaptor_create(h, log_c.as_ptr(), 1, &mut out) },
        OK
    );
    made.push(out);
    for &r in &made {
        let (code, p) = alloc(r, 1000, 256);
        assert_eq!(code, OK, "{}", last());
        // SAFETY: 1000 bytes of host memory just allocated.
        unsafe { p.cast::<u8>().write_bytes(0x5A, 1000) };
        assert_eq!(
            // SAFETY: the block's one free.
            unsafe { carve_deallocate(r, p, 1000, 256, ptr::null_mut()) },
            OK
        );
        assert_eq!(carve_resource_destroy(r), OK);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    assert_eq!(text.lines().count(), 3, "header, allocate, free:\n{text}");

    assert_eq!(
        // SAFETY: null path on purpose.
        unsafe { carve_logging_adaptor_create(h, ptr::null(), 0, &mut out) },
        INVALID_ARGUMENT
    );
    let bad = c"/nonexistent-dir-carve/x.csv";
    assert_eq!(
        // SAFETY: a NUL-terminated path.
        unsafe { carve_logging_adaptor_create(h, bad.as_ptr(), 0, &mut out) },
        IO
    );
    assert_eq!(carve_resource_destroy(h), OK);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn tracking_refuses_a_foreign_pointer() {
    let h = host();
    let mut t = ptr::null_mut();
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_tracking_adaptor_create(h, 0, &mut t) }, OK);
    // SAFETY: a pointer the adaptor never handed out; refused before the upstream sees it.
    let code = unsafe { carve_deallocate(t, 0x10_0000 as *mut c_void, 64, 256, ptr::null_mut()) };
    assert_eq!(code, BAD_POINTER);
    assert_eq!(stat(t, "allocation_count"), 0.0);
    carve_resource_destroy(t);
    carve_resource_destroy(h);
}

#[test]
fn device_resources_and_the_current_resource_need_a_device() {
    if carve::driver::is_available() {
        eprintln!("SKIPPED: a GPU is present; this checks the no-device error path");
        return;
    }
    let mut out = ptr::null_mut();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_cuda_resource_create(0, &mut out) },
        NO_DEVICE
    );
    assert!(
        last().contains("CUDA driver") || last().contains("device"),
        "{}",
        last()
    );
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_managed_resource_create(0, &mut out) },
        NO_DEVICE
    );
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_async_resource_create(0, 0, SIZE_NONE, SIZE_NONE, &mut out) },
        NO_DEVICE
    );
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_cuda_resource_create(-1, &mut out) },
        NO_DEVICE
    );
    assert_eq!(
        // SAFETY: `out` is writable.
        unsafe { carve_get_current_resource(0, &mut out) },
        NO_DEVICE
    );
    let h = host();
    assert_eq!(
        // SAFETY: `previous` may be null.
        unsafe { carve_set_current_resource(0, h, ptr::null_mut()) },
        NO_DEVICE
    );
    assert!(out.is_null());
    // Framework symbols fail soft: null, and the last error says why.
    // SAFETY: the legacy default stream.
    assert!(unsafe { carve_torch_alloc(64, 0, ptr::null_mut()) }.is_null());
    assert_eq!(carve_cupy_malloc(0, 64, 0), 0);
    carve_resource_destroy(h);
}

#[test]
fn cupy_symbols_record_sizes_and_refuse_bad_frees() {
    let h = host();
    let param = h as isize;
    let p = carve_cupy_malloc(param, 1000, 0);
    assert_ne!(p, 0, "{}", last());
    assert_eq!(p % 256, 0);
    assert_eq!(stat(h, "allocated_bytes"), 1000.0);
    // Size-less free: carve recorded the size.
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_cupy_free(param, p, 0) };
    assert_eq!(stat(h, "allocation_count"), 0.0);
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_cupy_free(param, p, 0) }; // double free: refused, nothing happens
    assert!(last().contains("not allocated through carve"), "{}", last());
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_cupy_free(param, 0, 0) }; // null: nothing to do
    assert_eq!(carve_cupy_malloc(param, 0, 0), 0);
    assert_eq!(carve_cupy_malloc(-5, 64, 0), 0);
    assert!(last().contains("not live"), "{}", last());

    // A destroyed handle cannot allocate, but its outstanding blocks still free.
    let q = carve_cupy_malloc(param, 64, 0);
    assert_ne!(q, 0);
    carve_resource_destroy(h);
    assert_eq!(carve_cupy_malloc(param, 64, 0), 0);
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_cupy_free(param, q, 0) };
}

#[test]
fn torch_slots_bind_resources_and_frees_follow_the_allocating_resource() {
    let a = host();
    let b = host();
    assert_eq!(carve_torch_bind_slot(3, a), OK);
    // SAFETY: the legacy default stream.
    let p = unsafe { carve_torch_alloc_3(4096, 0, ptr::null_mut()) };
    assert!(!p.is_null(), "{}", last());
    assert_eq!(stat(a, "allocated_bytes"), 4096.0);
    // Rebinding the slot does not move the outstanding block.
    assert_eq!(carve_torch_bind_slot(3, b), OK);
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_torch_free_3(p, 4096, 0, ptr::null_mut()) };
    assert_eq!(stat(a, "allocated_bytes"), 0.0);
    // SAFETY: the legacy default stream.
    assert!(unsafe { carve_torch_alloc_3(-1, 0, ptr::null_mut()) }.is_null());
    assert!(last().contains("negative size"), "{}", last());
    // SAFETY: the legacy default stream.
    assert!(unsafe { carve_torch_alloc_3(0, 0, ptr::null_mut()) }.is_null());
    assert_eq!(carve_torch_bind_slot(3, ptr::null_mut()), OK);
    // SAFETY: the legacy default stream.
    assert!(unsafe { carve_torch_alloc_3(64, 0, ptr::null_mut()) }.is_null());
    assert!(last().contains("no resource bound"), "{}", last());
    assert_eq!(carve_torch_bind_slot(16, a), INVALID_ARGUMENT);
    assert_eq!(carve_torch_bind_slot(-1, a), INVALID_ARGUMENT);
    let dead = host();
    carve_resource_destroy(dead);
    assert_eq!(carve_torch_bind_slot(4, dead), INVALID_HANDLE);
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_torch_free(0x1234_5600 as *mut c_void, 64, 0, ptr::null_mut()) };
    assert!(last().contains("not allocated through carve"), "{}", last());
    carve_torch_reset();
    carve_resource_destroy(a);
    carve_resource_destroy(b);
}

#[test]
fn onnx_runtime_symbols_use_the_bound_resource() {
    let mut pool = ptr::null_mut();
    let h = host();
    assert_eq!(
        // SAFETY: the output is writable.
        unsafe { carve_pool_resource_create(h, 0, SIZE_NONE, &mut pool) },
        OK
    );
    assert_eq!(carve_ort_set_resource(pool), OK);
    let p = carve_ort_alloc(10_000);
    assert!(!p.is_null(), "{}", last());
    assert!(stat(pool, "bytes_in_use") >= 10_000.0);
    // SAFETY: a block carve handed out and nothing uses, or a pointer it refuses untouched.
    unsafe { carve_ort_free(p) };
    assert_eq!(stat(pool, "bytes_in_use"), 0.0);
    carve_ort_empty_cache();
    assert_eq!(
        stat(pool, "pool_size"),
        0.0,
        "empty_cache released the pool's chunks"
    );
    assert!(carve_ort_alloc(0).is_null());
    assert_eq!(carve_ort_set_resource(ptr::null_mut()), OK);
    carve_resource_destroy(pool);
    carve_resource_destroy(h);
}

#[test]
fn error_names_and_a_fresh_threads_last_error() {
    // SAFETY: static strings.
    unsafe {
        assert_eq!(CStr::from_ptr(carve_error_name(0)), c"CARVE_OK");
        assert_eq!(
            CStr::from_ptr(carve_error_name(3)),
            c"CARVE_ERROR_OUT_OF_MEMORY"
        );
        assert_eq!(CStr::from_ptr(carve_error_name(9)), c"CARVE_ERROR_PANIC");
        assert_eq!(CStr::from_ptr(carve_error_name(-7)), c"CARVE_ERROR_UNKNOWN");
    }
    std::thread::spawn(|| assert_eq!(last(), ""))
        .join()
        .unwrap();
}

#[test]
fn a_panic_is_caught_at_the_boundary() {
    let code = carve_capi::error::guard(|| panic!("boom"));
    assert_eq!(code, 9);
    assert!(last().contains("carve panicked: boom"), "{}", last());
}

/// The header compiles with a C compiler and a C program sees the same error paths.
#[test]
fn c_program_links_and_checks_error_paths() {
    harness::run_c("error_paths.c");
}
