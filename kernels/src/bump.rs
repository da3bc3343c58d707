//! The bump arena: allocation only, reset by the host between launches.
//!
//! Two levels, so that global memory sees few atomics:
//! - the lanes of a warp that call together are served by one reservation (sizes rounded to the
//!   warp's largest alignment, offsets by rank: [`Bump::alloc`]);
//! - that reservation comes from a per-SM *slot* when chunking is on: the slot holds
//!   `(chunk tag << 32) | bytes used` and one `fetch_add` reserves within the current chunk
//!   ([`Bump::reserve_in_slot`]). The one warp whose reservation crosses the chunk's end takes a
//!   new chunk from the global offset and installs it; the others that crossed wait for the tag
//!   to change and retry. Large requests, and arenas too small to chunk, go to the global
//!   offset directly ([`Bump::reserve_global`]).
//!
//! The global offset moves by `fetch_add` only while it is inside the arena, so it never wraps:
//! it ends at most the requests in flight past the capacity. A slot's byte count can run past its chunk only by what the warps resident on that SM add
//! before the closer installs the next chunk (each at most a quarter chunk), far below 2^32.

use crate::chain::{self, SegmentAlloc};
use crate::heap_layout::*;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::spin_loop;
use crate::warp::{rank_in, Warp};

/// Granule of every reservation: all sizes are rounded up to it, and chunks start on it.
pub const GRANULE: u64 = 16;

/// `v` rounded up to `align`, a power of two.
#[inline(always)]
fn round_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// A view of one formatted bump segment.
#[derive(Clone, Copy, Debug)]
pub struct Bump<'a> {
    /// The fields the fast path reads (on the GPU, a copy in registers).
    h: &'a HeapHandle,
    /// The handle in the region, for the out-of-line paths (see [`crate::slab::Slab`]).
    home: &'a HeapHandle,
}

impl<'a> Bump<'a> {
    /// Views a bump segment.
    ///
    /// # Safety
    /// `h` must describe a formatted bump arena (see [`crate::heap_layout`]) whose arrays stay
    /// valid, and are accessed only atomically by others, for `'a`.
    #[inline(always)]
    pub unsafe fn new(h: &'a HeapHandle) -> Self {
        Bump { h, home: h }
    }

    /// Views a bump segment through `copy`, a copy of the handle at `home` (equal to it).
    ///
    /// # Safety
    /// As for [`Bump::new`], for `home`.
    #[inline(always)]
    pub unsafe fn with_copy(copy: &'a HeapHandle, home: &'a HeapHandle) -> Self {
        debug_assert!(copy == home);
        Bump { h: copy, home }
    }

    #[inline(always)]
    fn at_home(&self) -> Self {
        Bump {
            h: self.home,
            home: self.home,
        }
    }

    #[inline(always)]
    fn offset(&self) -> &'a AtomicU64 {
        // SAFETY: `new`'s contract: `shard_used` is the arena's offset for 'a.
        unsafe { &*(self.h.shard_used as *const AtomicU64) }
    }

    #[inline(always)]
    fn slot(&self, i: u32) -> &'a AtomicU64 {
        debug_assert!(i < self.h.nwords);
        // SAFETY: `words` holds `nwords` slot atomics, `BUMP_SLOT_STRIDE` apart, for 'a.
        unsafe { &*(self.h.words as *const AtomicU64).add(i as usize * BUMP_SLOT_STRIDE) }
    }

    #[inline(always)]
    fn chunk(&self) -> u64 {
        1u64 << self.h.shard_words_log2
    }

    /// Reserves `bytes` (a multiple of [`GRANULE`]) from the global offset; returns the arena
    /// offset, or `None` when they do not fit.
    ///
    /// One `fetch_add`, not a compare-and-swap loop: with every SM refilling chunks, a CAS loop
    /// on one address serialises them. Only callers that saw the offset inside the arena add,
    /// so it overshoots the capacity by at most the requests in flight at that moment, and a
    /// failed request is never undone (an undo could make a later, fitting request fail).
    #[inline(always)]
    pub fn reserve_global(&self, bytes: u64) -> Option<u64> {
        let off = self.offset();
        let cap = self.h.capacity;
        if bytes > cap || off.load(Ordering::Relaxed) > cap - bytes {
            return None;
        }
        let old = off.fetch_add(bytes, Ordering::Relaxed);
        (old <= cap - bytes).then_some(old)
    }

    /// Reserves `bytes` (a multiple of [`GRANULE`], at most a quarter chunk) from slot `s`;
    /// returns the arena offset, or `None` when neither a chunk nor the arena's tail has room.
    ///
    /// Inline: the one `fetch_add` that lands inside the slot's chunk. Out of line: the rest of
    /// the protocol (`reserve_in_slot_slow`).
    #[inline(always)]
    pub fn reserve_in_slot(&self, s: u32, bytes: u64) -> Option<u64> {
        let old = slot_add(self.slot(s), bytes);
        let tag = (old >> 32) as u32;
        let used = old & 0xFFFF_FFFF;
        if tag != CHUNK_NONE && tag != CHUNK_EXHAUSTED && used + bytes <= self.chunk() {
            return Some(((tag as u64 - 1) * GRANULE) + used);
        }
        self.at_home().reserve_in_slot_slow(s, bytes, old)
    }

    /// [`Bump::reserve_in_slot`] after a `fetch_add` that returned `old` and did not fit: install
    /// a chunk, wait for another warp to, or fall back to the arena's tail.
    #[cold]
    #[inline(never)]
    fn reserve_in_slot_slow(&self, s: u32, bytes: u64, old: u64) -> Option<u64> {
        let slot = self.slot(s);
        let chunk = self.chunk();
        let mut old = old;
        loop {
            let tag = (old >> 32) as u32;
            let used = old & 0xFFFF_FFFF;
            if tag == CHUNK_EXHAUSTED {
                slot.fetch_sub(bytes, Ordering::Relaxed);
                // The arena's tail, shorter than a chunk, may still fit this request.
                return self.reserve_global(bytes);
            }
            let limit = if tag == CHUNK_NONE { 0 } else { chunk };
            if used + bytes <= limit {
                return Some(((tag as u64 - 1) * GRANULE) + used);
            }
            if used <= limit {
                // This warp crossed the end: it alone installs the next chunk, taking the front
                // of it for itself. Everyone else's additions since are overwritten; they wait.
                return match self.reserve_global(chunk) {
                    Some(start) => {
                        let tag = start / GRANULE + 1;
                        slot.store((tag << 32) | bytes, Ordering::Release);
                        Some(start)
                    }
                    None => {
                        slot.store((CHUNK_EXHAUSTED as u64) << 32, Ordering::Release);
                        self.reserve_global(bytes)
                    }
                };
            }
            while (slot.load(Ordering::Acquire) >> 32) as u32 == tag {
                spin_loop();
            }
            old = slot.fetch_add(bytes, Ordering::Acquire);
        }
    }

    /// Allocates `bytes` aligned to `align` for each calling lane; null when exhausted, for a
    /// zero size, or an alignment that is not a power of two (or exceeds a quarter chunk).
    ///
    /// The common case, every lane asking the same valid size and alignment, is found with one
    /// `match.all` and served straight-line: one reservation for the warp, one shuffle of its
    /// base. Mixed requests go out of line (`alloc_mixed`).
    #[inline(always)]
    pub fn alloc<W: Warp>(
        &self,
        warp: &W,
        bytes: u64,
        align: u64,
        count_failures: bool,
    ) -> *mut u8 {
        self.alloc_counting(warp, bytes, align, Some(count_failures))
    }

    /// [`Bump::alloc`] that counts failures when this is the last segment of its chain (read
    /// only on a failure, so the fast path never loads `next`).
    #[inline(always)]
    pub fn alloc_in_chain<W: Warp>(&self, warp: &W, bytes: u64, align: u64) -> *mut u8 {
        self.alloc_counting(warp, bytes, align, None)
    }

    #[inline(always)]
    fn alloc_counting<W: Warp>(
        &self,
        warp: &W,
        bytes: u64,
        align: u64,
        count: Option<bool>,
    ) -> *mut u8 {
        let active = warp.active();
        let align = align.max(GRANULE);
        let ok = self.valid(bytes, align) && bytes < 1 << 58;
        let key = if ok {
            bytes | ((align.trailing_zeros() as u64) << 58)
        } else {
            u64::MAX
        };
        // Every lane votes before any leaves (the collective needs all of `active`).
        let uniform = warp.match_all(active, key);
        if uniform && key != u64::MAX {
            let size = round_up(bytes, align);
            let total = active.count_ones() as u64 * size;
            let base = self.reserve_warp(warp, active, align, total, count);
            if base == u64::MAX {
                return core::ptr::null_mut();
            }
            // The offset is computed only now, so it is not held across the reservation.
            return (base + rank_in(active, warp.lane()) as u64 * size) as *mut u8;
        }
        self.at_home().alloc_mixed(warp, bytes, align, count)
    }

    #[inline(always)]
    fn valid(&self, bytes: u64, align: u64) -> bool {
        bytes != 0
            && align.is_power_of_two()
            && align <= 4096
            && bytes <= self.h.capacity
            && self.h.capacity - bytes >= align
    }

    /// [`Bump::alloc`] when the lanes' requests differ or some are invalid: invalid lanes get
    /// null, the others one reservation sized by a prefix sum over the warp.
    #[cold]
    #[inline(never)]
    fn alloc_mixed<W: Warp>(
        &self,
        warp: &W,
        bytes: u64,
        align: u64,
        count: Option<bool>,
    ) -> *mut u8 {
        let ok = self.valid(bytes, align);
        let entered = warp.active();
        let mask = warp.ballot(entered, ok);
        if !ok {
            if bytes != 0 && count.unwrap_or(self.h.next == 0) {
                self.count_failures(warp.slot_hint(), 1);
            }
            return core::ptr::null_mut();
        }
        let lane = warp.lane();
        // Alignments are powers of two, so their OR's top bit is the largest.
        let any = warp.or_reduce(mask, align);
        let warp_align = 1u64 << (63 - any.leading_zeros());
        let size = round_up(bytes, warp_align);
        let mut prefix = 0;
        let mut total = 0;
        let mut rest = mask;
        while rest != 0 {
            let src = rest.trailing_zeros();
            rest &= rest - 1;
            let s = warp.shfl64(mask, size, src);
            if src < lane {
                prefix += s;
            }
            total += s;
        }
        let base = self.reserve_warp(warp, mask, warp_align, total, count);
        if base == u64::MAX {
            core::ptr::null_mut()
        } else {
            (base + prefix) as *mut u8
        }
    }

    /// One reservation of `total` bytes aligned to `warp_align` for the lanes of `mask`, by its
    /// lowest lane: its address, the same for every lane, or `u64::MAX` when it failed.
    #[inline(always)]
    fn reserve_warp<W: Warp>(
        &self,
        warp: &W,
        mask: u32,
        warp_align: u64,
        total: u64,
        count: Option<bool>,
    ) -> u64 {
        let leader = mask.trailing_zeros();
        // Room to align the warp's start to `warp_align` whatever granule it lands on.
        let request = total + warp_align - GRANULE;
        let mut base = u64::MAX;
        if warp.lane() == leader {
            if let Some(off) = self.reserve_for(warp.slot_hint(), request) {
                base = round_up(self.h.data + off, warp_align);
            } else {
                self.at_home()
                    .warp_failed(warp.slot_hint(), mask.count_ones(), count);
            }
        }
        warp.shfl64(mask, base, leader)
    }

    /// Counts `n` failed requests if `count` says so (`None`: if this is the chain's last segment).
    #[cold]
    #[inline(never)]
    fn warp_failed(&self, slot: u32, n: u32, count: Option<bool>) {
        if count.unwrap_or(self.h.next == 0) {
            self.count_failures(slot, n as u64);
        }
    }

    /// Reserves `request` bytes (a multiple of [`GRANULE`]) for one caller: from slot `slot`
    /// (wrapped to the slots there are) when chunking is on and it fits a quarter chunk, else
    /// from the global offset. Returns the arena offset.
    #[inline(always)]
    pub fn reserve_for(&self, slot: u32, request: u64) -> Option<u64> {
        if self.h.nwords > 0 && request <= self.chunk() / 4 {
            let s = if slot < self.h.nwords {
                slot
            } else {
                wrap_slot(slot, self.h.nwords)
            };
            self.reserve_in_slot(s, request)
        } else {
            self.reserve_global(request)
        }
    }

    /// Counts `n` failed requests (counter slot `slot`).
    #[inline(always)]
    pub fn count_failures(&self, slot: u32, n: u64) {
        let i = COUNTER_FAILED_ALLOCS * COUNTER_SLOTS + slot as usize % COUNTER_SLOTS;
        // SAFETY: `counters` holds COUNTERS × COUNTER_SLOTS atomics for 'a.
        let c = unsafe { &*(self.h.counters as *const AtomicU64).add(i) };
        c.fetch_add(n, Ordering::Relaxed);
    }
}

/// `slot.fetch_add(v)`. Acquire on the host, where the loom models check the chunk protocol with
/// it; relaxed on the GPU, as `core`'s atomics are there: no block changes hands through a slot
/// (chunks are never reused within a launch).
#[inline(always)]
fn slot_add(slot: &AtomicU64, v: u64) -> u64 {
    #[cfg(target_arch = "nvptx64")]
    return crate::global_mem::fetch_add_global(slot, v);
    #[cfg(not(target_arch = "nvptx64"))]
    return slot.fetch_add(v, Ordering::Acquire);
}

/// `s % n`, out of line (more SMs than slots is rare).
#[cold]
#[inline(never)]
fn wrap_slot(s: u32, n: u32) -> u32 {
    s % n
}

/// Allocates from the chain of bump segments starting at `h`, segment by segment, `bytes`
/// aligned to `align` for each calling lane, as for [`Bump::alloc`].
///
/// # Safety
/// `h` and every `next` handle must satisfy [`Bump::new`] for the duration of the call.
#[inline(always)]
pub unsafe fn chain_alloc<W: Warp>(h: &HeapHandle, warp: &W, bytes: u64, align: u64) -> *mut u8 {
    // SAFETY: forwarded contract; `BumpSegments` views each segment with `Bump::new`.
    unsafe { chain::alloc(h, warp, BumpSegments { bytes, align }) }
}

/// [`chain_alloc`]'s allocation from one segment: the same request in each.
struct BumpSegments {
    bytes: u64,
    align: u64,
}

impl SegmentAlloc for BumpSegments {
    #[inline(always)]
    unsafe fn alloc<V: Warp>(&mut self, seg: &HeapHandle, warp: &V, last: bool) -> *mut u8 {
        // SAFETY: the trait's contract, for a bump segment.
        unsafe { Bump::new(seg) }.alloc(warp, self.bytes, self.align, last)
    }
}
