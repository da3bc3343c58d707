//! IPC between two processes on one GPU: this test binary re-executes itself as the child (an
//! ignored test, run with `--ignored`). For a driver pool, the child imports the parent's pool
//! from a file descriptor and one block of it from exported pointer data; for the virtual-memory
//! resource, it maps the parent's chunk from a file descriptor. Either way it checks what the
//! parent wrote and overwrites it for the parent to check.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::process::Command;
use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::{
    CudaBackingOptions, ImportedChunk, ImportedPool, PointerExport, VirtualMemoryResource,
    VirtualOptions,
};
use carve::{
    AsyncMemoryResource, AsyncPoolOptions, Device, DeviceBuffer, Error, MemoryResource, StreamRef,
};

const LEN: usize = 1 << 20;
const CHILD_BYTE: u8 = 0xab;

fn parent_byte(i: usize) -> u8 {
    (i * 13 + 5) as u8
}

#[test]
fn a_pool_and_a_block_shared_with_a_child_process() {
    let dev = carve::require_gpu!();
    let mr = match AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new().ipc_export(true)) {
        Ok(mr) => mr,
        Err(Error::Unsupported(why)) => {
            eprintln!("SKIPPED pool IPC: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let stream = dev.new_stream().unwrap();
    let data: Vec<u8> = (0..LEN).map(parent_byte).collect();
    let buf = DeviceBuffer::from_slice(&data, &stream, Arc::new(mr.clone())).unwrap();
    // The child reads the bytes, so the allocation and the copy must be done first.
    stream.synchronize().unwrap();
    let export = mr
        .export_pointer(NonNull::new(buf.as_ptr() as *mut u8).unwrap())
        .unwrap();
    let fd = mr.export_fd().unwrap();
    run_child("ipc_child", &fd, &[("CARVE_IPC_PTR", export.to_hex())]);
    // The child's writes are visible here.
    assert!(buf.to_host_vec().unwrap().iter().all(|&b| b == CHILD_BYTE));
    // Exporting a pointer the pool does not own is an error, not a crash.
    assert!(mr
        .export_pointer(NonNull::new(0x1000 as *mut u8).unwrap())
        .is_err());
    let plain = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    assert!(matches!(
        plain.export_pointer(NonNull::new(buf.as_ptr() as *mut u8).unwrap()),
        Err(Error::Unsupported(_))
    ));
    buf.free().unwrap();
}

/// The child side; runs only when the parent re-executes this binary with `--ignored`.
#[test]
#[ignore = "the child process of a_pool_and_a_block_shared_with_a_child_process"]
fn ipc_child() {
    let fd: i32 = std::env::var("CARVE_IPC_FD")
        .expect("run by the parent test")
        .parse()
        .unwrap();
    let export = PointerExport::from_hex(&std::env::var("CARVE_IPC_PTR").unwrap()).unwrap();
    let dev = Device::get(0).unwrap();
    // SAFETY: the parent passed this descriptor open across exec; it lives for this process.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let pool = ImportedPool::from_fd(&dev, fd).unwrap();
    // SAFETY: the parent keeps the block allocated until this process exits, and waits for
    // this process before touching the block again.
    let ptr = unsafe { pool.import_pointer(&export) }.unwrap();
    let mut host = vec![0u8; LEN];
    dev.bind().unwrap();
    // SAFETY: the imported block holds LEN bytes; synchronous copies.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut host, ptr.as_ptr()).unwrap();
        cudarc::driver::result::memset_d8_sync(ptr.as_ptr(), CHILD_BYTE, LEN).unwrap();
    }
    let bad = (0..LEN).find(|&i| host[i] != parent_byte(i));
    assert_eq!(
        bad, None,
        "the parent's bytes, read through the imported pointer"
    );
    ptr.free(StreamRef::DEFAULT).unwrap();
    dev.synchronize().unwrap();
    println!("IPC-CHILD-OK");
}

/// Runs this binary's ignored test `name` as a child process with `fd` inherited and `env`;
/// panics unless it prints `IPC-CHILD-OK`.
fn run_child(name: &str, fd: &std::os::fd::OwnedFd, env: &[(&str, String)]) {
    // The child inherits the descriptor under the same number.
    // SAFETY: clears FD_CLOEXEC on a descriptor we own; no memory is involved.
    assert_eq!(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) }, 0);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CARVE_IPC_FD", fd.as_raw_fd().to_string())
        .envs(env.iter().map(|(k, v)| (k, v)))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("IPC-CHILD-OK"),
        "child failed: {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );
}

#[test]
fn a_virtual_memory_chunk_shared_with_a_child_process() {
    let dev = carve::require_gpu!();
    let backing = CudaBackingOptions {
        exportable: true,
        ..CudaBackingOptions::default()
    };
    let mr = match VirtualMemoryResource::on_device(&dev, backing, VirtualOptions::new()) {
        Ok(mr) => mr,
        Err(Error::Unsupported(why)) => {
            eprintln!("SKIPPED virtual-memory chunk IPC: {why}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let p = mr.allocate_sync(LEN, 256).unwrap();
    let data: Vec<u8> = (0..LEN).map(parent_byte).collect();
    dev.bind().unwrap();
    // SAFETY: `p` is a live block of LEN bytes; a synchronous copy.
    unsafe { cudarc::driver::result::memcpy_htod_sync(p.as_ptr() as u64, &data) }.unwrap();
    let (fd, start, size) = mr.export_chunk(p).unwrap();
    let offset = p.as_ptr() as usize - start;
    assert!(offset + LEN <= size, "the block lies in one chunk");
    run_child(
        "ipc_chunk_child",
        &fd,
        &[
            ("CARVE_IPC_SIZE", size.to_string()),
            ("CARVE_IPC_OFFSET", offset.to_string()),
        ],
    );
    let mut host = vec![0u8; LEN];
    // SAFETY: as above.
    unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut host, p.as_ptr() as u64) }.unwrap();
    assert!(host.iter().all(|&b| b == CHILD_BYTE), "the child's writes");
    // Bad imports are errors, not crashes: a size of zero, one off the granularity, and a
    // descriptor that is no chunk.
    let fd = fd.as_fd();
    assert!(matches!(
        ImportedChunk::import(&dev, fd, 0),
        Err(Error::ZeroSize)
    ));
    assert!(ImportedChunk::import(&dev, fd, size + 1).is_err());
    let not_a_chunk = std::fs::File::open("/dev/null").unwrap();
    assert!(ImportedChunk::import(&dev, not_a_chunk.as_fd(), size).is_err());
    // SAFETY: from `mr` with these arguments.
    unsafe { mr.deallocate_sync(p, LEN, 256) }.unwrap();
}

/// The child side of `a_virtual_memory_chunk_shared_with_a_child_process`.
#[test]
#[ignore = "the child process of a_virtual_memory_chunk_shared_with_a_child_process"]
fn ipc_chunk_child() {
    let var = |k: &str| -> usize {
        std::env::var(k)
            .expect("run by the parent test")
            .parse()
            .unwrap()
    };
    let (fd, size, offset) = (
        var("CARVE_IPC_FD") as i32,
        var("CARVE_IPC_SIZE"),
        var("CARVE_IPC_OFFSET"),
    );
    let dev = Device::get(0).unwrap();
    // SAFETY: the parent passed this descriptor open across exec; it lives for this process.
    let fd = unsafe { BorrowedFd::borrow_raw(fd) };
    let chunk = ImportedChunk::import(&dev, fd, size).unwrap();
    assert_eq!(chunk.len(), size);
    let at = chunk.as_ptr().as_ptr() as u64 + offset as u64;
    let mut host = vec![0u8; LEN];
    dev.bind().unwrap();
    // SAFETY: the chunk maps `size` bytes and the parent's block lies within it; synchronous
    // copies, while the parent waits for this process.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_sync(&mut host, at).unwrap();
        cudarc::driver::result::memset_d8_sync(at, CHILD_BYTE, LEN).unwrap();
    }
    let bad = (0..LEN).find(|&i| host[i] != parent_byte(i));
    assert_eq!(
        bad, None,
        "the parent's bytes, read through the imported chunk"
    );
    drop(chunk);
    println!("IPC-CHILD-OK");
}
