//! The device heap on the GPU, at 2^24 threads: no block shared, exact exhaustion, reuse after
//! exhaustion, and regions reserved from three kinds of memory. Skips without a GPU.

use std::ptr::NonNull;
use std::sync::Arc;

use carve::heap::{HeapKernels, HeapStats};
use carve::resource::Properties;
use carve::{
    CudaMemoryResource, Device, DeviceHeap, DeviceVec, MemoryResource, SharedResource, Stream,
    StreamRef,
};
use cudarc::driver::{result, sys};

const N: u64 = 1 << 24;

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

/// The driver's default pool, stream-ordered (`cuMemAllocAsync`): test-only, to reserve a heap
/// from a second kind of resource.
#[derive(Debug)]
struct DriverPool;
// SAFETY: the driver returns distinct, live, 256-byte-aligned blocks; frees are stream-ordered.
unsafe impl MemoryResource for DriverPool {
    fn allocate(
        &self,
        stream: StreamRef,
        bytes: usize,
        _align: usize,
    ) -> carve::Result<NonNull<u8>> {
        // SAFETY: the test binds the context first; the stream is live.
        let p = unsafe { result::malloc_async(stream.as_raw(), bytes) }
            .map_err(|e| carve::Error::InvalidArgument(format!("cuMemAllocAsync: {e:?}")))?;
        NonNull::new(p as *mut u8).ok_or(carve::Error::ZeroSize)
    }
    unsafe fn deallocate(
        &self,
        stream: StreamRef,
        ptr: NonNull<u8>,
        _: usize,
        _: usize,
    ) -> carve::Result<()> {
        // SAFETY: ptr came from cuMemAllocAsync.
        unsafe { result::free_async(ptr.as_ptr() as u64, stream.as_raw()) }
            .map_err(|e| carve::Error::InvalidArgument(format!("cuMemFreeAsync: {e:?}")))
    }
    fn properties(&self) -> Properties {
        Properties::DEVICE
    }
}

/// Managed memory (`cuMemAllocManaged`): test-only, the third kind.
#[derive(Debug)]
struct Managed;
// SAFETY: as for DriverPool; cuMemFree waits for the device.
unsafe impl MemoryResource for Managed {
    fn allocate(&self, _: StreamRef, bytes: usize, _align: usize) -> carve::Result<NonNull<u8>> {
        // SAFETY: a context is current (the test binds it).
        let p =
            unsafe { result::malloc_managed(bytes, sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL) }
                .map_err(|e| carve::Error::InvalidArgument(format!("cuMemAllocManaged: {e:?}")))?;
        NonNull::new(p as *mut u8).ok_or(carve::Error::ZeroSize)
    }
    unsafe fn deallocate(
        &self,
        _: StreamRef,
        ptr: NonNull<u8>,
        _: usize,
        _: usize,
    ) -> carve::Result<()> {
        // SAFETY: ptr came from cuMemAllocManaged.
        unsafe { result::free_sync(ptr.as_ptr() as u64) }
            .map_err(|e| carve::Error::InvalidArgument(format!("cuMemFree: {e:?}")))
    }
    fn properties(&self) -> Properties {
        Properties::BOTH
    }
}

fn ptrs(stream: &Stream, dev: &Device, n: u64) -> DeviceVec<u64> {
    DeviceVec::zeroed(n as usize, stream, cuda(dev)).unwrap()
}

fn bad_count(k: &HeapKernels<'_>, p: &DeviceVec<u64>, n: u64, bytes: u64) -> u32 {
    let dev = k.device().clone();
    let bad = DeviceVec::<u32>::zeroed(1, p.buffer().stream(), cuda(&dev)).unwrap();
    // SAFETY: p holds n pointers to blocks of `bytes`; bad is one u32.
    unsafe { k.pattern_check(n, p.as_ptr(), n, bytes, bad.as_ptr()) }.unwrap();
    bad.to_vec().unwrap()[0]
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
fn slab_patterns_survive_mixed_rounds_at_2_24_threads() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let bytes = 64;
    let heap = DeviceHeap::slab(cuda(&dev), &stream, N + N / 2, bytes).unwrap();
    let k = HeapKernels::new(&stream);
    let p = ptrs(&stream, &dev, N);
    // SAFETY: p holds N u64s; heap is a live slab.
    unsafe { k.slab_alloc(N, heap.device_ptr(), p.as_ptr(), N) }.unwrap();
    let live = live_sorted(&p);
    assert_eq!(live.len() as u64, N, "1.5x capacity serves every thread");
    assert!(
        live.windows(2).all(|w| w[1] - w[0] >= bytes),
        "blocks overlap"
    );
    // SAFETY: every pointer is a 64-byte block owned by its thread.
    unsafe { k.pattern_fill(N, p.as_ptr(), N, bytes) }.unwrap();
    assert_eq!(bad_count(&k, &p, N, bytes), 0);
    let bad = DeviceVec::<u32>::zeroed(1, &stream, cuda(&dev)).unwrap();
    for round in 0..6 {
        // SAFETY: as above.
        unsafe {
            k.slab_churn(
                N,
                heap.device_ptr(),
                p.as_ptr(),
                N,
                bytes,
                round,
                bad.as_ptr(),
            )
        }
        .unwrap();
        assert_eq!(bad_count(&k, &p, N, bytes), 0, "round {round}");
    }
    assert_eq!(
        bad.to_vec().unwrap()[0],
        0,
        "a pattern was overwritten while held"
    );
    let live = live_sorted(&p);
    assert!(
        live.windows(2).all(|w| w[0] != w[1]),
        "a block is held twice"
    );
    let s = heap.stats().unwrap();
    assert_eq!(s.in_use, live.len() as u64);
    // SAFETY: frees each held block once.
    unsafe { k.slab_free(N, heap.device_ptr(), p.as_ptr(), N) }.unwrap();
    let s = heap.stats().unwrap();
    assert_eq!(
        (s.in_use, s.double_frees, s.foreign_frees),
        (0, 0, 0),
        "{s:?}"
    );
    assert!(s.high_water >= N);
}

fn exhaustion(heap: &DeviceHeap, stream: &Stream, dev: &Device) -> HeapStats {
    let cap = heap.capacity();
    let k = HeapKernels::new(stream);
    let p = ptrs(stream, dev, 2 * cap);
    // SAFETY: p holds 2K u64s.
    unsafe { k.slab_alloc(2 * cap, heap.device_ptr(), p.as_ptr(), 2 * cap) }.unwrap();
    let mut live = live_sorted(&p);
    assert_eq!(live.len() as u64, cap, "exactly K of 2K succeed");
    live.dedup();
    assert_eq!(live.len() as u64, cap, "no block twice");
    let s = heap.stats().unwrap();
    assert_eq!((s.in_use, s.failed_allocs), (cap, cap), "{s:?}");
    // SAFETY: frees each block once (nulls are skipped).
    unsafe { k.slab_free(2 * cap, heap.device_ptr(), p.as_ptr(), 2 * cap) }.unwrap();
    let s = heap.stats().unwrap();
    assert_eq!(s.in_use, 0, "{s:?}");
    // Usable after exhaustion: K again.
    let q = ptrs(stream, dev, cap);
    // SAFETY: q holds K u64s.
    unsafe { k.slab_alloc(cap, heap.device_ptr(), q.as_ptr(), cap) }.unwrap();
    assert_eq!(live_sorted(&q).len() as u64, cap);
    // SAFETY: as above.
    unsafe { k.slab_free(cap, heap.device_ptr(), q.as_ptr(), cap) }.unwrap();
    heap.stats().unwrap()
}

#[test]
fn slab_exhaustion_is_exact_on_three_resources() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    dev.bind().unwrap();
    let resources: Vec<(&str, SharedResource)> = vec![
        ("cuda", cuda(&dev)),
        ("driver pool", Arc::new(DriverPool)),
        ("managed", Arc::new(Managed)),
    ];
    for (name, r) in resources {
        let heap = DeviceHeap::slab(r, &stream, N / 2, 16).unwrap();
        let s = exhaustion(&heap, &stream, &dev);
        assert_eq!(
            (s.in_use, s.double_frees, s.foreign_frees),
            (0, 0, 0),
            "{name}: {s:?}"
        );
        eprintln!("{name}: {s:?}");
    }
}

#[test]
fn slab_grows_between_launches_and_counts_bad_frees() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let mut heap = DeviceHeap::slab(cuda(&dev), &stream, 1 << 16, 32).unwrap();
    let k = HeapKernels::new(&stream);
    let n = 1u64 << 17;
    let p = ptrs(&stream, &dev, n);
    // SAFETY: p holds n u64s.
    unsafe { k.slab_alloc(n, heap.device_ptr(), p.as_ptr(), n) }.unwrap();
    assert_eq!(live_sorted(&p).len(), 1 << 16);
    heap.grow(1 << 16).unwrap();
    let q = ptrs(&stream, &dev, n);
    // SAFETY: as above.
    unsafe { k.slab_alloc(n, heap.device_ptr(), q.as_ptr(), n) }.unwrap();
    assert_eq!(live_sorted(&q).len(), 1 << 16, "the new segment serves");
    let mut all = live_sorted(&p);
    all.extend(live_sorted(&q));
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 1 << 17);
    // SAFETY: frees p's blocks twice (the second time counted), then q's once.
    unsafe {
        k.slab_free(n, heap.device_ptr(), p.as_ptr(), n).unwrap();
        k.slab_free(n, heap.device_ptr(), p.as_ptr(), n).unwrap();
        k.slab_free(n, heap.device_ptr(), q.as_ptr(), n).unwrap();
    }
    let s = heap.stats().unwrap();
    assert_eq!(s.capacity, 1 << 17);
    assert_eq!(
        (s.in_use, s.double_frees, s.foreign_frees),
        (0, 1 << 16, 0),
        "{s:?}"
    );
}

#[test]
fn bump_serves_aligned_disjoint_ranges_and_resets() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let bytes = 48u64;
    // Room for every thread plus chunk tails: each slot wastes under one warp's request per
    // chunk, and up to one chunk at the end.
    let cap = N * 64 * 5 / 4;
    let heap = DeviceHeap::bump(cuda(&dev), &stream, cap).unwrap();
    let k = HeapKernels::new(&stream);
    let p = ptrs(&stream, &dev, N);
    for round in 0..2 {
        // SAFETY: p holds N u64s.
        unsafe { k.bump_alloc(N, heap.device_ptr(), p.as_ptr(), N, bytes, 64) }.unwrap();
        let live = live_sorted(&p);
        assert_eq!(live.len() as u64, N, "round {round}");
        assert!(live.iter().all(|a| a % 64 == 0));
        assert!(
            live.windows(2).all(|w| w[1] - w[0] >= bytes),
            "ranges overlap"
        );
        // SAFETY: 48-byte ranges owned by their threads.
        unsafe { k.pattern_fill(N, p.as_ptr(), N, bytes) }.unwrap();
        assert_eq!(bad_count(&k, &p, N, bytes), 0);
        let s = heap.stats().unwrap();
        assert!(s.in_use >= N * bytes && s.in_use <= cap, "{s:?}");
        heap.reset().unwrap();
        assert_eq!(heap.stats().unwrap().in_use, 0);
    }
    // Exhaustion: 2^24 × 64 B into a 2^24 × 48 B arena.
    let small = DeviceHeap::bump(cuda(&dev), &stream, N * 48).unwrap();
    // SAFETY: as above.
    unsafe { k.bump_alloc(N, small.device_ptr(), p.as_ptr(), N, 64, 64) }.unwrap();
    let got = live_sorted(&p).len() as u64;
    assert!((N * 48 / 64 * 9 / 10..N).contains(&got), "got {got}");
    let s = small.stats().unwrap();
    assert_eq!(s.failed_allocs, N - got);
}
