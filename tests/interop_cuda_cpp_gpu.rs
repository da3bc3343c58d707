//! A CUDA C++ kernel (tests/interop/alloc_kernel.cu, which includes kernels/carve_heap.h) is
//! compiled with `nvcc -rdc=true -ptx`, JIT-linked with carve's PTX, and allocates and frees from
//! heaps that Rust's `DeviceHeap` created. Skips without a GPU (failing under
//! CARVE_REQUIRE_GPU=1), and without nvcc (whatever CARVE_REQUIRE_GPU says: that is a missing
//! toolkit, not a missing GPU).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use carve::driver::{LinkedModule, PtxInput};
use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, SharedResource, Stream};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Embedded so that the test needs no source tree at run time (it runs on another machine).
const KERNEL_CU: &str = include_str!("interop/alloc_kernel.cu");
const HEADER: &str = include_str!("../kernels/carve_heap.h");

const BLOCK: u32 = 256;

/// nvcc from PATH, then $CUDA_HOME/bin, $CUDA_PATH/bin and /usr/local/cuda/bin.
fn find_nvcc() -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let homes = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(|h| Path::new(&h).join("bin"));
    std::env::split_paths(&path)
        .chain(homes)
        .chain([PathBuf::from("/usr/local/cuda/bin")])
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

/// nvcc, or `None` after printing why the test skips.
fn nvcc_or_skip() -> Option<PathBuf> {
    let nvcc = find_nvcc();
    if nvcc.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {}: nvcc not found (searched PATH, $CUDA_HOME/bin, $CUDA_PATH/bin, \
             /usr/local/cuda/bin). This needs the CUDA toolkit, not only a GPU, so \
             CARVE_REQUIRE_GPU=1 does not turn it into a failure.",
            carve::testing::test_name()
        );
    }
    nvcc
}

/// The kernel compiled to relocatable PTX for `dev`'s architecture (once per process).
fn kernel_ptx(nvcc: &Path, dev: &Device) -> &'static str {
    static PTX: OnceLock<String> = OnceLock::new();
    PTX.get_or_init(|| {
        let (major, minor) = dev.properties().unwrap().compute_capability;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("carve_heap.h"), HEADER).unwrap();
        let src = dir.path().join("alloc_kernel.cu");
        std::fs::write(&src, KERNEL_CU).unwrap();
        let out = dir.path().join("alloc_kernel.ptx");
        let arch = format!("-arch=sm_{major}{minor}");
        let result = Command::new(nvcc)
            .args(["-rdc=true", "-ptx", &arch, "-I"])
            .arg(dir.path())
            .arg("-o")
            .arg(&out)
            .arg(&src)
            .output()
            .unwrap();
        assert!(
            result.status.success(),
            "nvcc {arch} failed:\n{}",
            String::from_utf8_lossy(&result.stderr)
        );
        eprintln!("nvcc {arch}: compiled alloc_kernel.cu");
        std::fs::read_to_string(out).unwrap()
    })
}

fn linked(dev: &Device) -> Option<LinkedModule> {
    let nvcc = nvcc_or_skip()?;
    let ptx = kernel_ptx(&nvcc, dev);
    let module = LinkedModule::link(
        dev,
        &[PtxInput::new("alloc_kernel.ptx", ptx), PtxInput::carve()],
    )
    .unwrap_or_else(|e| panic!("linking with carve's PTX: {e}"));
    Some(module)
}

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

fn grid(n: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as u64) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `kernel` over `n` threads with `args` (all `u64`), and waits for it.
fn launch(module: &LinkedModule, stream: &Stream, kernel: &str, n: u64, args: &[u64]) {
    let f = module.function(kernel).unwrap();
    let mut b = stream.cudarc().launch_builder(&f);
    for a in args {
        b.arg(a);
    }
    // SAFETY: every kernel in alloc_kernel.cu takes only 64-bit arguments, in this order; the
    // pointers are live device allocations of the sizes the kernel reads.
    unsafe { b.launch(grid(n)) }.unwrap();
    stream.synchronize().unwrap();
}

fn live_sorted(p: &DeviceVec<u64>) -> Vec<u64> {
    let mut v: Vec<u64> = p
        .to_vec()
        .unwrap()
        .into_iter()
        .filter(|&x| x != 0)
        .collect();
    v.sort_unstable();
    v
}

#[test]
fn cpp_kernel_allocates_and_frees_from_a_rust_slab() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let Some(module) = linked(&dev) else { return };
    let (k, bytes) = (1u64 << 20, 64u64);
    let heap = DeviceHeap::slab(cuda(&dev), &stream, k, bytes).unwrap();
    let bad = DeviceVec::<u32>::zeroed(1, &stream, cuda(&dev)).unwrap();

    // 2K threads ask a heap of K blocks: exactly K succeed, each block once.
    let n = 2 * k;
    let p = DeviceVec::<u64>::zeroed(n as usize, &stream, cuda(&dev)).unwrap();
    let h = heap.device_ptr();
    launch(
        &module,
        &stream,
        "cpp_slab_alloc_fill",
        n,
        &[h, p.as_ptr(), n, bytes],
    );
    let live = live_sorted(&p);
    assert_eq!(live.len() as u64, k, "exactly K of 2K succeed");
    assert!(
        live.windows(2).all(|w| w[1] - w[0] >= bytes),
        "blocks overlap"
    );
    assert!(
        live.iter().all(|a| a % bytes == 0),
        "64-byte blocks are 64-aligned"
    );
    let s = heap.stats().unwrap();
    eprintln!("after {n} C++ allocations: {s:?}");
    assert_eq!((s.in_use, s.failed_allocs), (k, k), "{s:?}");

    let args = [h, p.as_ptr(), n, bytes, bad.as_ptr()];
    launch(&module, &stream, "cpp_slab_check_free", n, &args);
    assert_eq!(bad.to_vec().unwrap()[0], 0, "a pattern was overwritten");
    let s = heap.stats().unwrap();
    eprintln!("after the C++ frees: {s:?}");
    assert_eq!(
        (s.in_use, s.failed_allocs, s.double_frees, s.foreign_frees),
        (0, k, 0, 0),
        "{s:?}"
    );

    // Usable after exhaustion: K threads all succeed, and free again.
    let q = DeviceVec::<u64>::zeroed(k as usize, &stream, cuda(&dev)).unwrap();
    launch(
        &module,
        &stream,
        "cpp_slab_alloc_fill",
        k,
        &[h, q.as_ptr(), k, bytes],
    );
    assert_eq!(live_sorted(&q).len() as u64, k);
    launch(
        &module,
        &stream,
        "cpp_slab_check_free",
        k,
        &[h, q.as_ptr(), k, bytes, bad.as_ptr()],
    );
    assert_eq!(bad.to_vec().unwrap()[0], 0);
    let s = heap.stats().unwrap();
    eprintln!("after a second round of K: {s:?}");
    assert_eq!((s.in_use, s.failed_allocs), (0, k), "{s:?}");
    assert!(s.high_water >= k);
}

#[test]
fn cpp_kernel_bump_allocates_from_a_rust_arena() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let Some(module) = linked(&dev) else { return };
    let (n, bytes, align) = (1u64 << 20, 48u64, 64u64);
    let bad = DeviceVec::<u32>::zeroed(1, &stream, cuda(&dev)).unwrap();
    let p = DeviceVec::<u64>::zeroed(n as usize, &stream, cuda(&dev)).unwrap();

    // Room for every thread plus chunk tails.
    let heap = DeviceHeap::bump(cuda(&dev), &stream, n * 64 * 5 / 4).unwrap();
    let h = heap.device_ptr();
    launch(
        &module,
        &stream,
        "cpp_bump_alloc_fill",
        n,
        &[h, p.as_ptr(), n, bytes, align],
    );
    let live = live_sorted(&p);
    assert_eq!(live.len() as u64, n);
    assert!(
        live.windows(2).all(|w| w[1] - w[0] >= bytes),
        "ranges overlap"
    );
    launch(
        &module,
        &stream,
        "cpp_bump_check",
        n,
        &[p.as_ptr(), n, bytes, align, bad.as_ptr()],
    );
    assert_eq!(bad.to_vec().unwrap()[0], 0, "misaligned or overwritten");
    let s = heap.stats().unwrap();
    eprintln!("bump after {n} C++ allocations of {bytes} B: {s:?}");
    assert!(s.in_use >= n * bytes && s.in_use <= s.capacity, "{s:?}");
    assert_eq!(s.failed_allocs, 0);
    heap.reset().unwrap();
    assert_eq!(heap.stats().unwrap().in_use, 0);

    // Over capacity: n × 64 B into n × 48 B; every refusal is counted.
    let small = DeviceHeap::bump(cuda(&dev), &stream, n * 48).unwrap();
    let args = [small.device_ptr(), p.as_ptr(), n, 64, align];
    launch(&module, &stream, "cpp_bump_alloc_fill", n, &args);
    let got = live_sorted(&p).len() as u64;
    let s = small.stats().unwrap();
    eprintln!("bump over capacity: {got} of {n} served, {s:?}");
    assert!((n * 48 / 64 * 9 / 10..n).contains(&got), "got {got}");
    assert_eq!(s.failed_allocs, n - got);
}
