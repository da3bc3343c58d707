//! GPU tests of the virtual-memory resource's and the expandable pool's default stream order:
//! built with `new` over a CUDA backing and no order given, a block freed on a held stream with
//! a write still queued must not reach another stream before that write is done. Each skips
//! (saying why) without a GPU, and fails instead under CARVE_REQUIRE_GPU=1.

use std::ptr::NonNull;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use carve::cudarc::driver::{result, sys};
use carve::resource::{CudaBacking, CudaBackingOptions, ExpandableOptions, VirtualOptions};
use carve::testing::Gate;
use carve::{
    require_gpu, Device, ExpandableMemoryResource, MemoryResource, Stream, VirtualMemoryResource,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

/// One test at a time: the resources synchronise the whole device, and each test holds a
/// stream.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How long the gate waits for the test's signal before it opens by itself: a resource that
/// waits for the held stream (as it must) blocks until then. Correctness never depends on it.
const SELF_OPEN: Duration = Duration::from_secs(2);

/// Writes `pattern(i) + delta` into `n` words at `ptr` on `s`.
fn fill(dev: &Device, s: &Stream, ptr: usize, n: usize, delta: u32) {
    let k = dev.test_kernels().unwrap();
    // SAFETY: `ptr` is a live device block of at least `n` words; the stream orders the writes.
    unsafe {
        k.smoke_fill(s, ptr as u64, n as u32).unwrap();
        k.smoke_add(s, ptr as u64, n as u32, delta).unwrap();
    }
}

/// `n` words at `ptr`, after all work on the device.
fn read(dev: &Device, ptr: usize, n: usize) -> Vec<u32> {
    dev.synchronize().unwrap();
    let mut out = vec![0u32; n];
    // SAFETY: `ptr` is a live device block of at least `n` words; the device is idle.
    unsafe { result::memcpy_dtoh_sync(&mut out, ptr as sys::CUdeviceptr) }.unwrap();
    out
}

/// Fills `mr` (at most `count` blocks of `bytes`) on stream A, then frees the first block on A
/// while a write into it waits behind a gate, and allocates `bytes` on stream B, which must
/// get that block (the only memory left) only after A's write. B's write must be what the block
/// holds once the gate is open.
fn gated_reuse<R: MemoryResource>(name: &str, dev: &Device, mr: &R, bytes: usize, count: usize) {
    const A_DELTA: u32 = 1;
    const B_DELTA: u32 = 2;
    let (sa, sb) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let words = bytes / 4;
    let blocks: Vec<usize> = (0..count)
        .map(|_| mr.allocate(sa.as_ref(), bytes, 256).unwrap().as_ptr() as usize)
        .collect();
    for &p in &blocks {
        fill(dev, &sa, p, words, 0);
    }
    sa.synchronize().unwrap();
    let x = blocks[0];
    let gate = Gate::hold(&sa).unwrap();
    fill(dev, &sa, x, words, A_DELTA);
    let (tx, rx) = mpsc::channel::<()>();
    let y = std::thread::scope(|scope| {
        let gate = &gate;
        scope.spawn(move || {
            let _ = rx.recv_timeout(SELF_OPEN);
            gate.open();
        });
        let ptr = NonNull::new(x as *mut u8).unwrap();
        // SAFETY: allocated above with these arguments, freed once; A's write is queued on A.
        unsafe { mr.deallocate(sa.as_ref(), ptr, bytes, 256) }.unwrap();
        let y = mr.allocate(sb.as_ref(), bytes, 256).unwrap().as_ptr() as usize;
        fill(dev, &sb, y, words, B_DELTA);
        // B's write is done before the gate opens: a block handed over too early is then
        // overwritten by A's.
        sb.synchronize().unwrap();
        let _ = tx.send(());
        y
    });
    assert_eq!(
        y, x,
        "{name}: the freed block must change streams for the test to mean anything"
    );
    let got = read(dev, y, words);
    for (i, &w) in got.iter().enumerate() {
        assert_eq!(
            w,
            pattern(i as u32).wrapping_add(B_DELTA),
            "{name}: word {i} of the block stream B got ({y:#x}; A freed {x:#x} with its write \
             still queued) is not B's"
        );
    }
    let free = |p: usize, s: &Stream| {
        // SAFETY: allocated above with these arguments, freed once; all work on it is done.
        unsafe { mr.deallocate(s.as_ref(), NonNull::new(p as *mut u8).unwrap(), bytes, 256) }
            .unwrap()
    };
    free(y, &sb);
    for &p in &blocks[1..] {
        free(p, &sa);
    }
    dev.synchronize().unwrap();
}

#[test]
fn virtual_memory_over_a_cuda_backing_orders_streams_by_default() {
    let _serial = serial();
    let dev = require_gpu!();
    let backing = CudaBacking::new(&dev, CudaBackingOptions::default()).unwrap();
    let page = carve::resource::PhysicalBacking::granularity(&backing);
    let count = 8;
    // Expandable mode: the block changes streams in place (whole-chunk blocks move its chunk).
    let options = VirtualOptions::expandable().maximum(count * page);
    let mr = VirtualMemoryResource::new(backing, options).unwrap();
    gated_reuse("VirtualMemoryResource", &dev, &mr, page, count);
    mr.check_invariants().unwrap();
}

#[test]
fn the_expandable_pool_over_a_cuda_backing_orders_streams_by_default() {
    let _serial = serial();
    let dev = require_gpu!();
    let backing = CudaBacking::new(&dev, CudaBackingOptions::default()).unwrap();
    let g = carve::resource::PhysicalBacking::granularity(&backing);
    // Blocks of the large range's page, filling the maximum.
    let (page, count) = (16 * g, 4);
    let options = ExpandableOptions {
        maximum: Some(count * page),
        ..ExpandableOptions::default()
    };
    let mr = ExpandableMemoryResource::new(backing, options).unwrap();
    gated_reuse("ExpandableMemoryResource", &dev, &mr, page, count);
    mr.check_invariants().unwrap();
}
