//! `carve_vm_set_segment_callback` and the NCCL flags of the virtual-memory constructors, over
//! host virtual memory (no GPU needed).

use std::ffi::{c_int, c_void, CStr};
use std::ptr;
use std::sync::Mutex;

use carve_capi::ffi::*;
use carve_capi::ffi_more::*;
use carve_capi::vm_segments::carve_vm_set_segment_callback;

const OK: i32 = 0;
const INVALID_HANDLE: i32 = 1;
const INVALID_ARGUMENT: i32 = 2;
const NO_DEVICE: i32 = 4;
const UNSUPPORTED: i32 = 7;
const KIB: usize = 1 << 10;
const G: usize = 64 * KIB;

type Log = Mutex<Vec<(usize, usize, c_int)>>;

unsafe extern "C" fn record(user: *mut c_void, ptr: *mut c_void, size: usize, mapped: c_int) {
    // SAFETY: every test passes a `Log` that outlives its resource.
    let log = unsafe { &*(user as *const Log) };
    log.lock().unwrap().push((ptr as usize, size, mapped));
}

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn take(log: &Log) -> Vec<(usize, usize, c_int)> {
    std::mem::take(&mut *log.lock().unwrap())
}

fn user(log: &Log) -> *mut c_void {
    log as *const Log as *mut c_void
}

fn alloc(r: carve_resource_t, bytes: usize) -> usize {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(r, bytes, 256, ptr::null_mut(), &mut p) };
    assert_eq!(code, OK, "{}", last());
    p as usize
}

fn free(r: carve_resource_t, p: usize, bytes: usize) {
    // SAFETY: a block from `alloc(r, bytes)`.
    let code = unsafe { carve_deallocate(r, p as *mut c_void, bytes, 256, ptr::null_mut()) };
    assert_eq!(code, OK, "{}", last());
}

fn virtual_host() -> carve_resource_t {
    let mut r = ptr::null_mut();
    // SAFETY: the output is writable.
    let code =
        unsafe { carve_virtual_host_resource_create(G, 64 * G, SIZE_NONE, SIZE_NONE, &mut r) };
    assert_eq!(code, OK, "{}", last());
    r
}

#[test]
fn the_callback_hears_of_mapped_and_released_chunks() {
    let log = Log::default();
    let r = virtual_host();
    // SAFETY: `record` takes the `Log` it is given, which outlives `r`.
    let code = unsafe { carve_vm_set_segment_callback(r, Some(record), user(&log)) };
    assert_eq!(code, OK, "{}", last());
    let a = alloc(r, 3 * G / 2);
    assert_eq!(take(&log), [(a, G, 1), (a + G, G, 1)]);
    free(r, a, 3 * G / 2);
    assert!(take(&log).is_empty(), "a free unmaps nothing");
    let mut released = 0;
    // SAFETY: `released` is writable.
    assert_eq!(unsafe { carve_resource_release(r, &mut released) }, OK);
    assert_eq!(released, 2 * G);
    let mut gone = take(&log);
    gone.sort();
    assert_eq!(gone, [(a, G, 0), (a + G, G, 0)]);
    let b = alloc(r, 100);
    assert_eq!(take(&log).len(), 1);
    assert_eq!(carve_resource_destroy(r), OK);
    // The block is still live: destroying the handle drops the resource, which announces its
    // chunk unmapped.
    assert_eq!(take(&log), [(b & !(G - 1), G, 0)]);
}

#[test]
fn a_late_callback_hears_of_chunks_mapped_and_null_removes_it() {
    let log = Log::default();
    let mut r = ptr::null_mut();
    // SAFETY: the output is writable.
    let code = unsafe {
        carve_expandable_host_resource_create(
            G,
            64 * G,
            SIZE_NONE,
            SIZE_NONE,
            SIZE_NONE,
            -1.0,
            &mut r,
        )
    };
    assert_eq!(code, OK, "{}", last());
    let a = alloc(r, 100);
    // SAFETY: as above.
    let code = unsafe { carve_vm_set_segment_callback(r, Some(record), user(&log)) };
    assert_eq!(code, OK);
    assert_eq!(take(&log), [(a & !(G - 1), G, 1)]);
    // SAFETY: removing the callback passes nothing on.
    let code = unsafe { carve_vm_set_segment_callback(r, None, ptr::null_mut()) };
    assert_eq!(code, OK);
    let _big = alloc(r, 40 * G);
    assert!(take(&log).is_empty());
    assert_eq!(carve_resource_destroy(r), OK);
    assert!(take(&log).is_empty());
}

#[test]
fn other_kinds_and_dead_handles_are_refused() {
    let log = Log::default();
    let mut h = ptr::null_mut();
    // SAFETY: the output is writable.
    assert_eq!(unsafe { carve_host_resource_create(&mut h) }, OK);
    // SAFETY: refused before the callback is kept.
    let code = unsafe { carve_vm_set_segment_callback(h, Some(record), user(&log)) };
    assert_eq!(code, UNSUPPORTED, "{}", last());
    assert!(last().contains("virtual-memory"), "{}", last());
    assert_eq!(carve_resource_destroy(h), OK);
    // SAFETY: as above.
    let code = unsafe { carve_vm_set_segment_callback(h, Some(record), user(&log)) };
    assert_eq!(code, INVALID_HANDLE);
    let r = virtual_host();
    assert_eq!(carve_resource_destroy(r), OK);
    // SAFETY: as above.
    let code = unsafe { carve_vm_set_segment_callback(r, Some(record), user(&log)) };
    assert_eq!(code, INVALID_HANDLE);
    assert!(take(&log).is_empty());
}

#[test]
fn nccl_flags_are_checked_before_the_device() {
    let mut r = ptr::null_mut();
    let nccl = VM_EXPORTABLE | VM_FABRIC_WHERE_SUPPORTED | VM_RECOMMENDED_GRANULARITY;
    for (flags, want) in [
        (0x10, INVALID_ARGUMENT),
        (VM_FABRIC | VM_FABRIC_WHERE_SUPPORTED, INVALID_ARGUMENT),
        (nccl, NO_DEVICE),
        (VM_FABRIC | VM_EXPORTABLE, NO_DEVICE),
    ] {
        if carve::driver::is_available() && want == NO_DEVICE {
            continue;
        }
        // SAFETY: the output is writable.
        let code = unsafe { carve_virtual_resource_create(99, 0, 0, 0, flags, &mut r) };
        assert_eq!(code, want, "flags {flags:#x}: {}", last());
        // SAFETY: as above.
        let code = unsafe { carve_expandable_resource_create(99, 0, 0, 0, 0, -1.0, flags, &mut r) };
        assert_eq!(code, want, "flags {flags:#x}: {}", last());
    }
}
