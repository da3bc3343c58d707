//! The device heap on the GPU, at 2^24 threads: no block shared, exact exhaustion, reuse after
//! exhaustion, and regions reserved from three kinds of memory. Skips without a GPU.

use std::sync::Arc;

use carve::heap::HeapStats;
use carve::resource::PoolOptions;
use carve::{
    AsyncMemoryResource, CudaMemoryResource, Device, DeviceHeap, DeviceVec, ManagedMemoryResource,
    PoolMemoryResource, SharedResource, Stream,
};
use carve_lab::heap::HeapKernels;

const N: u64 = 1 << 24;

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
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
fn slab_exhaustion_is_exact_on_four_resources() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let pool = PoolMemoryResource::new(CudaMemoryResource::new(&dev), PoolOptions::new(0)).unwrap();
    let resources: Vec<(&str, SharedResource)> = vec![
        ("cuda", cuda(&dev)),
        (
            "driver pool",
            Arc::new(AsyncMemoryResource::default_pool(&dev).unwrap()),
        ),
        (
            "managed",
            Arc::new(ManagedMemoryResource::new(&dev).unwrap()),
        ),
        ("carve pool", Arc::new(pool)),
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

/// `carve_heap_bump_alloc_block`'s request for thread `i` (see `block_request` in the kernels).
fn block_request(i: u64, bytes: u64, mixed: bool) -> u64 {
    match mixed {
        false => bytes,
        true if i % 7 == 3 => 0,
        true => bytes * (1 + i % 5),
    }
}

#[test]
fn bump_block_serves_each_block_whole_or_not_at_all() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let k = HeapKernels::new(&stream);
    let p = ptrs(&stream, &dev, N);
    for mixed in [false, true] {
        let (bytes, align) = (32u64, 32u64);
        let want: Vec<u64> = (0..N).map(|i| block_request(i, bytes, mixed)).collect();
        let total: u64 = want.iter().sum();
        let asked = want.iter().filter(|&&w| w != 0).count() as u64;
        let launch = |heap: &DeviceHeap| {
            let mode = u32::from(mixed);
            // SAFETY: p holds N u64s; the heap outlives the launch (the copies below wait).
            unsafe { k.bump_alloc_block(N, heap.device_ptr(), p.as_ptr(), N, bytes, align, mode) }
                .unwrap();
        };
        let heap = DeviceHeap::bump(cuda(&dev), &stream, total * 5 / 4).unwrap();
        launch(&heap);
        let got = p.to_vec().unwrap();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        for (i, (&a, &w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a != 0, w != 0, "thread {i} asked {w} bytes, got {a:#x}");
            if w != 0 {
                assert_eq!(a % align, 0, "thread {i}: {a:#x} not aligned");
                ranges.push((a, a + w));
            }
        }
        ranges.sort_unstable();
        assert!(
            ranges.windows(2).all(|r| r[0].1 <= r[1].0),
            "ranges overlap"
        );
        // Every range holds its thread's pattern (over the smallest request).
        // SAFETY: every live range is at least `bytes` long and owned by its thread.
        unsafe { k.pattern_fill(N, p.as_ptr(), N, bytes) }.unwrap();
        assert_eq!(bad_count(&k, &p, N, bytes), 0, "mixed {mixed}");
        let s = heap.stats().unwrap();
        assert_eq!(s.failed_allocs, 0, "{s:?}");
        assert!(s.in_use >= total && s.in_use <= total * 5 / 4, "{s:?}");

        // Exhaustion: room for about half; a block is served whole or not at all.
        let small = DeviceHeap::bump(cuda(&dev), &stream, total / 2).unwrap();
        launch(&small);
        let got = p.to_vec().unwrap();
        let mut served = 0u64;
        for (b, chunk) in got.chunks(256).enumerate() {
            let wants = &want[b * 256..b * 256 + chunk.len()];
            let live = chunk.iter().filter(|&&a| a != 0).count();
            let asked_here = wants.iter().filter(|&&w| w != 0).count();
            assert!(
                live == 0 || live == asked_here,
                "block {b}: {live} of {asked_here} served"
            );
            served += live as u64;
        }
        assert!(served > 0 && served < asked, "served {served} of {asked}");
        let s = small.stats().unwrap();
        assert_eq!(s.failed_allocs, asked - served, "{s:?}");
    }
}

#[test]
fn slab_blocks_are_aligned_to_their_size_over_a_256_byte_resource() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let k = HeapKernels::new(&stream);
    for block in [512u64, 1024, 4096] {
        let n = 4096;
        let heap = DeviceHeap::slab(cuda(&dev), &stream, n, block).unwrap();
        let p = ptrs(&stream, &dev, n);
        // SAFETY: p holds n pointer slots; the heap outlives the launch (to_vec waits).
        unsafe { k.slab_alloc(n, heap.device_ptr(), p.as_ptr(), n) }.unwrap();
        let live = live_sorted(&p);
        assert_eq!(live.len() as u64, n, "block {block}");
        assert!(
            live.iter().all(|a| a % block == 0),
            "block {block}: misaligned"
        );
        assert!(
            live.windows(2).all(|w| w[1] - w[0] >= block),
            "block {block}: overlap"
        );
    }
}
