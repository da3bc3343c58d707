//! Block-cooperative bump allocation (`carve_bump_alloc_block`): every thread of a thread block
//! calls together, and the block takes **one** reservation from the arena instead of one per
//! warp.
//!
//! 1. Each warp sums its lanes' sizes (a prefix over the warp, as [`Bump::alloc`] does) and its
//!    leader publishes `(total, requests, alignment)` in the block's scratch word for that warp.
//! 2. Barrier. The block's first thread lays the warps out one after another (each warp's part
//!    aligned to that warp's alignment), reserves the whole from the chain's first segment that
//!    has room (a per-SM slot when it fits in a quarter chunk, else the global offset), and
//!    writes each warp's offset over its word and the block's base in the last word.
//! 3. Barrier. Each warp leader reads its offset and the base and shuffles them to its lanes.
//!
//! Two barriers and no third: a warp's word is written by its own leader (step 1) and by the
//! first thread (step 2), and read by the first thread (step 2) and its own leader (step 3);
//! the next call's step 1 comes after this call's last barrier, and its step 2 after the next
//! call's first barrier, by which every leader has finished reading.

use crate::bump::{Bump, GRANULE};
use crate::heap_layout::HeapHandle;
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::warp::{rank_in, Warp};

/// Scratch words a block needs: one per warp (at most 32) and the base.
pub const BLOCK_SCRATCH_WORDS: usize = 33;
const BASE_WORD: u32 = 32;

/// Largest request a lane may make through the block path (a warp's total must fit the 40 bits
/// a scratch word gives it).
pub const BLOCK_MAX_REQUEST: u64 = 1 << 34;

// A warp's most, 32 lanes of the largest request, fits its 40 bits.
static_assertions::const_assert!(32 * BLOCK_MAX_REQUEST < 1 << 40);

/// The base word when the block asked for nothing (every lane invalid).
const NOTHING: u64 = u64::MAX - 1;
/// The base word when the reservation failed.
const FAILED: u64 = u64::MAX;

/// A thread block, as the block-cooperative allocation sees it: the calling thread's warp, its
/// index, the block's barrier and its shared scratch.
pub trait Block {
    /// The calling thread's warp.
    type W: Warp;
    /// The calling thread's warp.
    fn warp(&self) -> &Self::W;
    /// The calling warp's index in the block (`< warps()`).
    fn warp_index(&self) -> u32;
    /// Warps in the block, at most 32.
    fn warps(&self) -> u32;
    /// Scratch word `i` (`< BLOCK_SCRATCH_WORDS`), one for the whole block.
    fn scratch(&self, i: u32) -> &AtomicU64;
    /// Waits until every thread of the block has called; memory written before is visible to
    /// every thread after.
    fn sync(&self);
}

/// `(total bytes, requests, log2 alignment)` packed into a scratch word: 40, 16 and 8 bits.
#[inline(always)]
fn pack(total: u64, requests: u32, align_log2: u32) -> u64 {
    total | (requests as u64) << 40 | (align_log2 as u64) << 56
}

#[inline(always)]
fn unpack(w: u64) -> (u64, u32, u32) {
    (
        w & ((1 << 40) - 1),
        ((w >> 40) & 0xFFFF) as u32,
        (w >> 56) as u32,
    )
}

#[inline(always)]
fn round_up(v: u64, align: u64) -> u64 {
    (v + align - 1) & !(align - 1)
}

/// Allocates `bytes` aligned to `align` for every thread of `block`, from the chain of bump
/// segments at `h`, with one reservation for the whole block. Null for a zero size, an
/// alignment that is not a power of two up to 4096, a request over [`BLOCK_MAX_REQUEST`], or
/// when no segment has room for the block's total (then every thread of the block gets null:
/// the block is served whole or not at all). Failures are counted in the first segment.
///
/// # Safety
/// `h` and every `next` handle must satisfy [`Bump::new`] for the call; every thread of the
/// block calls with the same `h`, and reaches the call (as for `__syncthreads`).
pub unsafe fn chain_alloc_block<B: Block>(
    h: &HeapHandle,
    block: &B,
    bytes: u64,
    align: u64,
) -> *mut u8 {
    let warp = block.warp();
    let active = warp.active();
    let lane = warp.lane();
    let leader = active.trailing_zeros();
    let align = align.max(GRANULE);
    let ok = bytes != 0 && bytes <= BLOCK_MAX_REQUEST && align.is_power_of_two() && align <= 4096;
    let oks = warp.ballot(active, ok);
    let any = warp.or_reduce(active, if ok { align } else { 0 });
    let warp_align = if any == 0 {
        GRANULE
    } else {
        1 << (63 - any.leading_zeros())
    };
    let size = if ok { round_up(bytes, warp_align) } else { 0 };
    let (prefix, total) = if warp.match_all(active, size) {
        let n = active.count_ones() as u64;
        (rank_in(active, lane) as u64 * size, n * size)
    } else {
        warp_prefix(warp, active, size)
    };
    let invalid = warp.ballot(active, !ok && bytes != 0).count_ones();
    let w = block.warp_index();
    if lane == leader {
        let word = pack(total, oks.count_ones(), warp_align.trailing_zeros());
        block.scratch(w).store(word, Ordering::Relaxed);
        if invalid != 0 {
            // SAFETY: the caller's contract.
            unsafe { Bump::new(h) }.count_failures(warp.slot_hint(), invalid as u64);
        }
    }
    block.sync();
    if w == 0 && lane == leader {
        // SAFETY: the caller's contract.
        let base = unsafe { reserve_for_block(h, block) };
        block.scratch(BASE_WORD).store(base, Ordering::Relaxed);
    }
    block.sync();
    let (mut base, mut off) = (0, 0);
    if lane == leader {
        base = block.scratch(BASE_WORD).load(Ordering::Relaxed);
        off = block.scratch(w).load(Ordering::Relaxed);
    }
    let base = warp.shfl64(active, base, leader);
    let off = warp.shfl64(active, off, leader);
    if !ok || base >= NOTHING {
        return core::ptr::null_mut();
    }
    (base + off + prefix) as *mut u8
}

/// Each lane's offset in its warp's part and the part's total, for sizes that differ.
#[cold]
#[inline(never)]
fn warp_prefix<W: Warp>(warp: &W, active: u32, size: u64) -> (u64, u64) {
    let lane = warp.lane();
    let (mut prefix, mut total) = (0, 0);
    let mut rest = active;
    while rest != 0 {
        let src = rest.trailing_zeros();
        rest &= rest - 1;
        let s = warp.shfl64(active, size, src);
        if src < lane {
            prefix += s;
        }
        total += s;
    }
    (prefix, total)
}

/// Step 2, on the block's first thread: lays the warps out, rewrites each warp's word with its
/// offset, reserves the block's total and returns its base ([`NOTHING`], [`FAILED`]).
///
/// # Safety
/// As for [`chain_alloc_block`].
#[inline(never)]
unsafe fn reserve_for_block<B: Block>(h: &HeapHandle, block: &B) -> u64 {
    let (mut off, mut align, mut requests) = (0u64, GRANULE, 0u64);
    for i in 0..block.warps() {
        let word = block.scratch(i);
        let (total, n, a) = unpack(word.load(Ordering::Relaxed));
        off = round_up(off, 1 << a);
        word.store(off, Ordering::Relaxed);
        off += total;
        align = align.max(1 << a);
        requests += n as u64;
    }
    if requests == 0 {
        return NOTHING;
    }
    // Room to align the start whatever granule the reservation lands on.
    let request = off + align - GRANULE;
    let slot = block.warp().slot_hint();
    let mut seg = h;
    loop {
        // SAFETY: the caller's contract covers every segment of the chain.
        let b = unsafe { Bump::new(seg) };
        if let Some(at) = b.reserve_for(slot, request) {
            return round_up(seg.data + at, align);
        }
        if seg.next == 0 {
            // SAFETY: as above.
            unsafe { Bump::new(h) }.count_failures(slot, requests);
            return FAILED;
        }
        // SAFETY: as above; `next` is the next segment of the chain.
        seg = unsafe { &*(seg.next as *const HeapHandle) };
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for (t, n, a) in [(0, 0, 4), ((1 << 40) - 1, 1024, 12), (4096, 32, 4)] {
            assert_eq!(unpack(pack(t, n, a)), (t, n, a));
        }
    }
}
