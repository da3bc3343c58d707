//! Allocation over a chain of heap segments (linked by `next`), for the allocators whose
//! segments serve a warp at a time: [`crate::slab::chain_alloc`] and
//! [`crate::bump::chain_alloc`]. Only the allocation from one segment differs between them
//! ([`SegmentAlloc`]); the walk is here, once.

use crate::heap_layout::HeapHandle;
use crate::warp::{Among, Warp};

/// The allocation from one segment of a chain.
///
/// It is called with two warp types, the caller's and [`Among`] it, so its warp is a generic
/// parameter of the method, not of the trait.
pub(crate) trait SegmentAlloc {
    /// Allocates for each calling lane of `warp` from `seg`; null for lanes left without.
    /// `last`: `seg` ends the chain (its failures are the chain's, to count).
    ///
    /// # Safety
    /// `seg` must be a formatted segment of this allocator's kind whose arrays stay valid, and
    /// are accessed only atomically by others, for the duration of the call.
    unsafe fn alloc<V: Warp>(&mut self, seg: &HeapHandle, warp: &V, last: bool) -> *mut u8;

    /// Called, by the lanes that go on to `seg` (a segment after the chain's first), before they
    /// allocate from it.
    #[inline(always)]
    fn entering(&mut self, seg: &HeapHandle) {
        let _ = seg;
    }
}

/// Allocates with `each` from the chain of segments starting at `h`, segment by segment, until
/// every calling lane has a block or the chain ends.
///
/// Two walks, chosen at compile time: a warp whose `active()` follows the lanes running (the
/// GPU's `activemask`) simply loops, as the lanes a segment served leave; a fixed set of lanes
/// goes on as a narrower [`Among`]. The first keeps the GPU's generic path small: ptxas inlines
/// it into the kernels, and a larger one made it spill the fast path (H100, 2^24 × 16 B:
/// 127.8 -> 100 G/s).
///
/// # Safety
/// `h` and every `next` handle must satisfy [`SegmentAlloc::alloc`]'s contract for the duration
/// of the call.
#[inline(always)]
pub(crate) unsafe fn alloc<W: Warp, A: SegmentAlloc>(
    h: &HeapHandle,
    warp: &W,
    mut each: A,
) -> *mut u8 {
    if W::TRACKS_ACTIVE {
        // The served lanes leave; `active()` then names the rest by itself.
        let mut h = h;
        loop {
            let last = h.next == 0;
            // SAFETY: the caller vouches for every segment of the chain.
            let p = unsafe { each.alloc(h, warp, last) };
            if !p.is_null() || last {
                return p;
            }
            // SAFETY: as above; `next` is a handle of the chain.
            h = unsafe { &*(h.next as *const HeapHandle) };
            each.entering(h);
        }
    }
    let active = warp.active();
    // SAFETY: the caller vouches for every segment of the chain.
    let mut p = unsafe { each.alloc(h, warp, h.next == 0) };
    let mut h = h;
    while h.next != 0 {
        // The lanes a segment left without a block go on to the next as a warp of their own:
        // `warp` may name a fixed set of lanes (`Among`), and the served ones take no part.
        let pending = warp.ballot(active, p.is_null());
        if pending == 0 {
            break;
        }
        // SAFETY: as above; `next` is a handle of the chain.
        h = unsafe { &*(h.next as *const HeapHandle) };
        if p.is_null() {
            let rest = Among {
                warp,
                mask: pending,
            };
            each.entering(h);
            // SAFETY: as above; exactly the lanes of `pending` make this call.
            p = unsafe { each.alloc(h, &rest, h.next == 0) };
        }
    }
    p
}
