//! A virtual-memory chunk shared through the C ABI with a child process: this test binary
//! re-executes itself as the child (an ignored test, run with `--ignored`), handing it the
//! exported descriptor as its standard input. The child maps the chunk with
//! `carve_vm_import_chunk`, checks what the parent wrote and overwrites it for the parent to
//! check. Skips without a GPU (fails with `CARVE_REQUIRE_GPU=1`).
#![cfg(unix)]

use std::ffi::{c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Command, Stdio};
use std::ptr;

use carve::cudarc::driver::result as cu;
use carve::{require_gpu, Device};
use carve_capi::ffi::*;
use carve_capi::ffi_more::*;
use carve_capi::vm_share::*;

const OK: i32 = 0;
const INVALID_HANDLE: i32 = 1;
const UNSUPPORTED: i32 = 7;
const LEN: usize = 1 << 20;
const CHILD_BYTE: u8 = 0x5c;

fn parent_byte(i: usize) -> u8 {
    (i * 7 + 3) as u8
}

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn virtual_resource(flags: u32) -> (i32, carve_resource_t) {
    let mut r = ptr::null_mut();
    // SAFETY: the output is writable.
    let code =
        unsafe { carve_virtual_resource_create(0, SIZE_NONE, SIZE_NONE, SIZE_NONE, flags, &mut r) };
    (code, r)
}

fn alloc(r: carve_resource_t) -> *mut c_void {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable.
    let code = unsafe { carve_allocate(r, LEN, 256, ptr::null_mut(), &mut p) };
    assert_eq!(code, OK, "{}", last());
    p
}

fn free(r: carve_resource_t, p: *mut c_void) {
    // SAFETY: `p` came from `alloc(r)` and nothing uses it any more.
    let code = unsafe { carve_deallocate(r, p, LEN, 256, ptr::null_mut()) };
    assert_eq!(code, OK);
}

#[test]
fn a_chunk_exported_through_the_c_abi_is_read_and_written_by_a_child_process() {
    let dev = require_gpu!();
    let (code, r) = virtual_resource(VM_EXPORTABLE);
    if code == UNSUPPORTED {
        eprintln!("SKIPPED chunk sharing: {}", last());
        return;
    }
    assert_eq!(code, OK, "{}", last());
    let p = alloc(r);
    let data: Vec<u8> = (0..LEN).map(parent_byte).collect();
    dev.bind().unwrap();
    // SAFETY: `p` is a live device block of LEN bytes; a synchronous copy.
    unsafe { cu::memcpy_htod_sync(p as u64, &data) }.unwrap();
    let (mut fd, mut start, mut size) = (-1, ptr::null_mut(), 0usize);
    // SAFETY: the outputs are writable.
    let code = unsafe { carve_vm_export_chunk(r, p, &mut fd, &mut start, &mut size) };
    assert_eq!(code, OK, "{}", last());
    assert!(fd >= 0);
    // SAFETY: a new descriptor that carve handed to this caller.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let offset = p as usize - start as usize;
    assert!(
        offset + LEN <= size,
        "a whole-chunk block lies in one chunk"
    );

    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "chunk_child",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CARVE_CHUNK_SIZE", size.to_string())
        .env("CARVE_CHUNK_OFFSET", offset.to_string())
        .stdin(Stdio::from(fd))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("CHUNK-CHILD-OK"),
        "child failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
    let mut host = vec![0u8; LEN];
    dev.bind().unwrap();
    // SAFETY: as above.
    unsafe { cu::memcpy_dtoh_sync(&mut host, p as u64) }.unwrap();
    assert!(host.iter().all(|&b| b == CHILD_BYTE), "the child's writes");
    free(r, p);
    assert_eq!(carve_resource_destroy(r), OK);

    // A resource created without CARVE_VM_EXPORTABLE maps chunks but does not export them.
    let (code, plain) = virtual_resource(0);
    assert_eq!(code, OK, "{}", last());
    let q = alloc(plain);
    let (mut fd, mut start, mut size) = (-1, ptr::null_mut(), 0usize);
    // SAFETY: the outputs are writable.
    let code = unsafe { carve_vm_export_chunk(plain, q, &mut fd, &mut start, &mut size) };
    assert_eq!(code, UNSUPPORTED, "{}", last());
    free(plain, q);
    assert_eq!(carve_resource_destroy(plain), OK);
}

/// The child side of the test above: the chunk's descriptor is its standard input.
#[test]
#[ignore = "the child process of a_chunk_exported_through_the_c_abi_is_read_and_written_by_a_child_process"]
fn chunk_child() {
    let var = |k: &str| -> usize {
        std::env::var(k)
            .expect("run by the parent test")
            .parse()
            .unwrap()
    };
    let (size, offset) = (var("CARVE_CHUNK_SIZE"), var("CARVE_CHUNK_OFFSET"));
    let (mut chunk, mut base): (carve_chunk_t, *mut c_void) = (ptr::null_mut(), ptr::null_mut());
    // SAFETY: descriptor 0 is the parent's chunk, open for this process; outputs writable.
    let code = unsafe { carve_vm_import_chunk(0, size, 0, &mut chunk, &mut base) };
    assert_eq!(code, OK, "{}", last());
    assert!(!chunk.is_null() && !base.is_null());
    let at = base as u64 + offset as u64;
    let mut host = vec![0u8; LEN];
    Device::get(0).unwrap().bind().unwrap();
    // SAFETY: the chunk maps `size` bytes and the parent's block lies within it; synchronous
    // copies, while the parent waits for this process.
    unsafe {
        cu::memcpy_dtoh_sync(&mut host, at).unwrap();
        cu::memset_d8_sync(at, CHILD_BYTE, LEN).unwrap();
    }
    let bad = (0..LEN).find(|&i| host[i] != parent_byte(i));
    assert_eq!(
        bad, None,
        "the parent's bytes, read through the imported chunk"
    );
    assert_eq!(carve_vm_chunk_release(chunk), OK, "{}", last());
    assert_eq!(carve_vm_chunk_release(chunk), INVALID_HANDLE);
    println!("CHUNK-CHILD-OK");
}
