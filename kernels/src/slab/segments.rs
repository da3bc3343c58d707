//! Chains of slab segments: allocation segment by segment, and frees into whichever segment
//! holds the block.

use super::{rescale_hint, Slab};
use crate::chain::{self, SegmentAlloc};
use crate::heap_layout::HeapHandle;
use crate::warp::Warp;

/// Allocates from the chain of slab segments starting at `h`, segment by segment, a block for
/// each calling lane; `hint` is a block index of the first segment, as for [`Slab::alloc`], and
/// moves to the same place in proportion in each later one.
///
/// # Safety
/// `h` and every `next` handle must satisfy [`Slab::new`] for the duration of the call.
#[inline(always)]
pub unsafe fn chain_alloc<W: Warp>(h: &HeapHandle, warp: &W, hint: u64) -> *mut u8 {
    // SAFETY: forwarded contract.
    unsafe { chain_alloc_in(h, warp, hint, false) }
}

/// [`chain_alloc`] over segments whose shard counts are cursors when `cursor` ([`Slab::cursors`]:
/// a general heap's classes).
///
/// # Safety
/// As for [`chain_alloc`].
#[inline(always)]
pub(crate) unsafe fn chain_alloc_in<W: Warp>(
    h: &HeapHandle,
    warp: &W,
    hint: u64,
    cursor: bool,
) -> *mut u8 {
    let each = SlabSegments {
        hint,
        first_capacity: h.capacity,
        at: hint,
        cursor,
        count: true,
    };
    // SAFETY: forwarded contract; `SlabSegments` views each segment with `Slab::new`.
    unsafe { chain::alloc(h, warp, each) }
}

/// [`chain_alloc`] for the lanes that the chain's first segment, `h`, left without a block: the
/// segments after it, with `hint` (a block index of `h`) moved in proportion. Null when `h` ends
/// the chain. The last segment counts the lanes it leaves without a block as failed when
/// `count` (false when the caller tries again elsewhere).
///
/// # Safety
/// As for [`chain_alloc`].
#[inline(always)]
pub(crate) unsafe fn chain_alloc_after<W: Warp>(
    h: &HeapHandle,
    warp: &W,
    hint: u64,
    (cursor, count): (bool, bool),
) -> *mut u8 {
    if h.next == 0 {
        return core::ptr::null_mut();
    }
    // SAFETY: the caller vouches for every segment of the chain.
    let next = unsafe { &*(h.next as *const HeapHandle) };
    let each = SlabSegments {
        hint,
        first_capacity: h.capacity,
        at: rescale_hint(hint, h.capacity, next.capacity),
        cursor,
        count,
    };
    // SAFETY: forwarded contract; `SlabSegments` views each segment with `Slab::new`.
    unsafe { chain::alloc(next, warp, each) }
}

/// [`chain_alloc`]'s allocation from one segment: from `at`, the hint moved to that segment.
struct SlabSegments {
    /// The caller's hint, a block index of the first segment.
    hint: u64,
    /// The first segment's blocks.
    first_capacity: u64,
    /// Where the current segment's allocation starts.
    at: u64,
    /// The segments' shard counts are cursors.
    cursor: bool,
    /// The last segment counts its failures.
    count: bool,
}

impl SegmentAlloc for SlabSegments {
    #[inline(always)]
    unsafe fn alloc<V: Warp>(&mut self, seg: &HeapHandle, warp: &V, last: bool) -> *mut u8 {
        // SAFETY: the trait's contract, for a slab segment.
        unsafe { Slab::new(seg) }
            .cursors(self.cursor)
            .alloc(warp, self.at, last && self.count)
    }

    /// The same place in proportion: a hint spread over the first segment would crowd every
    /// warp into the start of a larger one.
    #[inline(always)]
    fn entering(&mut self, seg: &HeapHandle) {
        self.at = rescale_hint(self.hint, self.first_capacity, seg.capacity);
    }
}

/// Frees `ptr` into whichever segment of the chain at `h` holds it; counts it as foreign if none.
///
/// # Safety
/// As for [`chain_alloc`]; `ptr` must not be used after this call if it is a block of the heap.
#[inline(always)]
pub unsafe fn chain_free<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { chain_free_in(h, warp, ptr, false) }
}

/// [`chain_free`], `cursor` as for [`chain_alloc_in`].
///
/// # Safety
/// As for [`chain_free`].
#[inline(always)]
pub(crate) unsafe fn chain_free_in<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8, cursor: bool) {
    // SAFETY: the caller vouches for the chain.
    if unsafe { Slab::new(h) }.cursors(cursor).free_run(warp, ptr) {
        return;
    }
    // SAFETY: as above.
    unsafe { chain_free_each_in(h, warp, ptr, cursor) }
}

/// [`chain_free`] lane by lane: each lane finds its segment, then the lanes of a segment free
/// together in groups of one bitmap word.
///
/// # Safety
/// As for [`chain_free`].
#[inline(always)]
pub unsafe fn chain_free_each<W: Warp>(h: &HeapHandle, warp: &W, ptr: *mut u8) {
    // SAFETY: forwarded contract.
    unsafe { chain_free_each_in(h, warp, ptr, false) }
}

/// [`chain_free_each`], `cursor` as for [`chain_alloc_in`].
///
/// # Safety
/// As for [`chain_free`].
#[inline(always)]
pub(crate) unsafe fn chain_free_each_in<W: Warp>(
    h: &HeapHandle,
    warp: &W,
    ptr: *mut u8,
    cursor: bool,
) {
    // Each lane finds its segment (or none) with no collective...
    let mut seg = h;
    let found = loop {
        // SAFETY: the caller vouches for every segment of the chain.
        let slab = unsafe { Slab::new(seg) }.cursors(cursor);
        if let Some(idx) = slab.index_of(ptr) {
            break Some((slab, idx));
        }
        if seg.next == 0 {
            break None;
        }
        // SAFETY: as above.
        seg = unsafe { &*(seg.next as *const HeapHandle) };
    };
    // ...then every calling lane, pointers of no segment included, groups by segment before
    // any leaves: a fixed set of lanes (`Among`) names all of them in its collectives. Group by
    // segment, not only by word: lanes that found different segments may be converged here,
    // and a group's head clears a run of its own segment's word.
    let active = warp.active();
    let key = found.map_or(0, |_| seg as *const HeapHandle as u64);
    let same = if warp.match_all(active, key) {
        active
    } else {
        warp.match_any(active, key)
    };
    match found {
        Some((slab, idx)) => slab.free_index_among(warp, idx, same),
        // SAFETY: as above.
        None => unsafe { Slab::new(h) }.count_foreign(warp.slot_hint()),
    }
}
