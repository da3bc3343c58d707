//! The device heap's entry points (`carve_kernels::entry`, what `carve_slab_alloc` and the rest
//! run on the GPU) called by a lane of the lock-step warp: the lane is the warp that reads
//! `activemask`, and the whole warp is [`Among`] it with all 32 lanes. `seed` stands for the
//! warp's index in its grid.
#![allow(dead_code)]

use carve_kernels::entry;
use carve_kernels::heap_layout::{GeneralHeader, HeapHandle};
use carve_kernels::warp::Among;

use super::lockstep::Lane;

fn full<'a>(w: &'a Lane<'a>) -> Among<'a, Lane<'a>> {
    Among {
        warp: w,
        mask: u32::MAX,
    }
}

/// `carve_slab_alloc(heap)`.
pub fn slab_alloc(heap: *const HeapHandle, w: &Lane<'_>, seed: u32) -> *mut u8 {
    // SAFETY: the tests pass null or heaps that outlive the warp.
    unsafe { entry::slab_alloc(heap, &full(w), w, move || seed) }
}

/// `carve_slab_free(heap, p)`.
pub fn slab_free(heap: *const HeapHandle, w: &Lane<'_>, p: *mut u8) {
    // SAFETY: as above; the lane gives `p` up (or it is no block of the heap).
    unsafe { entry::slab_free(heap, p, &full(w), w) }
}

/// `carve_bump_alloc(heap, bytes, align)`.
pub fn bump_alloc(heap: *const HeapHandle, w: &Lane<'_>, bytes: u64, align: u64) -> *mut u8 {
    // SAFETY: as for `slab_alloc`.
    unsafe { entry::bump_alloc(heap, bytes, align, &full(w), w) }
}

/// `carve_malloc(heap, bytes)`.
pub fn malloc(heap: *const GeneralHeader, w: &Lane<'_>, bytes: u64, seed: u32) -> *mut u8 {
    // SAFETY: as for `slab_alloc`.
    unsafe { entry::malloc(heap, bytes, &full(w), w, move || seed) }
}

/// `carve_free(heap, p)`.
pub fn free(heap: *const GeneralHeader, w: &Lane<'_>, p: *mut u8) {
    // SAFETY: as for `slab_free`.
    unsafe { entry::free(heap, p, &full(w), w) }
}
