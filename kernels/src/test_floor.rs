//! Floors for the mixed-size rows of `carve bench device-alloc`: what grouping a warp's lanes by
//! size class costs, with one or two atomics per group and no heap behind them.
//!
//! `carve_malloc` with mixed sizes makes, per class group of a warp, a reservation `fetch_add`
//! on a shard count and a dependent Acquire `fetch_or` on a bitmap word; `carve_free` a Release
//! `fetch_and` and a `fetch_sub`. These kernels make the same atomics on bare arrays (a count
//! per shard of each class, with a given number of shards per class, and 64 words per shard),
//! for the sizes the mixed bench asks, and nothing else: no header, no handle, no retry, no
//! exhaustion. What they run at bounds what any design that takes one reservation and one claim
//! per class group can reach; a free with the `fetch_and` alone bounds any free that makes one
//! atomic per group, and [`carve_bench_floor_cache_free`] one that makes a single atomic per warp.

use crate::general::{bench_request_size, request_class, FLOOR_HW_SLOTS, FLOOR_WORDS_LOG2};
use crate::nvptx::{self, NvptxWarp};
use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use crate::warp::{rank_in, Warp};

/// The index in the floor's `words` of the word that holds position `pos` of `shard`.
#[inline(always)]
fn word_of(shard: u32, pos: u32) -> usize {
    ((shard as usize) << FLOOR_WORDS_LOG2) + ((pos >> 6) as usize & ((1 << FLOOR_WORDS_LOG2) - 1))
}

/// Thread `i < n` asks for `bench_request_size(i, seed, max)` bytes; the lanes of one class
/// form a group, whose leader adds the group's size to the count of its class's shard (picked
/// from the warp index, bit-reversed, as the slab's hints are). With `claim`, the leader then
/// sets the group's bits with an Acquire `fetch_or` in the word the count points to. Each lane
/// writes its position to `out[i]` (class in the top byte).
///
/// # Safety
/// `counts` holds `classes << shards_log2` `u32`s, `words` `classes << (shards_log2 + 6)`
/// `u64`s, for every class the sizes reach; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_floor_malloc(
    counts: *mut u32,
    words: *mut u64,
    out: *mut u64,
    n: u64,
    max: u64,
    seed: u32,
    shards_log2: u32,
    claim: u32,
) {
    let i = nvptx::global_thread_index();
    if i >= n {
        return;
    }
    let w = NvptxWarp;
    let class = request_class(bench_request_size(i, seed, max));
    let active = w.active();
    let group = w.match_any(active, class as u64);
    let leader = group.trailing_zeros();
    let shard = (class << shards_log2) | (nvptx::warp_index().reverse_bits() >> (32 - shards_log2));
    let mut old = 0;
    if w.lane() == leader {
        // SAFETY: the caller's contract: `shard` indexes `counts`.
        let c = unsafe { &*(counts.add(shard as usize) as *const AtomicU32) };
        old = c.fetch_add(group.count_ones(), Ordering::Relaxed);
        if claim != 0 {
            let word = word_of(shard, old);
            let bits = (u64::MAX >> (64 - group.count_ones())) << (old & 63);
            // SAFETY: as above: `word` indexes `words`.
            let a = unsafe { &*(words.add(word) as *const AtomicU64) };
            // The result is waited for, as the heap's claim must.
            if w.fetch_or_acquire(a, bits) == u64::MAX {
                old = u32::MAX;
            }
        }
    }
    let pos = w
        .shfl(active, old, leader)
        .wrapping_add(rank_in(group, w.lane()));
    // SAFETY: i < n.
    unsafe {
        out.add(i as usize)
            .write((class as u64) << 56 | ((shard as u64) << 32) | pos as u64)
    };
}

/// The free side of [`carve_bench_floor_malloc`]: thread `i < n` reads `out[i]`; the lanes of
/// one shard form a group, whose leader clears the group's bits with a Release `fetch_and`
/// and, with `count`, subtracts the bits it cleared from the shard's count, as the slab's free
/// does. Without `count` it bounds a free that makes one atomic per group.
///
/// # Safety
/// As for [`carve_bench_floor_malloc`], after it wrote `out`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_floor_free(
    counts: *mut u32,
    words: *mut u64,
    out: *const u64,
    n: u64,
    count: u32,
) {
    let i = nvptx::global_thread_index();
    if i >= n {
        return;
    }
    let w = NvptxWarp;
    // SAFETY: i < n.
    let v = unsafe { out.add(i as usize).read() };
    let shard = (v >> 32) as u32 & 0xFF_FFFF;
    let active = w.active();
    let group = w.match_any(active, shard as u64);
    if w.lane() == group.trailing_zeros() {
        let pos = v as u32;
        let word = word_of(shard, pos);
        let bits = (u64::MAX >> (64 - group.count_ones())) << (pos & 63);
        // SAFETY: the caller's contract: `word` indexes `words` and `shard` indexes `counts`.
        let a = unsafe { &*(words.add(word) as *const AtomicU64) };
        let freed = (w.fetch_and_release(a, !bits) & bits).count_ones();
        if count != 0 && freed > 0 {
            // SAFETY: as above.
            let c = unsafe { &*(counts.add(shard as usize) as *const AtomicU32) };
            c.fetch_sub(freed, Ordering::Relaxed);
        }
    }
}

/// The floor of a free that defers its work to a cache per hardware warp slot
/// ([`nvptx::hw_warp_slot`]): thread `i < n` reads `out[i]`; the warp's first lane takes room
/// for the warp's lanes in its slot's ring with one `fetch_add` on the slot's count (one per
/// 128-byte line), and each lane stores its value there. One atomic per warp, whatever the
/// classes: a bound on frees that cache blocks instead of clearing them.
///
/// # Safety
/// `slots` holds [`FLOOR_HW_SLOTS`] entries of 32 `u32`s, `ring` `FLOOR_HW_SLOTS << ring_log2`
/// `u64`s; `out` holds `n` `u64`s.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_bench_floor_cache_free(
    slots: *mut u32,
    ring: *mut u64,
    out: *const u64,
    n: u64,
    ring_log2: u32,
) {
    let i = nvptx::global_thread_index();
    if i >= n {
        return;
    }
    let w = NvptxWarp;
    // SAFETY: i < n.
    let v = unsafe { out.add(i as usize).read() };
    let active = w.active();
    let leader = active.trailing_zeros();
    // Masked, so that an `%smid` past 255 shares a slot rather than leaving the arrays.
    let slot = nvptx::hw_warp_slot() & (FLOOR_HW_SLOTS as u32 - 1);
    let mut at = 0;
    if w.lane() == leader {
        // SAFETY: the caller's contract, 32 u32s for each of the FLOOR_HW_SLOTS; `slot` is masked.
        let c = unsafe { &*(slots.add(slot as usize * 32) as *const AtomicU32) };
        at = c.fetch_add(active.count_ones(), Ordering::Relaxed);
    }
    let at = w
        .shfl(active, at, leader)
        .wrapping_add(rank_in(active, w.lane()));
    let k = ((slot as usize) << ring_log2) + (at as usize & ((1 << ring_log2) - 1));
    // SAFETY: the caller's contract: `k` indexes `ring`.
    unsafe { ring.add(k).write(v) };
}
