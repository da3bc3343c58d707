//! The kernels that only carve's benchmarks launch: ablations of the slab's orderings, the
//! launch and atomic floors, the general heap's benchmark forms and CUDA's in-kernel `malloc`
//! as the baseline. Built into the test module, as [`test_entry`](crate::test_entry) is.

use crate::entry;
use crate::general::bench_request_size;
use crate::heap_entry::{carve_free, carve_malloc};
use crate::heap_layout::{GeneralHeader, HeapHandle};
use crate::nvptx::{self, RelaxedWarp};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::test_entry::tid;

/// Ablation for the benchmark:
/// [`carve_heap_slab_alloc`](crate::test_entry::carve_heap_slab_alloc) with relaxed bitmap
/// atomics, to measure what the Acquire ordering costs. Not for use: see [`RelaxedWarp`].
///
/// # Safety
/// As for [`carve_heap_slab_alloc`](crate::test_entry::carve_heap_slab_alloc).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_slab_alloc_relaxed(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; `RelaxedWarp::<true>` is all 32 lanes.
        let p = unsafe {
            entry::slab_alloc(
                heap,
                &RelaxedWarp::<true>,
                &RelaxedWarp::<false>,
                nvptx::warp_index,
            )
        };
        // SAFETY: i < n.
        unsafe { out.add(i).write(p as u64) };
    }
}

/// Ablation: [`carve_heap_slab_free`](crate::test_entry::carve_heap_slab_free) with relaxed
/// bitmap atomics (see [`carve_bench_slab_alloc_relaxed`]).
///
/// # Safety
/// As for [`carve_heap_slab_free`](crate::test_entry::carve_heap_slab_free).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_slab_free_relaxed(
    heap: *const HeapHandle,
    ptrs: *const u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        let p = unsafe { ptrs.add(i).read() } as *mut u8;
        // SAFETY: forwarded contract.
        unsafe { entry::slab_free(heap, p, &RelaxedWarp::<true>, &RelaxedWarp::<false>) }
    }
}

/// The launch floor: does nothing.
#[no_mangle]
pub extern "ptx-kernel" fn carve_bench_empty() {}

/// The single-counter bump limit: one `atomicAdd` on `counter` per thread, result sunk.
///
/// # Safety
/// `counter` and `sink` are writable `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_atomic_add(
    counter: *mut u64,
    n: u64,
    bytes: u64,
    sink: *mut u64,
) {
    if tid(n).is_some() {
        // SAFETY: counter is a u64 in device memory.
        let v = unsafe { &*(counter as *const AtomicU64) }.fetch_add(bytes, Ordering::Relaxed);
        if v == u64::MAX {
            // SAFETY: sink is writable.
            unsafe { sink.write(v) };
        }
    }
}

extern "C" {
    /// CUDA's in-kernel `malloc`, resolved by the driver when the module loads.
    fn malloc(bytes: usize) -> *mut u8;
    /// CUDA's in-kernel `free`.
    fn free(ptr: *mut u8);
}

/// The baseline: thread `i < n` calls CUDA's in-kernel `malloc(bytes)` into `out[i]`.
///
/// # Safety
/// `out` holds `n` `u64`s; the context's malloc heap limit is set.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_malloc(out: *mut u64, n: u64, bytes: u64) {
    if let Some(i) = tid(n) {
        // SAFETY: device malloc has no preconditions; i < n.
        unsafe { out.add(i).write(malloc(bytes as usize) as u64) };
    }
}

/// Benchmark form of [`carve_malloc`] on mixed sizes: thread `i < n` allocates
/// [`bench_request_size`]`(i, seed, max)` bytes into `out[i]` (0 on failure), writing nothing
/// into the block.
///
/// # Safety
/// As for [`carve_malloc`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_general_malloc(
    heap: *const GeneralHeader,
    out: *mut u64,
    n: u64,
    max: u64,
    seed: u32,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract.
        let p = unsafe { carve_malloc(heap, bench_request_size(i as u64, seed, max)) };
        // SAFETY: i < n.
        unsafe { out.add(i).write(p as u64) };
    }
}

/// Benchmark: thread `i < n` allocates `bytes` (one size for every thread) from the general
/// heap at `heap` into `out[i]`, writing nothing into the block.
///
/// # Safety
/// As for [`carve_malloc`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_general_malloc_one(
    heap: *const GeneralHeader,
    out: *mut u64,
    n: u64,
    bytes: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract.
        let p = unsafe { carve_malloc(heap, bytes) };
        // SAFETY: i < n.
        unsafe { out.add(i).write(p as u64) };
    }
}

/// Benchmark form of [`carve_free`]: thread `i < n` frees `ptrs[i]` (0 is ignored).
///
/// # Safety
/// As for [`carve_free`]; `ptrs` holds what [`carve_bench_general_malloc`] wrote, each freed
/// once.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_general_free(
    heap: *const GeneralHeader,
    ptrs: *const u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        unsafe { carve_free(heap, ptrs.add(i).read() as *mut u8) };
    }
}

/// The baseline on mixed sizes: thread `i < n` calls CUDA's in-kernel `malloc` for
/// [`bench_request_size`]`(i, seed, max)` bytes into `out[i]`.
///
/// # Safety
/// `out` holds `n` `u64`s; the context's malloc heap limit is set.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_malloc_mixed(
    out: *mut u64,
    n: u64,
    max: u64,
    seed: u32,
) {
    if let Some(i) = tid(n) {
        let bytes = bench_request_size(i as u64, seed, max) as usize;
        // SAFETY: device malloc has no preconditions; i < n.
        unsafe { out.add(i).write(malloc(bytes) as u64) };
    }
}

/// The baseline's free: thread `i < n` frees `ptrs[i]` with CUDA's in-kernel `free`.
///
/// # Safety
/// Every `ptrs[i]` is null or from [`carve_bench_malloc`], freed once.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_free(ptrs: *const u64, n: u64) {
    if let Some(i) = tid(n) {
        // SAFETY: the caller's contract.
        unsafe { free(ptrs.add(i).read() as *mut u8) };
    }
}
