//! The device heap on the GPU: the `extern "C"` device functions that Rust, CUDA C++ (`-rdc`,
//! cuLink) and Numba kernels call (ABI in `kernels/carve_heap.h`). They instantiate the generic
//! entry points of [`crate::entry`] with [`FullWarp`] and [`NvptxWarp`]; the kernels that carve's
//! tests and benchmarks launch live in the separate test module (`test_entry.rs`).

use crate::bump_block;
use crate::entry::{self, handle};
use crate::heap_layout::{GeneralHeader, HeapHandle, KIND_BUMP};
use crate::nvptx::{warp_index, FullWarp, NvptxBlock, NvptxWarp};

/// Allocates one block of the slab heap at `heap`; null when it is exhausted or not a slab
/// ([`entry::slab_alloc`]).
///
/// # Safety
/// `heap` must be null or the address of a heap region that carve formatted and keeps alive.
#[no_mangle]
pub unsafe extern "C" fn carve_slab_alloc(heap: *const HeapHandle) -> *mut u8 {
    // SAFETY: forwarded contract; `FullWarp` is all 32 lanes.
    unsafe { entry::slab_alloc(heap, &FullWarp, &NvptxWarp, warp_index) }
}

/// Returns a block to the slab heap at `heap` ([`entry::slab_free`]).
///
/// # Safety
/// As for [`carve_slab_alloc`]; the block must not be used after this call.
#[no_mangle]
pub unsafe extern "C" fn carve_slab_free(heap: *const HeapHandle, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { entry::slab_free(heap, ptr, &FullWarp, &NvptxWarp) }
}

/// Allocates `bytes` aligned to `align` from the bump arena at `heap`; null when exhausted
/// ([`entry::bump_alloc`]).
///
/// # Safety
/// As for [`carve_slab_alloc`], with a bump arena.
#[no_mangle]
pub unsafe extern "C" fn carve_bump_alloc(
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { entry::bump_alloc(heap, bytes, align, &FullWarp, &NvptxWarp) }
}

/// Allocates `bytes` aligned to `align` for every thread of the calling block, with one
/// reservation for the whole block instead of one per warp; each thread may ask its own size.
/// Every thread of the block must call, with the same `heap`, as for `__syncthreads`. Null for
/// a zero size, a bad alignment, or when the arena has no room for the block's total (then
/// every thread of the block gets null).
///
/// # Safety
/// As for [`carve_bump_alloc`], and every thread of the block reaches the call.
#[no_mangle]
pub unsafe extern "C" fn carve_bump_alloc_block(
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
) -> *mut u8 {
    let block = NvptxBlock::here();
    // SAFETY: forwarded contract; `heap` is the same for the whole block, so every thread
    // takes the same branch.
    match unsafe { handle(heap, KIND_BUMP) } {
        // SAFETY: a formatted bump chain, called by the whole block.
        Some(h) => unsafe { bump_block::chain_alloc_block(h, &block, bytes, align) },
        None => core::ptr::null_mut(),
    }
}

/// Allocates `bytes` from the general heap at `heap` ([`entry::malloc`]).
///
/// # Safety
/// `heap` must be null or the address of a heap region that carve formatted and keeps alive.
#[no_mangle]
pub unsafe extern "C" fn carve_malloc(heap: *const GeneralHeader, bytes: u64) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { entry::malloc(heap, bytes, &FullWarp, &NvptxWarp, warp_index) }
}

/// Returns a block to the general heap at `heap` ([`entry::free`]).
///
/// Inlined into the Rust kernels that call it (the benchmarks, Numba's wrapper): out of line, a
/// call, its one-class free ran at 107 G/s instead of 130 (H100, 2^22 × 16 B).
///
/// # Safety
/// As for [`carve_malloc`]; the block must not be used after this call.
#[no_mangle]
#[inline]
pub unsafe extern "C" fn carve_free(heap: *const GeneralHeader, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { entry::free(heap, ptr, &FullWarp, &NvptxWarp) }
}
