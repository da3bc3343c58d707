//! The general heap: `carve_malloc(heap, bytes)` / `carve_free(heap, ptr)` over one slab segment
//! per size class ([`crate::size_class`]), laid out as [`GeneralHeader`] describes.
//!
//! **Allocation.** Each lane maps its request to a class. When every calling lane asks for the
//! same class (a warp allocating one size, the common case) the warp runs that class's slab
//! allocation as it is, straight-line on a full warp. Otherwise the lanes are grouped by class
//! (`match_any`), and every group's leader reserves and claims blocks for its lanes in one step
//! of the whole warp (see [`malloc`]'s mixed path); only groups left short finish as warps of
//! their own lanes ([`Among`]).
//! Requests above 64 KiB take a large class (a whole power-of-two block, up to 16 MiB) when the
//! heap has it in use: a large class is in use when one of its blocks fits a class's bytes.
//! Requests of 0 bytes, or past the largest class in use, return null and are counted as failed
//! allocations in the header's counters.
//!
//! **Free.** The class of a pointer is `(ptr - base) >> stride_log2` (class segments sit at equal
//! power-of-two strides), so no size is passed and nothing is searched; lanes are grouped by class
//! the same way: a group freeing a run of blocks is cleared in one step of the whole warp (one
//! atomic per bitmap word it touches), and any other group frees into its class's slab as a warp
//! of its own lanes (the slab counts pointers that are not one of its blocks). Pointers outside
//! every class are counted as foreign frees in the header; null is ignored.
//!
//! The header is read-only while kernels run, and every atomic is the slab's own, on one class's
//! segment at a time (grouping only narrows which lanes take part). The class slabs' shard counts
//! are cursors ([`crate::heap_layout::FLAG_CURSOR_SHARDS`]): a group's free is one `fetch_and`,
//! and the bitmap alone says which blocks are in use.

use crate::exact_div::class_quotient;
use crate::heap_layout::*;
use crate::size_class::{class_of, class_size, NUM_CLASSES};
use crate::slab::{self, Lead, Slab};
use crate::sync::atomic::{AtomicU64, Ordering};
use crate::warp::{rank_in, Among, Warp};
use bytemuck::Zeroable;

/// The first 8 bytes of a formatted general header (`magic`, then `kind`).
pub const GENERAL_TAG: u64 = HEAP_MAGIC as u64 | (KIND_GENERAL as u64) << 32;

/// Group key of requests that no class serves (and of pointers outside every class).
pub const NO_CLASS: u32 = NUM_CLASSES as u32;
/// Group key of null pointers passed to free.
const NULL_KEY: u32 = NO_CLASS + 1;

/// The header at `heap` if it is a formatted general heap.
///
/// # Safety
/// `heap` is null or the address of a heap region that carve formatted and keeps alive.
#[inline(always)]
pub unsafe fn header<'a>(heap: *const GeneralHeader) -> Option<&'a GeneralHeader> {
    if heap.is_null() {
        return None;
    }
    // SAFETY: the caller passes the address of a heap region; its first 8 bytes are the tag of
    // whichever kind it is (the header is 8-byte aligned).
    let tag = unsafe { (heap as *const u64).read() };
    // SAFETY: as above; a general region starts with a whole header.
    (tag == GENERAL_TAG).then(|| unsafe { &*heap })
}

/// The class that serves a request of `bytes`, or [`NO_CLASS`].
#[inline(always)]
pub fn request_class(bytes: u64) -> u32 {
    if bytes > u32::MAX as u64 {
        return NO_CLASS;
    }
    match class_of(bytes as u32) {
        Some(c) => c,
        None => NO_CLASS,
    }
}

/// The group key of `ptr` for [`free`] in a general heap of `nclasses` classes from `base` at
/// strides of `1 << stride_log2`: see [`free_key`]. Always below [`NO_CLASS`] for a class, so
/// that a header claiming more classes than it has slots names none past them.
#[inline(always)]
pub fn key_of(base: u64, stride_log2: u32, nclasses: u32, ptr: *mut u8) -> u32 {
    if ptr.is_null() {
        return NULL_KEY;
    }
    let c = (ptr as u64).wrapping_sub(base) >> stride_log2;
    if c < nclasses.min(NO_CLASS) as u64 {
        c as u32
    } else {
        NO_CLASS
    }
}

/// The fields of a general header that `carve_malloc` and `carve_free` read on every call.
#[derive(Clone, Copy, Debug)]
pub struct GeneralFront {
    /// [`GeneralHeader::nclasses`].
    pub nclasses: u32,
    /// [`GeneralHeader::stride_log2`].
    pub stride_log2: u32,
    /// [`GeneralHeader::base`].
    pub base: u64,
}

impl GeneralFront {
    /// [`free_key`] from these fields.
    #[inline(always)]
    pub fn free_key(&self, ptr: *mut u8) -> u32 {
        key_of(self.base, self.stride_log2, self.nclasses, ptr)
    }
}

impl GeneralHeader {
    /// The class whose segment holds `ptr`, or `None` outside every class.
    #[inline(always)]
    pub fn class_of_ptr(&self, ptr: *const u8) -> Option<u32> {
        let c = key_of(self.base, self.stride_log2, self.nclasses, ptr.cast_mut());
        (c < self.nclasses).then_some(c)
    }

    /// Class `c`'s slab segment handle (`c < nclasses`): the head of its chain.
    ///
    /// Loaded from `classes[c]`, not computed from `base`: a class that grew between launches
    /// has its newest segment at the head, so that allocations try it first.
    ///
    /// # Safety
    /// `self` is a formatted header whose class segments stay valid for `'a`.
    #[inline(always)]
    pub unsafe fn class_handle<'a>(&self, c: u32) -> &'a HeapHandle {
        debug_assert!(c < self.nclasses);
        // SAFETY: the caller's contract: `classes[c]` is a formatted slab handle.
        unsafe { &*(self.classes[c as usize] as *const HeapHandle) }
    }

    /// Adds `n` to counter `which` (slot `slot`).
    ///
    /// # Safety
    /// As for [`GeneralHeader::class_handle`]: `counters` is the header's counter array.
    #[inline(always)]
    unsafe fn count(&self, which: usize, slot: u32, n: u32) {
        let i = which * COUNTER_SLOTS + (slot as usize % COUNTER_SLOTS);
        // SAFETY: `counters` holds COUNTERS × COUNTER_SLOTS atomics.
        let a = unsafe { &*(self.counters as *const AtomicU64).add(i) };
        a.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Allocates `bytes` for each calling lane of `warp` (each lane its own size); null where no
/// class serves the size or the class is exhausted. `seed` picks where in each class's slab the
/// warp starts (the warp's index in the grid on the GPU: see [`slab::warp_hint`]).
///
/// # Safety
/// `g` is a formatted general header whose segments stay valid for the call.
#[inline(always)]
pub unsafe fn malloc<W: Warp>(g: &GeneralHeader, warp: &W, bytes: u64, seed: u32) -> *mut u8 {
    let class = request_class(bytes);
    let active = warp.active();
    if warp.match_all(active, class as u64) {
        // These lanes as a fixed set: the class's paths read `active()` again, and on the GPU
        // `activemask` there may name lanes that entered apart, asking other classes, and
        // reconverged (one claim would then serve lanes of two classes), or leave out lanes of
        // this set that fell behind.
        // SAFETY: forwarded contract; exactly the lanes of `active` ask `class`.
        return unsafe { alloc_class(g, &Among { warp, mask: active }, class, seed) };
    }
    let group = warp.match_any(active, class as u64);
    // SAFETY: forwarded contract.
    unsafe { malloc_mixed(g, warp, active, (class, group), seed) }
}

/// A register copy of `h`: on the GPU, read-only vector loads (`ld.global.nc`), which the
/// handle allows because nothing writes it while kernels run.
///
/// # Safety
/// `h` is a formatted slab handle in a heap region carve keeps alive.
#[inline(always)]
unsafe fn copy_handle(h: &HeapHandle) -> HeapHandle {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: a handle sits at the 16-byte aligned start of its segment, in global memory, and
    // is read-only while kernels run.
    return unsafe { crate::global_mem::read_handle(h) };
    #[cfg(not(target_arch = "nvptx64"))]
    *h
}

/// [`malloc`] for lanes of several classes (`group`: the lanes of this lane's `class`).
///
/// The fast step's collectives name all of `active`. A collective whose mask differs between
/// lanes compiles to a loop over the distinct masks (ptxas), so collectives per class group run
/// the groups one after another. Instead, every group's leader reserves and claims its run at
/// once, then what the run missed among the clear bits of its word ([`Slab::lead_retrying`]
/// names no other lane), and shuffles hand each lane its own leader's result. Only groups left
/// short (a word without enough clear bits, a shard without room) finish as warps of their own
/// lanes, where ptxas serialises them.
///
/// The groups that finish do so in place, not in a loop that takes one group per round while
/// the rest of the warp waits at a collective: on the H100, that loop hung a kernel whose lanes
/// were in `carve_malloc` and `carve_free` at once (the GPU stress test), though either entry
/// point alone ran.
///
/// # Safety
/// As for [`malloc`]; exactly the lanes of `active` make this call.
#[inline(always)]
unsafe fn malloc_mixed<W: Warp>(
    g: &GeneralHeader,
    warp: &W,
    active: u32,
    (class, group): (u32, u32),
    seed: u32,
) -> *mut u8 {
    let lane = warp.lane();
    let leader = group.trailing_zeros();
    let lanes = group.count_ones();
    // A group's lanes read the same handle, into registers before the leaders' atomics: read
    // through the region, the fields the claim needs load only after the reservation returns
    // (its Acquire keeps later loads after it).
    // SAFETY: forwarded contract; `class < nclasses`.
    let home = (class < g.nclasses).then(|| unsafe { g.class_handle(class) });
    // SAFETY: `home` is a formatted slab handle.
    let copy = home.map_or(HeapHandle::zeroed(), |h| unsafe { copy_handle(h) });
    // SAFETY: `copy` is a copy of the formatted slab handle `home`.
    let slab = home.map(|h| unsafe { Slab::with_copy(&copy, h) }.cursors(true));
    let (mut hint, mut shard) = (0, 0);
    if let Some(s) = slab {
        hint = slab::group_hint(seed, s.capacity());
        shard = s.shard_of(hint);
    }
    let (mut take, mut won, mut extra) = (0, 0, 0);
    let mut at = hint;
    if lane == leader {
        match slab {
            Some(s) => (at, take, won, extra) = s.lead_retrying(warp, hint, lanes),
            // SAFETY: forwarded contract.
            None => unsafe { g.count(COUNTER_FAILED_ALLOCS, warp.slot_hint(), lanes) },
        }
    }
    // The run's start moves by less than a shard: 32 bits carry it.
    let moved = warp.shfl(active, at.wrapping_sub(hint) as u32, leader);
    let lead = Lead {
        shard,
        hint: hint.wrapping_add(moved as i32 as u64),
        take,
        won: warp.shfl(active, won, leader),
        extra: warp.shfl64(active, extra, leader),
        mask: slab.map_or(0, |s| s.shard_mask()),
        at_cursor: true,
    };
    let mut p = core::ptr::null_mut();
    if let Some(s) = slab {
        if let Some(i) = lead.block(rank_in(group, lane)) {
            p = s.block(i);
        }
    }
    let done = slab.is_none() || lead.won.count_ones() + lead.extra.count_ones() == lanes;
    if let Some(s) = slab.filter(|_| !done) {
        let own = Among { warp, mask: group };
        // A run that won nothing lies on blocks in use: its shard's cursor has gone round, and
        // in a class that grew (its newest segment first) the head is likely full. The group
        // tries the rest of the chain at once, and the head's other shards only if that fails:
        // searched first, shard by shard, they cost the most exactly where they have least room.
        let straight_on = lead.won == 0 && lead.extra == 0 && s.home().next != 0;
        if straight_on {
            // SAFETY: forwarded contract; exactly the lanes of `group` make this call.
            p = unsafe { slab::chain_alloc_after(s.home(), &own, hint, (true, false)) };
            let rest = own.ballot(group, p.is_null());
            if rest != 0 && p.is_null() {
                p = s.finish(&Among { warp, mask: rest }, lead, Some(true));
            }
        } else {
            p = s.finish(&own, lead, None);
            // The rest of the class's chain, for the lanes its head left without a block.
            let rest = own.ballot(group, p.is_null());
            if rest != 0 && p.is_null() {
                let rest = Among { warp, mask: rest };
                // The region's handle: the copy's address, passed on, would put it in local
                // memory.
                // SAFETY: forwarded contract; exactly the lanes of `rest` make this call.
                p = unsafe { slab::chain_alloc_after(s.home(), &rest, hint, (true, true)) };
            }
        }
    }
    p
}

/// One block of `class` for each lane of `warp` (all asking for `class`).
///
/// # Safety
/// As for [`malloc`].
#[inline(always)]
unsafe fn alloc_class<W: Warp>(g: &GeneralHeader, warp: &W, class: u32, seed: u32) -> *mut u8 {
    if class >= g.nclasses {
        let active = warp.active();
        if warp.lane() == active.trailing_zeros() {
            // SAFETY: forwarded contract.
            unsafe { g.count(COUNTER_FAILED_ALLOCS, warp.slot_hint(), active.count_ones()) };
        }
        return core::ptr::null_mut();
    }
    // SAFETY: forwarded contract; `class < nclasses`.
    let h = unsafe { g.class_handle(class) };
    let hint = if warp.active() == u32::MAX {
        slab::warp_hint(seed, h.capacity)
    } else {
        slab::group_hint(seed, h.capacity)
    };
    // SAFETY: a formatted slab segment and the rest of its class's chain.
    unsafe { slab::chain_alloc_in(h, warp, hint, true) }
}

/// The group key of `ptr` for [`free`]: its class, [`NO_CLASS`] outside every class, or a key of
/// its own for null.
#[inline(always)]
pub fn free_key(g: &GeneralHeader, ptr: *mut u8) -> u32 {
    key_of(g.base, g.stride_log2, g.nclasses, ptr)
}

/// Frees `ptr` for each calling lane of `warp` (each lane its own pointer, of any class). Null
/// is ignored; a pointer outside every class, or not at a block's start, is counted as a foreign
/// free and ignored.
///
/// # Safety
/// As for [`malloc`]; a block of the heap must not be used after this call.
#[inline(always)]
pub unsafe fn free<W: Warp>(g: &GeneralHeader, warp: &W, ptr: *mut u8) {
    let key = free_key(g, ptr);
    let active = warp.active();
    if warp.match_all(active, key as u64) {
        // A fixed set, as in `malloc`: a free's run over lanes of two classes would clear blocks
        // of one class that the other's lanes stand for.
        // SAFETY: forwarded contract; exactly the lanes of `active` pass pointers of `key`.
        return unsafe { free_class(g, &Among { warp, mask: active }, key, ptr) };
    }
    let group = warp.match_any(active, key as u64);
    // SAFETY: forwarded contract.
    unsafe { free_mixed(g, warp, active, (key, group), ptr) }
}

/// [`free`] for lanes of several keys (`group`: the lanes of this lane's `key`), on the plan of
/// [`malloc_mixed`]: every group whose pointers are a run of its class's first segment, in rank
/// order (blocks freed as they were handed out), is cleared at once with one Release
/// `fetch_and` per bitmap word the run touches: the leader clears the first word's part, and
/// the lane of the run's first block in the next word that word's, every such lane of the warp
/// in one atomic instruction, so that one fence serves them all ([`Slab::free_blocks`] frees a
/// run in the same parts). Null and foreign groups are settled by their leaders in the same
/// step; only the other groups free as warps of their own lanes, in place.
///
/// Only the leaders read their class's handle, and only what the run needs: the lanes test the
/// run against the leader's pointer with the class's block size, which every segment of a class
/// shares. The block index divides by that size without a branch ([`class_quotient`]), so the
/// leaders of different classes take one path.
///
/// # Safety
/// As for [`free`]; exactly the lanes of `active` make this call.
#[inline(always)]
pub(crate) unsafe fn free_mixed<W: Warp>(
    g: &GeneralHeader,
    warp: &W,
    active: u32,
    (key, group): (u32, u32),
    ptr: *mut u8,
) {
    let lane = warp.lane();
    let leader = group.trailing_zeros();
    let lanes = group.count_ones();
    // A key below NO_CLASS is a class of this header (`free_key`).
    let class = key < NO_CLASS;
    let size = if class { class_size(key) as u64 } else { 0 };
    let rank = rank_in(group, lane);
    let first = warp.shfl64(active, ptr as u64, leader);
    let in_run = !class || ptr as u64 == first.wrapping_add(rank as u64 * size);
    // The leader's part of its run, when the run lies in the class's first segment: the
    // address of the run's first bitmap word (0 for none: no bitmap lies at 0), its first bit
    // there, and how many of the run's blocks lie in the next word. All read before the ballot,
    // so that the `fetch_and` after it waits on no load.
    let (mut at, mut o, mut next) = (0u64, 0u32, 0u32);
    if lane == leader && class {
        // SAFETY: forwarded contract; `key < nclasses`.
        let h = unsafe { class_head(g, key) };
        // SAFETY: a formatted slab handle in the region.
        let (capacity, data, words) = unsafe { run_fields(h) };
        let off = (ptr as u64).wrapping_sub(data);
        if let Some(i) = class_quotient(off, size).filter(|&i| i + lanes as u64 <= capacity) {
            let w;
            (w, o, next) = slab::run_parts(i, lanes);
            at = words + w as u64 * 8;
        }
    }
    // A run that crosses into the next word: the lane of its first block there clears its part
    // of that word, in the leader's atomic instruction (one fence for both words). Its Release
    // orders the group's accesses as the leader's does.
    let next = warp.shfl(active, next, leader);
    let next_at = warp.shfl64(active, at + 8, leader);
    // Also waits for every lane's accesses to its block before the Releases.
    let not_run = warp.ballot(active, !in_run || (lane == leader && class && at == 0));
    if not_run & group == 0 {
        // Never the leader, whose block lies in the first word.
        let upper = next > 0 && rank == lanes - next;
        let bits = if upper {
            at = next_at;
            slab::part_bits(0, next)
        } else {
            slab::part_bits(o, lanes - next)
        };
        if at != 0 && (upper || lane == leader) {
            // SAFETY: a word of the bitmap of class `key`'s first segment, which holds the run.
            let word = unsafe { &*(at as *const AtomicU64) };
            // Release: as in `Slab::free_run`.
            let freed = (warp.fetch_and_release(word, !bits) & bits).count_ones();
            if freed < bits.count_ones() {
                // SAFETY: forwarded contract; `key < nclasses`.
                let h = unsafe { class_head(g, key) };
                // SAFETY: a formatted slab segment.
                unsafe { Slab::new(h) }
                    .cursors(true)
                    .count_double_frees(warp.slot_hint(), bits.count_ones() - freed);
            }
        } else if lane == leader && key == NO_CLASS {
            // SAFETY: forwarded contract.
            unsafe { g.count(COUNTER_FOREIGN_FREES, warp.slot_hint(), lanes) };
        }
    } else {
        // Lanes freeing one by one instead (a `fetch_and` and a count each) measured slower
        // than the group's collectives, though ptxas runs those one group at a time.
        // SAFETY: forwarded contract; exactly the lanes of `group` make this call.
        unsafe { free_class(g, &Among { warp, mask: group }, key, ptr) };
    }
}

/// The `capacity`, `data` and `words` fields of the slab handle at `h`, for a leader's free of a
/// run: on the GPU two read-only 16-byte loads issued together (the handle is read-only while
/// kernels run).
///
/// # Safety
/// `h` is a formatted slab handle in a heap region carve keeps alive.
#[inline(always)]
unsafe fn run_fields(h: &HeapHandle) -> (u64, u64, u64) {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract.
    return unsafe { crate::global_mem::read_run_fields(h) };
    #[cfg(not(target_arch = "nvptx64"))]
    (h.capacity, h.data, h.words)
}

/// Class `c`'s head segment (`c < nclasses`), as [`GeneralHeader::class_handle`] gives it: on
/// the GPU one read-only load, which a later collective's memory clobber does not undo.
///
/// # Safety
/// As for [`GeneralHeader::class_handle`].
#[inline(always)]
unsafe fn class_head<'a>(g: &GeneralHeader, c: u32) -> &'a HeapHandle {
    #[cfg(target_arch = "nvptx64")]
    // SAFETY: the caller's contract; a general header in global memory, `c < nclasses`.
    return unsafe { &*(crate::global_mem::load_class_pointer(g, c) as *const HeapHandle) };
    #[cfg(not(target_arch = "nvptx64"))]
    // SAFETY: the caller's contract.
    unsafe {
        g.class_handle(c)
    }
}

/// Frees `ptr` for each lane of `warp` (all of key `key`).
///
/// # Safety
/// As for [`free`].
#[inline(always)]
pub unsafe fn free_class<W: Warp>(g: &GeneralHeader, warp: &W, key: u32, ptr: *mut u8) {
    if key == NULL_KEY {
        return;
    }
    // A key below NO_CLASS is a class of this header (`free_key`).
    if key >= NO_CLASS {
        let active = warp.active();
        if warp.lane() == active.trailing_zeros() {
            // SAFETY: forwarded contract.
            unsafe { g.count(COUNTER_FOREIGN_FREES, warp.slot_hint(), active.count_ones()) };
        }
        return;
    }
    // SAFETY: forwarded contract; `key < nclasses`.
    let h = unsafe { g.class_handle(key) };
    // SAFETY: a formatted slab segment; the caller gives up `ptr`.
    unsafe { slab::chain_free_in(h, warp, ptr, true) }
}

/// A hash of `i` and `seed`, spread over all 64 bits (splitmix-style).
#[inline(always)]
fn mix(i: u64, seed: u32) -> u64 {
    let mut x = (i ^ (seed as u64) << 32).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x ^ (x >> 32)
}

/// The request size of thread `i` in carve's mixed-size tests (`carve_test_general_*` kernels
/// and their host checks): a hash of `i` and `seed` over 16 B to 4 KiB, a multiple of 4.
pub fn test_request_size(i: u64, seed: u32) -> u64 {
    16 + 4 * (mix(i, seed) % 1021)
}

/// log2 of the bitmap words per shard (64: 4096 blocks) in the arrays of the mixed-size
/// benchmark's floor kernels, which the host sizes.
pub const FLOOR_WORDS_LOG2: u32 = 6;

/// Hardware warp slots (`%smid << 6 | %warpid`: up to 256 SMs of 64 warps) in the arrays of the
/// cached-free floor kernel, which the host sizes: a 32-`u32` line of count per slot.
pub const FLOOR_HW_SLOTS: usize = 64 << 8;

/// The request size of thread `i` in the mixed-size benchmarks: a hash of `i` and `seed`,
/// uniform over `16..=max` bytes (`max >= 16`).
#[inline(always)]
pub fn bench_request_size(i: u64, seed: u32, max: u64) -> u64 {
    16 + mix(i, seed) % (max - 15)
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;
    use crate::size_class::NUM_SMALL_CLASSES;

    #[test]
    fn requests_map_to_classes_or_none() {
        assert_eq!(request_class(0), NO_CLASS);
        assert_eq!(request_class(1), 0);
        assert_eq!(request_class(65_536), NUM_SMALL_CLASSES as u32 - 1);
        assert_eq!(request_class(65_537), NUM_SMALL_CLASSES as u32);
        assert_eq!(request_class(16 << 20), NUM_CLASSES as u32 - 1);
        assert_eq!(request_class((16 << 20) + 1), NO_CLASS);
        assert_eq!(request_class(u32::MAX as u64 + 17), NO_CLASS);
    }
}
