//! Chunk sharing through the C ABI without a GPU: every error path of
//! `carve_vm_export_chunk`, `carve_vm_import_chunk` and `carve_vm_chunk_release` is a code and a
//! message, never a crash. (vm_share_gpu.rs shares a chunk with a child process.)
#![cfg(unix)]

use std::ffi::{c_int, c_void, CStr};
use std::os::fd::AsRawFd;
use std::ptr;

use carve_capi::ffi::*;
use carve_capi::ffi_more::*;
use carve_capi::vm_share::*;

const OK: i32 = 0;
const INVALID_HANDLE: i32 = 1;
const INVALID_ARGUMENT: i32 = 2;
const BAD_POINTER: i32 = 6;
const UNSUPPORTED: i32 = 7;
const MIB: usize = 1 << 20;

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// `carve_vm_export_chunk` with fresh outputs; the outputs must stay untouched on failure.
fn export(r: carve_resource_t, p: *mut c_void) -> c_int {
    let (mut fd, mut start, mut size) = (-1, ptr::null_mut(), 0usize);
    // SAFETY: the outputs are writable.
    let code = unsafe { carve_vm_export_chunk(r, p, &mut fd, &mut start, &mut size) };
    if code != OK {
        assert_eq!(
            (fd, start, size),
            (-1, ptr::null_mut(), 0),
            "outputs written on failure"
        );
    }
    code
}

fn alloc(r: carve_resource_t, bytes: usize) -> *mut c_void {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(r, bytes, 256, ptr::null_mut(), &mut p) };
    assert_eq!(code, OK, "{}", last());
    p
}

fn free(r: carve_resource_t, p: *mut c_void, bytes: usize) {
    // SAFETY: `p` came from `alloc(r, bytes)` and is freed once.
    let code = unsafe { carve_deallocate(r, p, bytes, 256, ptr::null_mut()) };
    assert_eq!(code, OK);
}

#[test]
fn export_refuses_foreign_pointers_other_kinds_and_host_backings() {
    let none = SIZE_NONE;
    let (mut v, mut e, mut h) = (ptr::null_mut(), ptr::null_mut(), ptr::null_mut());
    // SAFETY: the outputs are writable.
    unsafe {
        assert_eq!(
            carve_virtual_host_resource_create(64 << 10, 16 * MIB, none, none, &mut v),
            OK,
            "{}",
            last()
        );
        let code = carve_expandable_host_resource_create(
            64 << 10,
            16 * MIB,
            none,
            none,
            none,
            -1.0,
            &mut e,
        );
        assert_eq!(code, OK, "{}", last());
        assert_eq!(carve_host_resource_create(&mut h), OK);
    }
    for r in [v, e] {
        let p = alloc(r, 4096);
        // A live block reaches the backing, and host memory files are not exported.
        assert_eq!(export(r, p), UNSUPPORTED, "{}", last());
        assert!(last().contains("does not export"), "{}", last());
        // Addresses the resource did not hand out.
        let foreign = (p as usize + 8 * MIB) as *mut c_void;
        assert_eq!(export(r, foreign), BAD_POINTER, "{}", last());
        assert_eq!(export(r, ptr::null_mut()), BAD_POINTER);
        // Null outputs.
        let (mut fd, mut start, mut size) = (-1, ptr::null_mut(), 0usize);
        // SAFETY: the non-null outputs are writable.
        unsafe {
            let codes = [
                carve_vm_export_chunk(r, p, ptr::null_mut(), &mut start, &mut size),
                carve_vm_export_chunk(r, p, &mut fd, ptr::null_mut(), &mut size),
                carve_vm_export_chunk(r, p, &mut fd, &mut start, ptr::null_mut()),
            ];
            assert_eq!(codes, [INVALID_ARGUMENT; 3]);
        }
        free(r, p, 4096);
    }
    // Other kinds do not export, with a message that says where to export.
    let p = alloc(h, 4096);
    assert_eq!(export(h, p), UNSUPPORTED);
    assert!(
        last().contains("a host resource does not export chunks"),
        "{}",
        last()
    );
    free(h, p, 4096);
    // Null, destroyed and forged handles.
    assert_eq!(export(ptr::null_mut(), p), INVALID_HANDLE);
    assert_eq!(carve_resource_destroy(v), OK);
    assert_eq!(export(v, p), INVALID_HANDLE);
    assert_eq!(
        export((e as usize ^ (1 << 40)) as carve_resource_t, p),
        INVALID_HANDLE
    );
    assert_eq!(carve_resource_destroy(e), OK);
    assert_eq!(carve_resource_destroy(h), OK);
}

#[test]
fn import_refuses_bad_arguments_and_release_refuses_dead_handles() {
    let devnull = std::fs::File::open("/dev/null").unwrap();
    let fd = devnull.as_raw_fd();
    let (mut chunk, mut p): (carve_chunk_t, *mut c_void) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: `fd` is open for every call; the non-null outputs are writable.
    unsafe {
        assert_eq!(
            carve_vm_import_chunk(-1, 2 * MIB, 0, &mut chunk, &mut p),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_vm_import_chunk(fd, 0, 0, &mut chunk, &mut p),
            INVALID_ARGUMENT
        );
        assert!(last().contains("size of zero"), "{}", last());
        assert_eq!(
            carve_vm_import_chunk(fd, 2 * MIB, 0, ptr::null_mut(), &mut p),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_vm_import_chunk(fd, 2 * MIB, 0, &mut chunk, ptr::null_mut()),
            INVALID_ARGUMENT
        );
        // A descriptor that is no chunk: no device here, or the driver refuses it.
        assert_ne!(
            carve_vm_import_chunk(fd, 2 * MIB, 0, &mut chunk, &mut p),
            OK
        );
        assert_ne!(
            carve_vm_import_chunk(fd, 2 * MIB, -1, &mut chunk, &mut p),
            OK
        );
    }
    assert!(chunk.is_null() && p.is_null(), "outputs written on failure");
    assert_eq!(carve_vm_chunk_release(ptr::null_mut()), INVALID_HANDLE);
    assert_eq!(carve_vm_chunk_release(1 as carve_chunk_t), INVALID_HANDLE);
    assert!(last().contains("not live"), "{}", last());
}

#[test]
fn unknown_virtual_memory_flags_are_refused() {
    let mut out = ptr::null_mut();
    // SAFETY: the output is writable.
    let code = unsafe {
        carve_virtual_resource_create(0, SIZE_NONE, SIZE_NONE, SIZE_NONE, 1 << 8, &mut out)
    };
    assert_eq!(code, INVALID_ARGUMENT);
    assert!(last().contains("flags"), "{}", last());
    assert!(out.is_null());
}
