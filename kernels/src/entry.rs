//! The device heap's entry points (`kernels/carve_heap.h`), generic over the warp: the GPU's
//! `extern "C"` functions (`heap_entry.rs`) instantiate them with `FullWarp` and `NvptxWarp`,
//! and the host tests with the lock-step warp emulator's lanes, so both run this code.
//!
//! Each takes two views of the calling warp: `any`, whose `active()` reads the lanes executing
//! now (`activemask`), and `full`, a warp whose `active()` is all 32 lanes, for the straight-line
//! paths that a whole warp takes. `seed` gives the calling warp's index in its grid (it picks
//! where in a slab the warp starts: [`slab::warp_hint`]).
//!
//! **Lanes may pass different heaps** (or null, or a heap of another kind). A whole warp is
//! checked for one heap with one `match.any.sync` over the full warp before any straight-line
//! path (`malloc`: one `match.all.sync` on heap and class together, [`heap_class_key`]); any
//! other warp goes to the generic path, which first groups the calling lanes by heap
//! (one `match_any`, [`Among::grouped`]) and then runs each group's collectives over that
//! group's lanes only, a set fixed from then on. A lane whose heap is null or of another kind
//! takes part in the grouping, then returns null (or frees nothing) with the rest of its group,
//! so no collective ever names a lane that has left.

use crate::bump::{self, Bump};
use crate::general;
use crate::heap_layout::{
    GeneralHeader, HeapHandle, GENERAL_CLASS_SLOTS, HEAP_MAGIC, KIND_BUMP, KIND_SLAB,
};
use crate::slab::{self, Slab};
use crate::warp::{Among, Warp};
use static_assertions::const_assert;

#[cfg(target_arch = "nvptx64")]
use crate::global_mem::{load_class_handle, load_class_pointer, load_handle};
#[cfg(target_arch = "nvptx64")]
use crate::nvptx::load_general;
#[cfg(not(target_arch = "nvptx64"))]
use host::{load_class_handle, load_class_pointer, load_general, load_handle};

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
/// A whole warp calling together on one heap (the common case) takes the straight-line path
/// over a register copy of the handle; any other set of lanes, or a warp that the first segment
/// of a chain could not serve, takes the generic one, out of line.
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
    if any.active() == u32::MAX {
        // The handle's loads go out before the match, so that their round trip overlaps it.
        // SAFETY: forwarded contract.
        let h = unsafe { load_handle(heap, tag(KIND_SLAB)) };
        if one_heap(full, heap as u64) {
            // SAFETY: forwarded contract; every lane of the warp passed `heap`.
            return unsafe { slab_alloc_whole(heap, h, full, any, seed, false) };
        }
    }
    // SAFETY: forwarded contract.
    unsafe { slab_alloc_generic::<_, _, false>(heap, any, seed) }
}

/// Whether every lane of a whole warp (`full`, all 32 lanes calling together) passed the same
/// `heap`: one `match.any.sync` over the literal full mask, the same answer in every lane.
#[inline(always)]
fn one_heap<F: Warp>(full: &F, heap: u64) -> bool {
    full.match_any(u32::MAX, heap) == u32::MAX
}

/// [`one_heap`] without a match: lane 0's heap, shuffled, against every lane's, in a ballot.
/// `free` spends its one match on the class instead.
#[inline(always)]
fn same_heap<F: Warp>(full: &F, heap: u64) -> bool {
    let first = full.shfl64(u32::MAX, heap, 0);
    full.ballot(u32::MAX, heap == first) == u32::MAX
}

/// [`slab_alloc`] for all 32 lanes of a warp on one `heap`, whose handle `h` is as
/// `load_handle` read it (so the same in every lane); `cursor`: a general heap's class, whose
/// shard counts are cursors ([`Slab::cursors`]).
///
/// # Safety
/// As for [`slab_alloc`]; every lane of the warp makes this call with the same `heap`.
#[inline(always)]
unsafe fn slab_alloc_whole<F: Warp, G: Warp, S: Fn() -> u32 + Copy>(
    heap: *const HeapHandle,
    h: Option<HeapHandle>,
    full: &F,
    any: &G,
    seed: S,
    cursor: bool,
) -> *mut u8 {
    let Some(h) = h else {
        return core::ptr::null_mut();
    };
    // SAFETY: `h` is a copy of the formatted slab handle at `heap`.
    let slab = unsafe { Slab::with_copy(&h, &*heap) }.cursors(cursor);
    let p = slab.alloc_in_chain(full, slab::warp_hint(seed(), h.capacity));
    if p.is_null() {
        // SAFETY: as above; read here only, so the fast path never holds it.
        let next = unsafe { (*heap).next };
        if next != 0 {
            let next = next as *const HeapHandle;
            // SAFETY: `next` is the next formatted segment of the chain.
            return unsafe {
                if cursor {
                    slab_alloc_generic::<_, _, true>(next, any, seed)
                } else {
                    slab_alloc_generic::<_, _, false>(next, any, seed)
                }
            };
        }
    }
    p
}

/// [`slab_alloc`] for any set of lanes and heaps: the lanes are grouped by heap, and each group
/// allocates from its own heap's chain, segment by segment, with collectives over its own lanes.
/// A group whose heap is null or no slab gets null, having taken part in the grouping only.
/// `CURSOR` as `cursor` for [`slab_alloc_whole`] (a parameter of the type, so that the slab's
/// callers pass nothing more).
///
/// # Safety
/// As for [`slab_alloc`].
#[cold]
#[inline(never)]
unsafe fn slab_alloc_generic<W: Warp, S: Fn() -> u32, const CURSOR: bool>(
    heap: *const HeapHandle,
    warp: &W,
    seed: S,
) -> *mut u8 {
    let group = Among::grouped(warp, heap as u64);
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_SLAB) } {
        // SAFETY: a formatted slab chain; the lanes of `group` pass the same one.
        Some(h) => unsafe {
            slab::chain_alloc_in(h, &group, slab::warp_hint(seed(), h.capacity), CURSOR)
        },
        None => core::ptr::null_mut(),
    }
}

/// Returns a block to the slab heap at `heap`. Null is ignored; other pointers that are not
/// blocks of the heap are counted as foreign frees and ignored. A second free of a block that
/// is still free changes nothing (counted on checked heaps); a second free after the block was
/// handed out again cannot be told from its new owner's free, and frees the new owner's block.
///
/// A whole warp on one heap freeing the run of one word of the first segment (what one
/// allocation gave it) takes the straight-line path; anything else, the generic one, out of
/// line.
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
    // A lane freeing null leaves before any collective: `activemask` no longer names it.
    if ptr.is_null() {
        return;
    }
    if any.active() == u32::MAX && one_heap(full, heap as u64) {
        // SAFETY: forwarded contract; every lane of the warp passed `heap`.
        if unsafe { slab_free_whole(heap, h, ptr, full, false) } {
            return;
        }
    }
    // SAFETY: forwarded contract.
    unsafe { slab_free_generic::<_, false>(heap, ptr, any) }
}

/// [`slab_free`]'s straight-line path for all 32 lanes of a warp on one `heap` (its handle `h`
/// as `load_handle` read it): true when it is done, the same in every lane; false, having done
/// nothing, when the pointers are not one run. `cursor` as for [`slab_alloc_whole`].
///
/// # Safety
/// As for [`slab_free`]; every lane of the warp makes this call with the same `heap`.
#[inline(always)]
unsafe fn slab_free_whole<F: Warp>(
    heap: *const HeapHandle,
    h: Option<HeapHandle>,
    ptr: *mut u8,
    full: &F,
    cursor: bool,
) -> bool {
    match h {
        // No slab: nothing to free, for the whole warp.
        None => true,
        // SAFETY: `h` is a copy of the formatted slab handle at `heap`.
        Some(h) => unsafe { Slab::with_copy(&h, &*heap) }
            .cursors(cursor)
            .free_run(full, ptr),
    }
}

/// [`slab_free`] for any set of lanes, heaps and pointers: the lanes are grouped by heap, and
/// each group frees into its own heap's chain with collectives over its own lanes. `CURSOR` as
/// for [`slab_alloc_generic`].
///
/// # Safety
/// As for [`slab_free`].
#[cold]
#[inline(never)]
unsafe fn slab_free_generic<W: Warp, const CURSOR: bool>(
    heap: *const HeapHandle,
    ptr: *mut u8,
    warp: &W,
) {
    let group = Among::grouped(warp, heap as u64);
    // SAFETY: forwarded contract.
    if let Some(h) = unsafe { handle(heap, KIND_SLAB) } {
        // SAFETY: a formatted slab chain; the lanes of `group` pass the same one.
        unsafe { slab::chain_free_each_in(h, &group, ptr, CURSOR) }
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
    if any.active() == u32::MAX {
        // SAFETY: forwarded contract.
        let h = unsafe { load_handle(heap, tag(KIND_BUMP)) };
        if one_heap(full, heap as u64) {
            // One heap: `h` is the same in every lane.
            let Some(h) = h else {
                return core::ptr::null_mut();
            };
            // SAFETY: `h` is a copy of the formatted bump handle at `heap`.
            let p = unsafe { Bump::with_copy(&h, &*heap) }.alloc_in_chain(full, bytes, align);
            if p.is_null() {
                // SAFETY: as above; read here only, so the fast path never holds it.
                let next = unsafe { (*heap).next };
                if next != 0 {
                    // SAFETY: `next` is the next formatted segment of the chain.
                    return unsafe {
                        bump_alloc_generic(next as *const HeapHandle, bytes, align, any)
                    };
                }
            }
            return p;
        }
    }
    // SAFETY: forwarded contract.
    unsafe { bump_alloc_generic(heap, bytes, align, any) }
}

/// [`bump_alloc`] for any set of lanes and heaps: grouped by heap, as in
/// [`slab_alloc_generic`], then segment by segment.
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
    let group = Among::grouped(warp, heap as u64);
    // SAFETY: forwarded contract.
    match unsafe { handle(heap, KIND_BUMP) } {
        // SAFETY: a formatted bump chain; the lanes of `group` pass the same one.
        Some(h) => unsafe { bump::chain_alloc(h, &group, bytes, align) },
        None => core::ptr::null_mut(),
    }
}

/// Allocates `bytes` from the general heap at `heap` (a block of the smallest size class that
/// holds it: 16 B to 64 KiB, then whole power-of-two blocks up to 16 MiB); null when the class
/// is exhausted, when `bytes` is 0 or past the heap's largest class in use (counted as failed
/// allocations), or when `heap` is not a general heap. Blocks are aligned to 16 bytes, or to
/// the class size when it is a power of two (up to 4096).
///
/// Lanes may ask for different sizes: a whole warp on one heap asking one class takes that
/// class's straight-line slab path; otherwise the lanes are grouped by heap, then by class,
/// out of line.
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
        let loaded = unsafe { load_general(heap, slot) };
        // One match for heap and class, over the whole warp, before anything waits for the
        // loads: a warp on one heap asking one class learns it in the loads' shadow.
        let key = heap_class_key(heap as u64, class);
        if full.match_all(u32::MAX, key) && key & KEY_CLASS_BITS != KEY_UNALIGNED {
            let Some((front, head)) = loaded else {
                return core::ptr::null_mut();
            };
            if class < front.nclasses {
                let head = head as *const HeapHandle;
                // SAFETY: `class < nclasses`: the address of that class's formatted slab
                // segment, the same in every lane.
                return unsafe {
                    let h = load_class_handle(head);
                    slab_alloc_whole(head, h, full, any, seed, true)
                };
            }
        }
    }
    // SAFETY: forwarded contract.
    unsafe { malloc_generic(heap, bytes, any, seed) }
}

/// The low bits of [`heap_class_key`] that hold the class.
pub const KEY_CLASS_BITS: u64 = 63;
/// [`heap_class_key`]'s class bits for a heap address that is not 64-byte aligned: no class.
pub const KEY_UNALIGNED: u64 = KEY_CLASS_BITS;
const_assert!((general::NO_CLASS as u64) < KEY_UNALIGNED);

/// The key on which [`malloc`] matches a whole warp: `heap | class` for a 64-byte aligned heap
/// (carve formats every general header at least 4096-byte aligned), so lanes agree on the key
/// exactly when they pass the same heap and ask the same class; `heap |` [`KEY_UNALIGNED`]
/// otherwise, which no aligned heap's key equals, and which [`malloc`] sends to the generic
/// path even when every lane holds it.
#[inline(always)]
pub fn heap_class_key(heap: u64, class: u32) -> u64 {
    if heap & KEY_CLASS_BITS == 0 {
        heap | class as u64
    } else {
        heap | KEY_UNALIGNED
    }
}

/// [`malloc`] for any set of lanes, heaps and sizes: grouped by heap, then by class
/// ([`general::malloc`]).
///
/// # Safety
/// As for [`malloc`].
#[cold]
#[inline(never)]
unsafe fn malloc_generic<W: Warp, S: Fn() -> u32>(
    heap: *const GeneralHeader,
    bytes: u64,
    warp: &W,
    seed: S,
) -> *mut u8 {
    let group = Among::grouped(warp, heap as u64);
    // SAFETY: forwarded contract.
    match unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap; the lanes of `group` pass the same one.
        Some(g) => unsafe { general::malloc(g, &group, bytes, seed()) },
        None => core::ptr::null_mut(),
    }
}

/// Returns a block to the general heap at `heap`; its class is found from the pointer alone.
/// Null is ignored; other pointers that are no block of the heap are counted as foreign frees
/// and ignored. Double frees as for [`slab_free`]: counted while the block is free, and, once it
/// was handed out again, a free of the new owner's block.
///
/// # Safety
/// As for [`malloc`]; the block must not be used after this call.
#[inline(always)]
pub unsafe fn free<F: Warp, G: Warp>(heap: *const GeneralHeader, ptr: *mut u8, full: &F, any: &G) {
    if any.active() == u32::MAX {
        // SAFETY: forwarded contract.
        let loaded = unsafe { load_general(heap, 0) };
        if same_heap(full, heap as u64) {
            let Some((front, _)) = loaded else {
                return;
            };
            let key = front.free_key(ptr);
            // One match over the whole warp, which a warp of mixed classes needs for its groups
            // and a warp of one class answers as well as `match_all`. The mixed groups go on
            // here, with the literal full mask, not through the generic path, which would match
            // heap and key again under the active mask.
            let group = full.match_any(u32::MAX, key as u64);
            if group != u32::MAX {
                // SAFETY: a general header (its tag was read), the same in every lane; `group`
                // is this lane's key among all 32 lanes, which make this call together.
                return unsafe { general::free_mixed(&*heap, any, u32::MAX, (key, group), ptr) };
            }
            if key < front.nclasses {
                // SAFETY: a general header, and `key < nclasses <= GENERAL_CLASS_SLOTS`.
                let head = unsafe { load_class_pointer(heap, key) } as *const HeapHandle;
                // SAFETY: the address of class `key`'s formatted slab segment, the head of the
                // chain that holds `ptr` if anything does, the same in every lane; `ptr` is
                // not null (its key is a class).
                unsafe {
                    let h = load_class_handle(head);
                    if !slab_free_whole(head, h, ptr, full, true) {
                        slab_free_generic::<_, true>(head, ptr, any);
                    }
                }
                return;
            }
        }
    }
    // SAFETY: forwarded contract.
    unsafe { free_generic(heap, ptr, any) }
}

/// [`free`] for any set of lanes, heaps and pointers: grouped by heap, then by class
/// ([`general::free`]).
///
/// # Safety
/// As for [`free`].
#[cold]
#[inline(never)]
unsafe fn free_generic<W: Warp>(heap: *const GeneralHeader, ptr: *mut u8, warp: &W) {
    let group = Among::grouped(warp, heap as u64);
    // SAFETY: forwarded contract.
    if let Some(g) = unsafe { general::header(heap) } {
        // SAFETY: a formatted general heap; the lanes of `group` pass the same one.
        unsafe { general::free(g, &group, ptr) }
    }
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

    /// Class segment `head`'s handle, if `head` is not null.
    ///
    /// # Safety
    /// `head` is null or a class pointer of a formatted general header.
    #[inline(always)]
    pub unsafe fn load_class_handle(head: *const HeapHandle) -> Option<HeapHandle> {
        // SAFETY: the caller's contract.
        (!head.is_null()).then(|| unsafe { *head })
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
