//! The kernels that only carve's tests launch: smoke tests, block fill/check, the device heap's
//! launch wrappers, pattern checks and churn rounds (the benchmarks' kernels are in
//! [`test_bench`](crate::test_bench)). They build into a module of their own (feature
//! `test-kernels`), so the shipped PTX exports exactly the ABI in `kernels/carve_heap.h`.

use alloc::vec::Vec;

use crate::general::test_request_size;
use crate::global_alloc::CarveAlloc;
use crate::heap_entry::{
    carve_bump_alloc, carve_bump_alloc_block, carve_free, carve_malloc, carve_slab_alloc,
    carve_slab_free,
};
use crate::heap_layout::{GeneralHeader, HeapHandle};
use crate::nvptx;
use crate::sync::atomic::{AtomicU32, Ordering};

/// Smoke test: thread `i < n` writes [`crate::smoke::pattern`]`(i)` to `out[i]`.
///
/// # Safety
/// `out` must point to `n` writable `u32`s in device-accessible memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_smoke_fill(out: *mut u32, n: u32) {
    let i = nvptx::global_thread_index();
    if i < n as u64 {
        // SAFETY: i < n, and the caller gave n elements.
        unsafe { out.add(i as usize).write(crate::smoke::pattern(i as u32)) };
    }
}

/// Fills block `b = blockIdx.x < n` (at `ptrs[b]`, `words[b]` `u32`s) with
/// [`crate::blocks::word`]`(b, i)`.
///
/// # Safety
/// `ptrs` and `words` hold `n` entries; each block is writable device memory of its length.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_fill_blocks(ptrs: *const u64, words: *const u32, n: u32) {
    let (b, t, dim) = nvptx::block_thread_dim();
    if b >= n {
        return;
    }
    // SAFETY: b < n entries; the caller vouches for each block's memory.
    unsafe {
        let p = *ptrs.add(b as usize) as *mut u32;
        let len = *words.add(b as usize);
        let mut i = t;
        while i < len {
            p.add(i as usize).write_volatile(crate::blocks::word(b, i));
            i += dim;
        }
    }
}

/// Counts into `bad[0]` the words of each block that differ from [`carve_fill_blocks`]'s.
///
/// # Safety
/// As [`carve_fill_blocks`]; `bad` points to one `u32`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_check_blocks(
    ptrs: *const u64,
    words: *const u32,
    n: u32,
    bad: *mut u32,
) {
    let (b, t, dim) = nvptx::block_thread_dim();
    if b >= n {
        return;
    }
    let mut wrong = 0u32;
    // SAFETY: as in `carve_fill_blocks`; reads only.
    unsafe {
        let p = *ptrs.add(b as usize) as *const u32;
        let len = *words.add(b as usize);
        let mut i = t;
        while i < len {
            if p.add(i as usize).read_volatile() != crate::blocks::word(b, i) {
                wrong += 1;
            }
            i += dim;
        }
    }
    if wrong > 0 {
        // SAFETY: `bad` is a valid, aligned u32 that only atomics touch during the launch.
        let counter = unsafe { AtomicU32::from_ptr(bad) };
        counter.fetch_add(wrong, Ordering::Relaxed);
    }
}
/// Smoke test that reads and writes: thread `i < n` adds `delta` to `data[i]` (wrapping).
///
/// # Safety
/// `data` must point to `n` readable and writable `u32`s in device-accessible memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_smoke_add(data: *mut u32, n: u32, delta: u32) {
    let i = nvptx::global_thread_index();
    if i < n as u64 {
        // SAFETY: i < n, and the caller gave n elements.
        unsafe {
            let p = data.add(i as usize);
            p.write(p.read().wrapping_add(delta));
        }
    }
}

/// The calling thread's index, if it is below `n`.
#[inline(always)]
pub(crate) fn tid(n: u64) -> Option<usize> {
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

/// The request of thread `i` in the block-allocation kernels: `bytes`, or with `mixed` a
/// multiple `1..=5` of it and 0 (no request) for every seventh thread; 0 past `n`.
#[inline(always)]
fn block_request(i: u64, n: u64, bytes: u64, mixed: u32) -> u64 {
    match (i < n, mixed != 0) {
        (false, _) => 0,
        (true, false) => bytes,
        (true, true) if i % 7 == 3 => 0,
        (true, true) => bytes * (1 + i % 5),
    }
}

/// Every thread of every block calls [`carve_bump_alloc_block`] for
/// [`block_request`]`(i, ..)` bytes; thread `i < n` stores the pointer into `out[i]`.
///
/// # Safety
/// As for [`carve_bump_alloc_block`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_bump_alloc_block(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
    bytes: u64,
    align: u64,
    mixed: u32,
) {
    let i = nvptx::global_thread_index();
    let want = block_request(i, n, bytes, mixed);
    // SAFETY: forwarded contract; every thread of the block makes this call.
    let p = unsafe { carve_bump_alloc_block(heap, want, align) } as u64;
    if i < n {
        // SAFETY: i < n.
        unsafe { out.add(i as usize).write(p) };
    }
}

/// Benchmark form of [`carve_heap_bump_alloc_block`] for one size: the pointer goes to `sink`
/// only if it equals `u64::MAX` (never).
///
/// # Safety
/// As for [`carve_bump_alloc_block`]; `sink` is one writable `u64`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_heap_bump_alloc_block_sink(
    heap: *const HeapHandle,
    n: u64,
    bytes: u64,
    align: u64,
    sink: *mut u64,
) {
    let want = block_request(nvptx::global_thread_index(), n, bytes, 0);
    // SAFETY: forwarded contract; every thread of the block makes this call.
    let p = unsafe { carve_bump_alloc_block(heap, want, align) } as u64;
    if p == u64::MAX {
        // SAFETY: sink is writable.
        unsafe { sink.write(p) };
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

/// Thread `i < n` allocates [`test_request_size`]`(i, seed)` bytes from the general heap at
/// `heap` into `out[i]` (0 on failure) and fills them with its pattern (see
/// [`carve_heap_pattern_fill`]), so that overlapping blocks show in
/// [`carve_test_general_check_free`].
///
/// # Safety
/// As for [`carve_malloc`]; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_test_general_malloc(
    heap: *const GeneralHeader,
    out: *mut u64,
    n: u64,
    seed: u32,
) {
    if let Some(i) = tid(n) {
        let bytes = test_request_size(i as u64, seed);
        // SAFETY: forwarded contract.
        let p = unsafe { carve_malloc(heap, bytes) };
        // SAFETY: i < n.
        unsafe { out.add(i).write(p as u64) };
        if !p.is_null() {
            // SAFETY: the block is this thread's, at least `bytes` long.
            unsafe { fill(p as *mut u32, i, bytes) };
        }
    }
}

/// Thread `i < n` checks the pattern [`carve_test_general_malloc`] left at `ptrs[i]` (counting a
/// mismatch into `bad[0]`), then frees it into the general heap at `heap` (0 is ignored).
///
/// # Safety
/// As for [`carve_free`]; `ptrs` holds what [`carve_test_general_malloc`] wrote with this
/// `seed`; `bad` is one `u32`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_test_general_check_free(
    heap: *const GeneralHeader,
    ptrs: *const u64,
    n: u64,
    seed: u32,
    bad: *mut u32,
) {
    if let Some(i) = tid(n) {
        // SAFETY: i < n.
        let p = unsafe { ptrs.add(i).read() } as *mut u8;
        let bytes = test_request_size(i as u64, seed);
        // SAFETY: a block of at least `bytes` bytes that this thread filled.
        if !p.is_null() && !unsafe { intact(p as *const u32, i, bytes) } {
            // SAFETY: `bad` is a u32 in device memory.
            unsafe { &*(bad as *const AtomicU32) }.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: forwarded contract; the block is not used after this.
        unsafe { carve_free(heap, p) };
    }
}

/// One round of the general heap's stress test. Thread `i` works on slot `j = i × mult mod n`
/// (`n` a power of two, `mult` odd: a permutation that the host changes every round, so a block
/// is freed by another warp, in another launch, than the one that allocated it). When
/// `hash(j) + round` is even the slot toggles: a held block is checked against slot `j`'s
/// pattern and freed, an empty slot allocates [`test_request_size`]`(j, seed)` bytes and fills
/// them. So a warp's lanes diverge, ask different sizes, and free and allocate at once.
/// `counts`: mismatched patterns, null allocations, allocations, frees.
///
/// # Safety
/// As for [`carve_test_general_malloc`] and [`carve_test_general_check_free`]; `counts` holds
/// four `u32`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_test_general_churn(
    heap: *const GeneralHeader,
    ptrs: *mut u64,
    n: u64,
    seed: u32,
    round: u32,
    mult: u64,
    counts: *mut u32,
) {
    let Some(i) = tid(n) else { return };
    let j = (i as u64).wrapping_mul(mult) & (n - 1);
    let bytes = test_request_size(j, seed);
    if (bytes / 4 + round as u64) & 1 != 0 {
        return;
    }
    let count = |k: usize| {
        // SAFETY: `counts` holds four u32s in device memory.
        unsafe { &*(counts.add(k) as *const AtomicU32) }.fetch_add(1, Ordering::Relaxed);
    };
    // SAFETY: j < n, and only this thread touches slot j in this launch.
    let slot = unsafe { ptrs.add(j as usize) };
    // SAFETY: as above.
    let p = unsafe { slot.read() } as *mut u8;
    if !p.is_null() {
        // SAFETY: slot j's block, filled for slot j.
        if !unsafe { intact(p as *const u32, j as usize, bytes) } {
            count(0);
        }
        // SAFETY: the block leaves slot j here and is not used after.
        unsafe {
            carve_free(heap, p);
            slot.write(0);
        }
        count(3);
    } else {
        // SAFETY: forwarded contract.
        let q = unsafe { carve_malloc(heap, bytes) };
        if q.is_null() {
            count(1);
        } else {
            // SAFETY: the block is slot j's, at least `bytes` long.
            unsafe { fill(q as *mut u32, j as usize, bytes) };
            count(2);
        }
        // SAFETY: as above.
        unsafe { slot.write(q as u64) };
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

// This module is the kernel crate here: it opts in to carve's allocator as any crate whose
// kernels use `alloc` would (the shipped module, built without `test-kernels`, declares none).
#[global_allocator]
static ALLOC: CarveAlloc = CarveAlloc::new();

/// Thread `i < n` builds a `Vec<u32>` of `i, i + 1, .., i + len - 1` with [`ALLOC`] over the heap
/// at `heap`, half and then the rest (so the second reserve grows the first allocation: in place
/// on a slab, by a copy on a bump arena), and writes its sum to `out[i]`, or `u64::MAX` when an
/// allocation failed. Then it drops the Vec (freeing a slab block), or, when `keep != 0`, leaks
/// it, so that a slab's blocks stay in use for the host to count.
///
/// # Safety
/// `heap` as for [`carve_slab_alloc`] (a slab or a bump arena); `out` holds `n` `u64`s; no launch
/// with another heap runs from this module at the same time (see `crate::global_alloc`).
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_test_vec_sum(
    heap: *const HeapHandle,
    out: *mut u64,
    n: u64,
    len: u32,
    keep: u32,
) {
    // SAFETY: the caller's contract: one live heap for the whole launch.
    unsafe { ALLOC.set_heap(heap) };
    if let Some(i) = tid(n) {
        let sum = vec_sum(i as u32, len, keep != 0).unwrap_or(u64::MAX);
        // SAFETY: i < n.
        unsafe { out.add(i).write(sum) };
    }
}

/// The sum of `first..first + len` (wrapping in `u32`) held in a `Vec`; `None` when the heap
/// refused an allocation. Only fallible reserves allocate: `push` stays within capacity.
#[inline(never)]
fn vec_sum(first: u32, len: u32, keep: bool) -> Option<u64> {
    let half = len / 2;
    let mut v: Vec<u32> = Vec::new();
    v.try_reserve_exact(half as usize).ok()?;
    for k in 0..half {
        v.push(first.wrapping_add(k));
    }
    v.try_reserve_exact((len - half) as usize).ok()?;
    for k in half..len {
        v.push(first.wrapping_add(k));
    }
    let sum = v.iter().map(|&x| x as u64).sum();
    if keep {
        core::mem::forget(v);
    }
    Some(sum)
}
