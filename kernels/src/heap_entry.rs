//! The device heap on the GPU: the `extern "C"` device functions that Rust, CUDA C++ (`-rdc`,
//! cuLink) and Numba kernels call (ABI in `kernels/carve_heap.h`). They are thin wrappers over
//! [`crate::slab`] and [`crate::bump`] with [`NvptxWarp`]; the kernels that carve's tests and
//! benchmarks launch live in the separate test module (`test_entry.rs`).

use crate::bump;
use crate::bump::Bump;
use crate::bump_block;
use crate::general;
use crate::heap_layout::{
    GeneralHeader, HeapHandle, GENERAL_CLASS_SLOTS, HEAP_MAGIC, KIND_BUMP, KIND_SLAB,
};
use crate::nvptx::{self, FullWarp, NvptxBlock, NvptxWarp};
use crate::slab::{self, Slab};
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
pub(crate) unsafe fn slab_alloc_with<F: Warp, G: Warp>(
    heap: *const HeapHandle,
    full: &F,
    any: &G,
) -> *mut u8 {
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
pub(crate) unsafe fn slab_free_with<F: Warp, G: Warp>(
    heap: *const HeapHandle,
    ptr: *mut u8,
    full: &F,
    any: &G,
) {
    // The handle's loads go out before `ptr` is tested, so their round trip overlaps the
    // caller's load of `ptr` instead of following it.
    // SAFETY: forwarded contract.
    let h = unsafe { nvptx::load_handle(heap, tag(KIND_SLAB)) };
    if ptr.is_null() {
        return;
    }
    if NvptxWarp.active() == u32::MAX {
        if let Some(h) = h {
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

/// Allocates `bytes` from the general heap at `heap` (a block of the smallest size class that
/// holds it: 16 B to 64 KiB, then whole power-of-two blocks up to 16 MiB); null when the class
/// is exhausted, when `bytes` is 0 or past the heap's largest class in use (counted as failed
/// allocations), or when `heap` is not a general heap. Blocks are aligned to 16 bytes, or to the class size when it is
/// a power of two (up to 4096).
///
/// Lanes may ask for different sizes: a whole warp asking one class takes that class's
/// straight-line slab path; otherwise the lanes are grouped by class, out of line.
///
/// # Safety
/// `heap` must be null or the address of a heap region that carve formatted and keeps alive.
#[no_mangle]
pub unsafe extern "C" fn carve_malloc(heap: *const GeneralHeader, bytes: u64) -> *mut u8 {
    let class = general::request_class(bytes);
    if NvptxWarp.active() == u32::MAX {
        // The class is known before any load, so its segment pointer comes with the header.
        let slot = class.min(GENERAL_CLASS_SLOTS as u32 - 1);
        // SAFETY: forwarded contract.
        let Some((front, head)) = (unsafe { nvptx::load_general(heap, slot) }) else {
            return core::ptr::null_mut();
        };
        // Every lane of the full warp takes part in the match (a class test first would let
        // some lanes skip a collective that names them); after it, `class` is the same in
        // every lane.
        if FullWarp.match_all(u32::MAX, class as u64) && class < front.nclasses {
            // SAFETY: `class < nclasses`: the address of that class's formatted slab segment.
            return unsafe { slab_alloc_with(head as *const _, &FullWarp, &NvptxWarp) };
        }
    }
    // SAFETY: forwarded contract.
    match unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap.
        Some(g) => unsafe { malloc_generic(g, bytes) },
        None => core::ptr::null_mut(),
    }
}

/// [`carve_malloc`] for any set of lanes and sizes.
///
/// # Safety
/// As for [`carve_malloc`], with `g` its header.
#[cold]
#[inline(never)]
unsafe fn malloc_generic(g: &GeneralHeader, bytes: u64) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { general::malloc(g, &NvptxWarp, bytes, nvptx::warp_index()) }
}

/// Returns a block to the general heap at `heap`; its class is found from the pointer alone.
/// Null is ignored; other pointers that are no block of the heap are counted as foreign frees
/// and ignored (double frees too, on checked heaps).
///
/// # Safety
/// As for [`carve_malloc`]; the block must not be used after this call.
#[no_mangle]
pub unsafe extern "C" fn carve_free(heap: *const GeneralHeader, ptr: *mut u8) {
    if NvptxWarp.active() == u32::MAX {
        // SAFETY: forwarded contract.
        let Some((front, _)) = (unsafe { nvptx::load_general(heap, 0) }) else {
            return;
        };
        let key = front.free_key(ptr);
        // As in `carve_malloc`: the match first, over the whole warp.
        if FullWarp.match_all(u32::MAX, key as u64) && key < front.nclasses {
            // SAFETY: a general header, and `key < nclasses <= GENERAL_CLASS_SLOTS`.
            let head = unsafe { nvptx::load_class_pointer(heap, key) };
            // SAFETY: the address of class `key`'s formatted slab segment, the head of the
            // chain that holds `ptr` if anything does.
            return unsafe { slab_free_with(head as *const _, ptr, &FullWarp, &NvptxWarp) };
        }
    }
    // SAFETY: forwarded contract.
    if let Some(g) = unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap.
        unsafe { free_generic(g, ptr) }
    }
}

/// [`carve_free`] for any set of lanes and pointers.
///
/// # Safety
/// As for [`carve_free`], with `g` its header.
#[cold]
#[inline(never)]
unsafe fn free_generic(g: &GeneralHeader, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { general::free(g, &NvptxWarp, ptr) }
}
