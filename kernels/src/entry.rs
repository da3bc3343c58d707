//! The device heap's entry points (`kernels/carve_heap.h`), generic over the warp: the GPU's
//! `extern "C"` functions (`heap_entry.rs`) instantiate them with `FullWarp` and `NvptxWarp`,
//! and the host tests with the lock-step warp emulator's lanes, so both run this code.
//!
//! Each takes two views of the calling warp: `any`, whose `active()` reads the lanes executing
//! now (`activemask`), and `full`, a warp whose `active()` is all 32 lanes, for the straight-line
//! paths that a whole warp takes. `seed` gives the calling warp's index in its grid (it picks
//! where in a slab the warp starts: [`slab::warp_hint`]).

use crate::bump::{self, Bump};
use crate::general;
use crate::heap_layout::{
    GeneralHeader, HeapHandle, GENERAL_CLASS_SLOTS, HEAP_MAGIC, KIND_BUMP, KIND_SLAB,
};
use crate::slab::{self, Slab};
use crate::warp::Warp;

#[cfg(target_arch = "nvptx64")]
use crate::nvptx::{load_class_pointer, load_general, load_handle};
#[cfg(not(target_arch = "nvptx64"))]
use host::{load_class_pointer, load_general, load_handle};

/// The first 8 bytes of a formatted handle of `kind` (`magic`, then `kind`).
pub(crate) const fn tag(kind: u32) -> u64 {
    HEAP_MAGIC as u64 | (kind as u64) << 32
}

/// The handle at `heap` if it is a formatted heap of `kind` (for the generic paths).
///
/// # Safety
/// `heap` is null or the address of a heap region that carve formatted and keeps alive.
#[inline(always)]
pub(crate) unsafe fn handle<'a>(heap: *const HeapHandle, kind: u32) -> Option<&'a HeapHandle> {
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

/// Allocates one block of the slab heap at `heap`; null when it is exhausted or not a slab.
///
/// A whole warp calling together (the common case) takes the straight-line path over a register
/// copy of the handle; part of a warp, or a warp that the first segment of a chain could not
/// serve, takes the generic one, out of line.
///
/// # Safety
/// `heap` must be null or the address of a heap region that carve formatted and keeps alive.
/// `full` is a [`Warp`] whose `active` is all 32 lanes, used only when `any.active()` is.
#[inline(always)]
pub unsafe fn slab_alloc<F: Warp, G: Warp, S: Fn() -> u32 + Copy>(
    heap: *const HeapHandle,
    full: &F,
    any: &G,
    seed: S,
) -> *mut u8 {
    if any.active() != u32::MAX {
        // SAFETY: forwarded contract.
        return unsafe { slab_alloc_generic(heap, any, seed) };
    }
    // SAFETY: forwarded contract.
    let Some(h) = (unsafe { load_handle(heap, tag(KIND_SLAB)) }) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `h` is a copy of the formatted slab handle at `heap`.
    let slab = unsafe { Slab::with_copy(&h, &*heap) };
    let p = slab.alloc_in_chain(full, slab::warp_hint(seed(), h.capacity));
    if p.is_null() {
        // SAFETY: as above; read here only, so the fast path never holds it.
        let next = unsafe { (*heap).next };
        if next != 0 {
            // SAFETY: `next` is the next formatted segment of the chain.
            return unsafe { slab_alloc_generic(next as *const HeapHandle, any, seed) };
        }
    }
    p
}

/// [`slab_alloc`] for any set of lanes, segment by segment.
///
/// # Safety
/// As for [`slab_alloc`].
#[cold]
#[inline(never)]
unsafe fn slab_alloc_generic<W: Warp, S: Fn() -> u32>(
    heap: *const HeapHandle,
    warp: &W,
    seed: S,
) -> *mut u8 {
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_SLAB) } {
        // SAFETY: a formatted slab chain.
        Some(h) => unsafe { slab::chain_alloc(h, warp, slab::warp_hint(seed(), h.capacity)) },
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
/// As for [`slab_alloc`]; the block must not be used after this call.
#[inline(always)]
pub unsafe fn slab_free<F: Warp, G: Warp>(
    heap: *const HeapHandle,
    ptr: *mut u8,
    full: &F,
    any: &G,
) {
    // The handle's loads go out before `ptr` is tested, so their round trip overlaps the
    // caller's load of `ptr` instead of following it.
    // SAFETY: forwarded contract.
    let h = unsafe { load_handle(heap, tag(KIND_SLAB)) };
    if ptr.is_null() {
        return;
    }
    if any.active() == u32::MAX {
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

/// [`slab_free`] for any set of lanes and pointers.
///
/// # Safety
/// As for [`slab_free`].
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
/// As for [`slab_alloc`], with a bump arena.
#[inline(always)]
pub unsafe fn bump_alloc<F: Warp, G: Warp>(
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
    full: &F,
    any: &G,
) -> *mut u8 {
    if any.active() != u32::MAX {
        // SAFETY: forwarded contract.
        return unsafe { bump_alloc_generic(heap, bytes, align, any) };
    }
    // SAFETY: forwarded contract.
    let Some(h) = (unsafe { load_handle(heap, tag(KIND_BUMP)) }) else {
        return core::ptr::null_mut();
    };
    // SAFETY: `h` is a copy of the formatted bump handle at `heap`.
    let p = unsafe { Bump::with_copy(&h, &*heap) }.alloc_in_chain(full, bytes, align);
    if p.is_null() {
        // SAFETY: as above; read here only, so the fast path never holds it.
        let next = unsafe { (*heap).next };
        if next != 0 {
            // SAFETY: `next` is the next formatted segment of the chain.
            return unsafe { bump_alloc_generic(next as *const HeapHandle, bytes, align, any) };
        }
    }
    p
}

/// [`bump_alloc`] for any set of lanes, segment by segment.
///
/// # Safety
/// As for [`bump_alloc`].
#[cold]
#[inline(never)]
unsafe fn bump_alloc_generic<W: Warp>(
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
    warp: &W,
) -> *mut u8 {
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_BUMP) } {
        // SAFETY: a formatted bump chain.
        Some(h) => unsafe { bump::chain_alloc(h, warp, bytes, align) },
        None => core::ptr::null_mut(),
    }
}

/// Allocates `bytes` from the general heap at `heap` (a block of the smallest size class that
/// holds it: 16 B to 64 KiB, then whole power-of-two blocks up to 16 MiB); null when the class
/// is exhausted, when `bytes` is 0 or past the heap's largest class in use (counted as failed
/// allocations), or when `heap` is not a general heap. Blocks are aligned to 16 bytes, or to
/// the class size when it is a power of two (up to 4096).
///
/// Lanes may ask for different sizes: a whole warp asking one class takes that class's
/// straight-line slab path; otherwise the lanes are grouped by class, out of line.
///
/// # Safety
/// As for [`slab_alloc`], with a general heap.
#[inline(always)]
pub unsafe fn malloc<F: Warp, G: Warp, S: Fn() -> u32 + Copy>(
    heap: *const GeneralHeader,
    bytes: u64,
    full: &F,
    any: &G,
    seed: S,
) -> *mut u8 {
    let class = general::request_class(bytes);
    if any.active() == u32::MAX {
        // The class is known before any load, so its segment pointer comes with the header.
        let slot = class.min(GENERAL_CLASS_SLOTS as u32 - 1);
        // SAFETY: forwarded contract.
        let Some((front, head)) = (unsafe { load_general(heap, slot) }) else {
            return core::ptr::null_mut();
        };
        // Every lane of the full warp takes part in the match (a class test first would let
        // some lanes skip a collective that names them); after it, `class` is the same in
        // every lane.
        if full.match_all(u32::MAX, class as u64) && class < front.nclasses {
            // SAFETY: `class < nclasses`: the address of that class's formatted slab segment.
            return unsafe { slab_alloc(head as *const _, full, any, seed) };
        }
    }
    // SAFETY: forwarded contract.
    match unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap.
        Some(g) => unsafe { malloc_generic(g, bytes, any, seed) },
        None => core::ptr::null_mut(),
    }
}

/// [`malloc`] for any set of lanes and sizes.
///
/// # Safety
/// As for [`malloc`], with `g` its header.
#[cold]
#[inline(never)]
unsafe fn malloc_generic<W: Warp, S: Fn() -> u32>(
    g: &GeneralHeader,
    bytes: u64,
    warp: &W,
    seed: S,
) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { general::malloc(g, warp, bytes, seed()) }
}

/// Returns a block to the general heap at `heap`; its class is found from the pointer alone.
/// Null is ignored; other pointers that are no block of the heap are counted as foreign frees
/// and ignored (double frees too, on checked heaps).
///
/// # Safety
/// As for [`malloc`]; the block must not be used after this call.
#[inline(always)]
pub unsafe fn free<F: Warp, G: Warp>(heap: *const GeneralHeader, ptr: *mut u8, full: &F, any: &G) {
    if any.active() == u32::MAX {
        // SAFETY: forwarded contract.
        let Some((front, _)) = (unsafe { load_general(heap, 0) }) else {
            return;
        };
        let key = front.free_key(ptr);
        // As in `malloc`: the match first, over the whole warp.
        if full.match_all(u32::MAX, key as u64) && key < front.nclasses {
            // SAFETY: a general header, and `key < nclasses <= GENERAL_CLASS_SLOTS`.
            let head = unsafe { load_class_pointer(heap, key) };
            // SAFETY: the address of class `key`'s formatted slab segment, the head of the
            // chain that holds `ptr` if anything does.
            return unsafe { slab_free(head as *const _, ptr, full, any) };
        }
    }
    // SAFETY: forwarded contract.
    if let Some(g) = unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap.
        unsafe { free_generic(g, ptr, any) }
    }
}

/// [`free`] for any set of lanes and pointers.
///
/// # Safety
/// As for [`free`], with `g` its header.
#[cold]
#[inline(never)]
unsafe fn free_generic<W: Warp>(g: &GeneralHeader, ptr: *mut u8, warp: &W) {
    // SAFETY: forwarded contract.
    unsafe { general::free(g, warp, ptr) }
}

/// The host's reads of the handles, as plain loads (the GPU's are read-only vector loads).
#[cfg(not(target_arch = "nvptx64"))]
mod host {
    use crate::general::{GeneralFront, GENERAL_TAG};
    use crate::heap_layout::{GeneralHeader, HeapHandle};

    /// A copy of the handle at `heap`, if it is a formatted heap whose first 8 bytes are `tag`.
    ///
    /// # Safety
    /// `heap` is null or the address of a live heap region.
    #[inline(always)]
    pub unsafe fn load_handle(heap: *const HeapHandle, tag: u64) -> Option<HeapHandle> {
        if heap.is_null() {
            return None;
        }
        // SAFETY: the caller's contract; the tag first, as every region starts with one.
        if unsafe { (heap as *const u64).read() } != tag {
            return None;
        }
        // SAFETY: a handle of this kind: a whole `HeapHandle`.
        Some(unsafe { *heap })
    }

    /// The front of the general header at `heap`, if it is one, and its class pointer `slot`.
    ///
    /// # Safety
    /// As for [`load_handle`].
    #[inline(always)]
    pub unsafe fn load_general(
        heap: *const GeneralHeader,
        slot: u32,
    ) -> Option<(GeneralFront, u64)> {
        if heap.is_null() {
            return None;
        }
        // SAFETY: the caller's contract.
        if unsafe { (heap as *const u64).read() } != GENERAL_TAG {
            return None;
        }
        // SAFETY: a general header.
        let g = unsafe { &*heap };
        let front = GeneralFront {
            nclasses: g.nclasses,
            stride_log2: g.stride_log2,
            base: g.base,
        };
        Some((front, g.classes[slot as usize]))
    }

    /// The general header's class pointer `c`.
    ///
    /// # Safety
    /// `heap` is a general header.
    #[inline(always)]
    pub unsafe fn load_class_pointer(heap: *const GeneralHeader, c: u32) -> u64 {
        // SAFETY: the caller's contract.
        unsafe { (*heap).classes[c as usize] }
    }
}
