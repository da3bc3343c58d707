//! Rust kernels that use `alloc` over a device heap (`carve_kernels::global_alloc::CarveAlloc`):
//! each of 2^16 threads builds a `Vec<u32>`, sums it and drops it, on slab and bump heaps, sized
//! for every thread or too small. Skips without a GPU.

use std::sync::{Arc, Mutex, MutexGuard};

use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, SharedResource, Stream};
use carve_lab::heap::HeapKernels;

const N: u64 = 1 << 16;
/// Elements per Vec: 256 bytes, reserved as 128 and then grown to 256.
const LEN: u32 = 64;
const VEC_BYTES: u64 = LEN as u64 * 4;
/// What a failed thread writes.
const FAILED: u64 = u64::MAX;

/// The allocator's heap address is one global per loaded module, and every test here loads the
/// same one (the device's test module): launches with different heaps must not overlap, so the
/// tests take turns.
static ONE_HEAP_AT_A_TIME: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    ONE_HEAP_AT_A_TIME
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

/// Thread `i`'s sum: `i + (i + 1) + .. + (i + LEN - 1)`.
fn expected(i: u64) -> u64 {
    let len = LEN as u64;
    len * i + len * (len - 1) / 2
}

/// One launch of `carve_test_vec_sum` over `heap` with `n` threads: each one's sum, or
/// [`FAILED`].
fn vec_sums_of(heap: &DeviceHeap, stream: &Stream, dev: &Device, n: u64, keep: bool) -> Vec<u64> {
    let out = DeviceVec::<u64>::zeroed(n as usize, stream, cuda(dev)).unwrap();
    // SAFETY: `heap` is live until the sums are read back (to_vec waits for the stream); `out`
    // holds n u64s; `turn()` keeps other heaps' launches away.
    unsafe {
        HeapKernels::new(stream).vec_sum(n, heap.device_ptr(), out.as_ptr(), n, LEN, keep as u32)
    }
    .unwrap();
    out.to_vec().unwrap()
}

/// [`vec_sums_of`] with [`N`] threads.
fn vec_sums(heap: &DeviceHeap, stream: &Stream, dev: &Device, keep: bool) -> Vec<u64> {
    vec_sums_of(heap, stream, dev, N, keep)
}

/// (threads that failed, threads whose sum is wrong), checking every sum that is not a failure.
fn tally(sums: &[u64]) -> (u64, u64) {
    let failed = sums.iter().filter(|&&s| s == FAILED).count() as u64;
    let wrong = (0..)
        .zip(sums)
        .filter(|&(i, &s)| s != FAILED && s != expected(i))
        .count() as u64;
    (failed, wrong)
}

#[test]
fn slab_vec_sums_are_exact_and_every_block_is_freed() {
    let dev = carve::require_gpu!();
    let _turn = turn();
    let stream = dev.new_stream().unwrap();
    // One block per thread: each holds one at a time (the Vec grows in place within it).
    let heap = DeviceHeap::slab(cuda(&dev), &stream, N, VEC_BYTES).unwrap();
    for launch in 0..2 {
        let sums = vec_sums(&heap, &stream, &dev, false);
        assert_eq!(tally(&sums), (0, 0), "launch {launch}");
        let s = heap.stats().unwrap();
        assert_eq!(
            (s.in_use, s.failed_allocs, s.double_frees, s.foreign_frees),
            (0, 0, 0, 0),
            "launch {launch}: every Vec's block is back: {s:?}"
        );
        assert!(s.high_water > 0 && s.high_water <= N, "{s:?}");
    }
}

#[test]
fn bump_vec_sums_are_exact() {
    let dev = carve::require_gpu!();
    let _turn = turn();
    let stream = dev.new_stream().unwrap();
    // Per thread: 128 bytes, then 256 more when the Vec grows by a copy; room to spare for the
    // chunks that per-SM slots hold back.
    let per_thread = VEC_BYTES / 2 + VEC_BYTES;
    let heap = DeviceHeap::bump(cuda(&dev), &stream, 4 * N * per_thread).unwrap();
    let sums = vec_sums(&heap, &stream, &dev, false);
    assert_eq!(tally(&sums), (0, 0));
    let s = heap.stats().unwrap();
    assert_eq!(s.failed_allocs, 0, "{s:?}");
    assert!(s.in_use >= N * per_thread, "{s:?}");
}

#[test]
fn slab_too_small_fails_some_threads_and_serves_the_rest_exactly() {
    let dev = carve::require_gpu!();
    let _turn = turn();
    let stream = dev.new_stream().unwrap();
    let cap = N / 4;
    let heap = DeviceHeap::slab(cuda(&dev), &stream, cap, VEC_BYTES).unwrap();
    // Kept Vecs hold their blocks: exactly `cap` threads get one, the rest record a failure.
    let sums = vec_sums(&heap, &stream, &dev, true);
    assert_eq!(tally(&sums), (N - cap, 0));
    let s = heap.stats().unwrap();
    assert_eq!((s.in_use, s.failed_allocs), (cap, N - cap), "{s:?}");
    // Dropped Vecs free their blocks while others run: any thread may succeed or fail, no
    // launch traps, and every block comes back.
    heap.reset().unwrap();
    let sums = vec_sums(&heap, &stream, &dev, false);
    let (failed, wrong) = tally(&sums);
    assert_eq!(wrong, 0);
    assert!(failed < N, "{failed} of {N} threads failed on {cap} blocks");
    let s = heap.stats().unwrap();
    assert_eq!((s.in_use, s.failed_allocs), (0, failed), "{s:?}");
}

#[test]
fn slab_blocks_smaller_than_the_vec_refuse_it_without_trapping() {
    let dev = carve::require_gpu!();
    let _turn = turn();
    let stream = dev.new_stream().unwrap();
    // The first reserve fits a block; growing past it is refused before the heap sees it, and the
    // dropped Vec frees the block it had.
    let heap = DeviceHeap::slab(cuda(&dev), &stream, N, VEC_BYTES / 2).unwrap();
    let sums = vec_sums(&heap, &stream, &dev, false);
    assert_eq!(tally(&sums), (N, 0));
    let s = heap.stats().unwrap();
    assert_eq!(
        (s.in_use, s.failed_allocs, s.double_frees, s.foreign_frees),
        (0, 0, 0, 0),
        "{s:?}"
    );
}

#[test]
fn bump_too_small_fails_some_threads_and_serves_the_rest_exactly() {
    let dev = carve::require_gpu!();
    let _turn = turn();
    let stream = dev.new_stream().unwrap();
    // 2^14 threads ask 128 bytes each (2 MiB), then 256 more each (4 MiB) when their Vec grows
    // by a copy. 3 MiB (too small to chunk: every request takes the arena's one offset) holds
    // every first request, so some threads are served whatever the order, but not every
    // thread's second.
    let n = N / 4;
    let per_thread = VEC_BYTES / 2 + VEC_BYTES;
    let bytes = 3 << 20;
    let heap = DeviceHeap::bump(cuda(&dev), &stream, bytes).unwrap();
    let sums = vec_sums_of(&heap, &stream, &dev, n, false);
    let (failed, wrong) = tally(&sums);
    assert_eq!(wrong, 0);
    let served = n - failed;
    assert!(
        failed > 0 && served > 0 && served <= bytes / per_thread,
        "{served} of {n} threads served from {bytes} bytes"
    );
    let s = heap.stats().unwrap();
    // A failed thread stops at its first failed request.
    assert_eq!(s.failed_allocs, failed, "{s:?}");
}
