//! The device heap on the GPU: the `extern "C"` device functions that Rust, CUDA C++ (`-rdc`,
//! cuLink) and Numba kernels call (ABI in `kernels/carve_heap.h`), and the kernels that carve's
//! tests and benchmarks launch. All of them are thin wrappers over [`crate::slab`] and
//! [`crate::bump`] with [`NvptxWarp`].

use crate::bump;
use crate::bump::Bump;
use crate::heap_layout::{HeapHandle, HEAP_MAGIC, KIND_BUMP, KIND_SLAB};
use crate::nvptx::{self, FullWarp, NvptxWarp, RelaxedWarp};
use crate::slab::{self, Slab};
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::warp::Warp;

/// The first 8 bytes of a formatted handle of `kind` (`magic`, then `kind`).
const fn tag(kind: u32) -> u64 {
    HEAP_MAGIC as u64 | (kind as u64) << 32
}

/// The handle at `heap` if it is a formatted heap of `kind` (for the generic paths).
#[inline(always)]
unsafe fn handle<'a>(heap: *const HeapHandle, kind: u32) -> Option<&'a HeapHandle> {
    if heap.is_null() {
        return None;
    }
    // SAFETY: the caller passes the address of a heap region (or null, handled above).
    let h = unsafe { &*heap };
    // One 8-byte load for both fields (the handle is 8-byte aligned; `magic` comes first).
    // SAFETY: as above.
    let t = unsafe { (heap as *const u64).read() };
    (t == tag(kind)).then_some(h)
}

/// This warp's preferred block in `h`, the same for every lane: see [`slab::warp_hint`].
#[inline(always)]
fn slab_hint(h: &HeapHandle) -> u64 {
    slab::warp_hint(nvptx::warp_index(), h.capacity)
}

/// Allocates one block of the slab heap at `heap`; null when it is exhausted or not a slab.
///
/// A whole warp calling together (the common case) takes the straight-line path over a register
/// copy of the handle; part of a warp, or a warp that the first segment of a chain could not
/// serve, takes the generic one, out of line.
///
/// # Safety
/// `heap` must be null or the address of a heap region that carve formatted and keeps alive.
#[no_mangle]
pub unsafe extern "C" fn carve_slab_alloc(heap: *const HeapHandle) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { slab_alloc_with(heap, &FullWarp, &NvptxWarp) }
}

/// [`carve_slab_alloc`] with `full` for whole warps and `any` otherwise.
///
/// # Safety
/// As for [`carve_slab_alloc`]; `full` is a [`Warp`] whose `active` is all 32 lanes.
#[inline(always)]
unsafe fn slab_alloc_with<F: Warp, G: Warp>(heap: *const HeapHandle, full: &F, any: &G) -> *mut u8 {
    if NvptxWarp.active() != u32::MAX {
        // SAFETY: forwarded contract.
        return unsafe { slab_alloc_generic(heap, any) };
    }
    // SAFETY: forwarded contract.
    let Some(h) = (unsafe { nvptx::load_handle(heap, tag(KIND_SLAB)) }) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `h` is a copy of the formatted slab handle at `heap`.
    let slab = unsafe { Slab::with_copy(&h, &*heap) };
    let p = slab.alloc_in_chain(full, slab_hint(&h));
    if p.is_null() {
        // SAFETY: as above; read here only, so the fast path never holds it.
        let next = unsafe { (*heap).next };
        if next != 0 {
            // SAFETY: `next` is the next formatted segment of the chain.
            return unsafe { slab_alloc_generic(next as *const HeapHandle, any) };
        }
    }
    p
}

/// [`carve_slab_alloc`] for any set of lanes, segment by segment.
///
/// # Safety
/// As for [`carve_slab_alloc`].
#[cold]
#[inline(never)]
unsafe fn slab_alloc_generic<W: Warp>(heap: *const HeapHandle, warp: &W) -> *mut u8 {
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_SLAB) } {
        // SAFETY: a formatted slab chain.
        Some(h) => unsafe { slab::chain_alloc(h, warp, slab_hint(h)) },
        None => core::ptr::null_mut(),
    }
}

/// Returns a block to the slab heap at `heap`. Null is ignored; other pointers that are not
/// blocks of the heap are counted as foreign frees and ignored.
///
/// A whole warp freeing the run of one word of the first segment (what one allocation gave
/// it) takes the straight-line path; anything else, the generic one, out of line.
///
/// # Safety
/// As for [`carve_slab_alloc`]; the block must not be used after this call.
#[no_mangle]
pub unsafe extern "C" fn carve_slab_free(heap: *const HeapHandle, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { slab_free_with(heap, ptr, &FullWarp, &NvptxWarp) }
}

/// [`carve_slab_free`] with `full` for whole warps and `any` otherwise.
///
/// # Safety
/// As for [`carve_slab_free`]; `full` as for [`slab_alloc_with`].
#[inline(always)]
unsafe fn slab_free_with<F: Warp, G: Warp>(
    heap: *const HeapHandle,
    ptr: *mut u8,
    full: &F,
    any: &G,
) {
    if ptr.is_null() {
        return;
    }
    if NvptxWarp.active() == u32::MAX {
        // SAFETY: forwarded contract.
        if let Some(h) = unsafe { nvptx::load_handle(heap, tag(KIND_SLAB)) } {
            // SAFETY: `h` is a copy of the formatted slab handle at `heap`.
            if unsafe { Slab::with_copy(&h, &*heap) }.free_run(full, ptr) {
                return;
            }
        }
    }
    // SAFETY: forwarded contract.
    unsafe { slab_free_generic(heap, ptr, any) }
}

/// [`carve_slab_free`] for any set of lanes and pointers.
///
/// # Safety
/// As for [`carve_slab_free`].
#[cold]
#[inline(never)]
unsafe fn slab_free_generic<W: Warp>(heap: *const HeapHandle, ptr: *mut u8, warp: &W) {
    // SAFETY: forwarded contract.
    if let Some(h) = unsafe { handle(heap, KIND_SLAB) } {
        // SAFETY: a formatted slab chain.
        unsafe { slab::chain_free_each(h, warp, ptr) }
    }
}

/// Allocates `bytes` aligned to `align` from the bump arena at `heap`; null when exhausted.
///
/// # Safety
/// As for [`carve_slab_alloc`], with a bump arena.
#[no_mangle]
pub unsafe extern "C" fn carve_bump_alloc(
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
) -> *mut u8 {
    if NvptxWarp.active() != u32::MAX {
        // SAFETY: forwarded contract.
        return unsafe { bump_alloc_generic(heap, bytes, align) };
    }
    // SAFETY: forwarded contract.
    let Some(h) = (unsafe { nvptx::load_handle(heap, tag(KIND_BUMP)) }) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `h` is a copy of the formatted bump handle at `heap`.
    let p = unsafe { Bump::with_copy(&h, &*heap) }.alloc_in_chain(&FullWarp, bytes, align);
    if p.is_null() {
        // SAFETY: as above; read here only, so the fast path never holds it.
        let next = unsafe { (*heap).next };
        if next != 0 {
            // SAFETY: `next` is the next formatted segment of the chain.
            return unsafe { bump_alloc_generic(next as *const HeapHandle, bytes, align) };
        }
    }
    p
}

/// [`carve_bump_alloc`] for any set of lanes, segment by segment.
///
/// # Safety
/// As for [`carve_bump_alloc`].
#[cold]
#[inline(never)]
unsafe fn bump_alloc_generic(heap: *const HeapHandle, bytes: u64, align: u64) -> *mut u8 {
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_BUMP) } {
        // SAFETY: a formatted bump chain.
        Some(h) => unsafe { bump::chain_alloc(h, &NvptxWarp, bytes, align) },
        None => core::ptr::null_mut(),
    }
}

#[inline(always)]
fn tid(n: u64) -> Option<usize> {
    let i = nvptx::global_thread_index();
    (i < n).then_some(i as usize)
}

/// Thread `i < n` allocates a slab block into `out[i]` (0 on failure).
///
/// # Safety
/// `heap` as for [`carve_slab_alloc`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_slab_alloc(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        unsafe { out.add(i).write(carve_slab_alloc(heap) as u64) };
    }
}

/// Thread `i < n` frees `ptrs[i]` (if not 0).
///
/// # Safety
/// As for [`carve_slab_free`]; `ptrs` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_slab_free(
    heap: *const HeapHandle,
    ptrs: *const u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        unsafe { carve_slab_free(heap, ptrs.add(i).read() as *mut u8) };
    }
}

/// Thread `i < n` bump-allocates `bytes` aligned to `align` into `out[i]`.
///
/// # Safety
/// As for [`carve_bump_alloc`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_bump_alloc(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
    bytes: u64,
    align: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        unsafe {
            out.add(i)
                .write(carve_bump_alloc(heap, bytes, align) as u64)
        };
    }
}

/// Benchmark form of [`carve_heap_bump_alloc`]: the pointer goes to `sink` only if it equals
/// `u64::MAX` (never), so the allocation is computed but its store costs nothing.
///
/// # Safety
/// As for [`carve_bump_alloc`]; `sink` is one writable `u64`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_bump_alloc_sink(
    heap: *const HeapHandle,
    n: u64,
    bytes: u64,
    align: u64,
    sink: *mut u64,
) {
    if tid(n).is_some() {
        // SAFETY: forwarded contract.
        let p = unsafe { carve_bump_alloc(heap, bytes, align) } as u64;
        if p == u64::MAX {
            // SAFETY: sink is writable.
            unsafe { sink.write(p) };
        }
    }
}

/// The `k`-th `u32` of thread `i`'s pattern.
#[inline(always)]
fn pattern(i: usize, k: usize) -> u32 {
    crate::smoke::pattern(i as u32) ^ (k as u32).wrapping_mul(0x0101_0101)
}

#[inline(always)]
unsafe fn fill(p: *mut u32, i: usize, bytes: u64) {
    for k in 0..(bytes / 4) as usize {
        // SAFETY: the caller passes a block of `bytes` bytes.
        unsafe { p.add(k).write_volatile(pattern(i, k)) };
    }
}

#[inline(always)]
unsafe fn intact(p: *const u32, i: usize, bytes: u64) -> bool {
    let mut ok = true;
    for k in 0..(bytes / 4) as usize {
        // SAFETY: the caller passes a block of `bytes` bytes.
        ok &= unsafe { p.add(k).read_volatile() } == pattern(i, k);
    }
    ok
}

/// Thread `i < n` with `ptrs[i] != 0` writes its pattern over the `bytes` bytes there.
///
/// # Safety
/// Every non-zero `ptrs[i]` is a writable block of `bytes` bytes owned by thread `i`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_pattern_fill(ptrs: *const u64, n: u64, bytes: u64) {
    if let Some(i) = tid(n) {
        // SAFETY: i < n.
        let p = unsafe { ptrs.add(i).read() } as *mut u32;
        if !p.is_null() {
            // SAFETY: the caller's contract.
            unsafe { fill(p, i, bytes) };
        }
    }
}

/// Counts into `bad[0]` the threads whose block no longer holds their pattern.
///
/// # Safety
/// As for [`carve_heap_pattern_fill`], readable; `bad` is one `u32`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_pattern_check(
    ptrs: *const u64,
    n: u64,
    bytes: u64,
    bad: *mut u32,
) {
    if let Some(i) = tid(n) {
        // SAFETY: i < n.
        let p = unsafe { ptrs.add(i).read() } as *const u32;
        // SAFETY: the caller's contract.
        if !p.is_null() && !unsafe { intact(p, i, bytes) } {
            // SAFETY: `bad` is a u32 in device memory.
            unsafe { &*(bad as *const AtomicU32) }.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// One round of mixed traffic: thread `i` whose `(hash(i) + round)` is even checks and frees
/// its block if it holds one, and otherwise allocates and fills one; so frees and allocations of
/// different threads race in one launch. Pattern mismatches are counted into `bad[0]`.
///
/// # Safety
/// As for [`carve_heap_slab_alloc`] and [`carve_heap_pattern_check`], blocks of `bytes` bytes.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_slab_churn(
    heap: *const HeapHandle,
    ptrs: *mut u64,
    n: u64,
    bytes: u64,
    round: u32,
    bad: *mut u32,
) {
    let Some(i) = tid(n) else { return };
    if (crate::smoke::pattern(i as u32).wrapping_add(round)) & 1 != 0 {
        return;
    }
    // SAFETY: i < n.
    let slot = unsafe { ptrs.add(i) };
    // SAFETY: as above.
    let p = unsafe { slot.read() } as *mut u8;
    if !p.is_null() {
        // SAFETY: thread i owns the block.
        if !unsafe { intact(p as *const u32, i, bytes) } {
            // SAFETY: `bad` is a u32 in device memory.
            unsafe { &*(bad as *const AtomicU32) }.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: thread i owns the block and drops it here.
        unsafe {
            carve_slab_free(heap, p);
            slot.write(0);
        }
    } else {
        // SAFETY: forwarded contract.
        let q = unsafe { carve_slab_alloc(heap) };
        if !q.is_null() {
            // SAFETY: the new block is thread i's.
            unsafe { fill(q as *mut u32, i, bytes) };
        }
        // SAFETY: i < n.
        unsafe { slot.write(q as u64) };
    }
}

/// Ablation for the benchmark: [`carve_heap_slab_alloc`] with relaxed bitmap atomics, to
/// measure what the Acquire ordering costs. Not for use: see [`RelaxedWarp`].
///
/// # Safety
/// As for [`carve_heap_slab_alloc`].
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_slab_alloc_relaxed(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
) {
    if let Some(i) = tid(n) {
        // SAFETY: forwarded contract; i < n.
        // SAFETY: forwarded contract; i < n.
        let p = unsafe { slab_alloc_with(heap, &RelaxedWarp::<true>, &RelaxedWarp::<false>) };
        // SAFETY: i < n.
        unsafe { out.add(i).write(p as u64) };
    }
}

/// Ablation: [`carve_heap_slab_free`] with relaxed bitmap atomics (see
/// [`carve_bench_slab_alloc_relaxed`]).
///
/// # Safety
/// As for [`carve_heap_slab_free`].
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
        unsafe { slab_free_with(heap, p, &RelaxedWarp::<true>, &RelaxedWarp::<false>) }
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
