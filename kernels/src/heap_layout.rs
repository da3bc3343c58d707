//! The device heap's shared layout: the [`HeapHandle`] that kernels receive (by address) and the
//! host writes, and the arithmetic that places its arrays inside one reserved region.
//!
//! A region is `[handle | counters | slab: shard used, shard peak, bitmap | bump: slots | data]`.
//! Everything before `data` reads as a fresh heap when zeroed, except the handle itself, so the
//! host formats a heap with one memset and one 128-byte copy, and reads its statistics back with
//! one copy of the metadata prefix (no format kernel).

use bytemuck::{Pod, Zeroable};
use static_assertions::{const_assert, const_assert_eq};

/// `HeapHandle::magic` of a formatted heap; anything else is refused by the entry points.
pub const HEAP_MAGIC: u32 = 0xCA4E_4EA9;
/// `HeapHandle::kind` of a fixed-size-block heap.
pub const KIND_SLAB: u32 = 1;
/// `HeapHandle::kind` of a bump arena.
pub const KIND_BUMP: u32 = 2;
/// `GeneralHeader::kind` of a general (size-classed) heap: `carve_malloc` / `carve_free`.
pub const KIND_GENERAL: u32 = 3;
/// `HeapHandle::flags`: double frees are counted in the statistics (every slab ignores them:
/// frees read the bitmap back either way).
pub const FLAG_CHECKED_FREES: u32 = 1;
/// `HeapHandle::flags`: a slab whose shard counts are cursors, not counts of blocks in use (the
/// classes of a general heap). Allocation takes each group's run where its shard's cursor stood
/// and moves it on; a free clears its bits and touches nothing else. The bitmap alone says
/// which blocks are in use: readers derive the blocks in use, and whether a shard has room,
/// from it.
pub const FLAG_CURSOR_SHARDS: u32 = 2;

/// Slots per statistics counter: failures are added to slot `warp % COUNTER_SLOTS`, so a storm
/// of failed allocations does not serialise on one address.
pub const COUNTER_SLOTS: usize = 32;
/// The statistics counters, in order, each `COUNTER_SLOTS` `u64`s.
pub const COUNTER_FAILED_ALLOCS: usize = 0;
/// Frees of a block that was already free (checked heaps only).
pub const COUNTER_DOUBLE_FREES: usize = 1;
/// Frees of a pointer that is not a block of this heap (outside it, or misaligned).
pub const COUNTER_FOREIGN_FREES: usize = 2;
/// Number of counters.
pub const COUNTERS: usize = 3;

/// Byte size of the counter array that follows the handle.
pub const COUNTERS_BYTES: usize = COUNTERS * COUNTER_SLOTS * 8;

/// Smallest slab block, and the alignment every block has at least.
pub const MIN_BLOCK: u64 = 16;
/// Largest alignment a slab gives its blocks (blocks of a power-of-two size up to this are
/// aligned to their size).
pub const MAX_BLOCK_ALIGN: u64 = 4096;

/// The alignment of every block of a slab of `block_size`-byte blocks: the block size when it is
/// a power of two (up to [`MAX_BLOCK_ALIGN`]), else [`MIN_BLOCK`]. The host aligns the data to it
/// (the `block_align` of [`slab_layout`]); Rust's allocator in kernels promises it
/// (`crate::global_alloc`).
pub const fn slab_block_align(block_size: u64) -> u64 {
    if block_size.is_power_of_two() {
        if block_size < MAX_BLOCK_ALIGN {
            block_size
        } else {
            MAX_BLOCK_ALIGN
        }
    } else {
        MIN_BLOCK
    }
}

/// Bump slots sit this many `u64`s apart, one 128-byte line each: the warps of every SM add to
/// their SM's slot, and slots packed 16 to a line made sixteen SMs' atomics meet in one line.
pub const BUMP_SLOT_STRIDE: usize = 16;

/// Bump chunk tag meaning "this slot has no chunk yet" (the zeroed state).
pub const CHUNK_NONE: u32 = 0;
/// Bump chunk tag meaning "the arena could not give this slot another chunk".
pub const CHUNK_EXHAUSTED: u32 = u32::MAX;

/// What a kernel needs to allocate from one heap segment, at offset 0 of its region.
///
/// All addresses are device (or, in host tests, host) addresses of arrays inside the region,
/// except `next`, the handle of the segment that [`grow`](../../carve/heap/index.html) appended
/// (0 for none): allocation moves on to it when this segment is exhausted.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct HeapHandle {
    /// [`HEAP_MAGIC`].
    pub magic: u32,
    /// [`KIND_SLAB`] or [`KIND_BUMP`].
    pub kind: u32,
    /// Slab: bytes per block (a multiple of 16). Bump: 0.
    pub block_size: u64,
    /// Slab: number of blocks. Bump: arena bytes.
    pub capacity: u64,
    /// Address of block 0 (slab) or of the arena (bump).
    pub data: u64,
    /// Address of the `COUNTERS × COUNTER_SLOTS` `u64` statistics counters.
    pub counters: u64,
    /// Slab: address of the `nshards` `u32` used-block counts. Bump: the global offset (`u64`).
    pub shard_used: u64,
    /// Slab: address of the `nshards` `u32` peak used-block counts. Bump: unused (0).
    pub shard_peak: u64,
    /// Slab: address of the `nwords` `u64` bitmap words (bit set = block in use). Bump: the
    /// `nslots` `u64` per-SM chunk cursors.
    pub words: u64,
    /// Slab: bitmap words. Bump: per-SM slots (0 turns chunking off).
    pub nwords: u32,
    /// Slab: shards (each counts the blocks in use among its `64 << shard_words_log2` bits).
    pub nshards: u32,
    /// Slab: log2 of the bitmap words per shard. Bump: log2 of the chunk size in bytes.
    pub shard_words_log2: u32,
    /// Slab: log2 of `block_size` when it is a power of two, else `u32::MAX`.
    pub block_shift: u32,
    /// `FLAG_*` bits.
    pub flags: u32,
    /// Keeps `next` 8-byte aligned.
    pub _pad: u32,
    /// Handle of the next segment, or 0.
    pub next: u64,
    /// Room for later fields without moving the arrays.
    pub reserved: [u64; 4],
}

/// The handle's size: the arrays start at this offset.
pub const HANDLE_BYTES: usize = 128;

const_assert_eq!(core::mem::size_of::<HeapHandle>(), HANDLE_BYTES);
const_assert_eq!(core::mem::align_of::<HeapHandle>(), 8);
const_assert_eq!(core::mem::offset_of!(HeapHandle, magic), 0);
const_assert_eq!(core::mem::offset_of!(HeapHandle, kind), 4);
const_assert_eq!(core::mem::offset_of!(HeapHandle, block_size), 8);
const_assert_eq!(core::mem::offset_of!(HeapHandle, capacity), 16);
const_assert_eq!(core::mem::offset_of!(HeapHandle, data), 24);
const_assert_eq!(core::mem::offset_of!(HeapHandle, counters), 32);
const_assert_eq!(core::mem::offset_of!(HeapHandle, shard_used), 40);
const_assert_eq!(core::mem::offset_of!(HeapHandle, shard_peak), 48);
const_assert_eq!(core::mem::offset_of!(HeapHandle, words), 56);
const_assert_eq!(core::mem::offset_of!(HeapHandle, nwords), 64);
const_assert_eq!(core::mem::offset_of!(HeapHandle, nshards), 68);
const_assert_eq!(core::mem::offset_of!(HeapHandle, shard_words_log2), 72);
const_assert_eq!(core::mem::offset_of!(HeapHandle, block_shift), 76);
const_assert_eq!(core::mem::offset_of!(HeapHandle, flags), 80);
const_assert_eq!(core::mem::offset_of!(HeapHandle, next), 88);
const_assert!(COUNTERS_BYTES.is_multiple_of(8));

/// Where each array of a heap lives, as byte offsets from the region's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegionLayout {
    /// Offset of the counters (right after the handle).
    pub counters: usize,
    /// Slab: shard used counts. Bump: the global offset.
    pub shard_used: usize,
    /// Slab: shard peaks.
    pub shard_peak: usize,
    /// Slab: bitmap. Bump: chunk slots.
    pub words: usize,
    /// End of the statistics prefix (what `stats` copies back).
    pub stats_end: usize,
    /// End of everything that must be zeroed to format.
    pub meta_end: usize,
    /// Offset of the data (blocks or arena).
    pub data: usize,
    /// Total region bytes.
    pub total: usize,
}

impl RegionLayout {
    /// How much of the region the statistics read for a segment with `flags`: through the
    /// bitmap when the shard counts are cursors ([`FLAG_CURSOR_SHARDS`]), whose blocks in use
    /// are counted in the bitmap; the counters and counts alone otherwise.
    pub fn stats_len(&self, flags: u32) -> usize {
        if flags & FLAG_CURSOR_SHARDS != 0 {
            self.meta_end
        } else {
            self.stats_end
        }
    }
}

impl HeapHandle {
    /// A slab handle for `capacity` blocks of `block_size` bytes laid out as `g`, with every
    /// array address 0: the caller places the arrays (the host relocates them into a device
    /// region; CPU tests point them at host arrays).
    pub fn slab(g: SlabGeometry, capacity: u64, block_size: u64, flags: u32) -> HeapHandle {
        HeapHandle {
            magic: HEAP_MAGIC,
            kind: KIND_SLAB,
            block_size,
            capacity,
            nwords: g.nwords,
            nshards: g.nshards,
            shard_words_log2: g.shard_words_log2,
            block_shift: if block_size.is_power_of_two() {
                block_size.trailing_zeros()
            } else {
                u32::MAX
            },
            flags,
            ..bytemuck::Zeroable::zeroed()
        }
    }
}

/// Slab geometry: the host's choice of shard size for `capacity` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlabGeometry {
    /// Words in the bitmap.
    pub nwords: u32,
    /// Shards the bitmap is split into (a power of two).
    pub nshards: u32,
    /// log2 of the words per shard.
    pub shard_words_log2: u32,
}

/// Shards of at most 4 words (256 blocks) and at most 4096 shards for big heaps: enough
/// counters that warps rarely meet on one, few enough that `stats` copies little. Larger shards
/// measured slower on the H100 (mixed sizes at 2^22): 14.3 / 29.6 G/s with 64 words, 16.2 /
/// 31.3 with 16, 18.3 / 35.1 with 8, 18.2 / 36.1 with 4.
pub fn slab_geometry(capacity: u64) -> Option<SlabGeometry> {
    let nwords = capacity.div_ceil(64);
    if nwords == 0 || nwords > u32::MAX as u64 {
        return None;
    }
    let mut log2 = 0u32;
    while log2 < 2 && (nwords >> (log2 + 1)) >= 16 {
        log2 += 1;
    }
    while nwords.div_ceil(1 << log2) > 4096 {
        log2 += 1;
    }
    Some(SlabGeometry {
        nwords: nwords as u32,
        nshards: nwords.div_ceil(1 << log2) as u32,
        shard_words_log2: log2,
    })
}

const fn up(v: usize, a: usize) -> usize {
    (v + a - 1) & !(a - 1)
}

/// Region layout of a slab of `geometry`, with `capacity` blocks of `block_size` bytes aligned
/// to `block_align`. `None` when it overflows.
pub fn slab_layout(
    g: SlabGeometry,
    capacity: u64,
    block_size: u64,
    block_align: u64,
) -> Option<RegionLayout> {
    let counters = HANDLE_BYTES;
    let shard_used = counters + COUNTERS_BYTES;
    let shard_peak = shard_used.checked_add(4 * g.nshards as usize)?;
    let stats_end = shard_peak.checked_add(4 * g.nshards as usize)?;
    let words = up(stats_end, 128);
    let meta_end = words.checked_add(8 * g.nwords as usize)?;
    let data = up(meta_end, block_align.max(256) as usize);
    let bytes = usize::try_from(capacity.checked_mul(block_size)?).ok()?;
    let total = data.checked_add(bytes)?;
    (total <= isize::MAX as usize).then_some(RegionLayout {
        counters,
        shard_used,
        shard_peak,
        words,
        stats_end,
        meta_end,
        data,
        total,
    })
}

/// Region layout of a bump arena of `capacity` bytes with `nslots` chunk cursors.
pub fn bump_layout(capacity: u64, nslots: u32) -> Option<RegionLayout> {
    let counters = HANDLE_BYTES;
    let shard_used = counters + COUNTERS_BYTES;
    let stats_end = shard_used + 8;
    let words = up(stats_end, 128);
    let meta_end = words + 8 * BUMP_SLOT_STRIDE * nslots as usize;
    let data = up(meta_end, 256);
    let total = data.checked_add(usize::try_from(capacity).ok()?)?;
    (total <= isize::MAX as usize).then_some(RegionLayout {
        counters,
        shard_used,
        shard_peak: shard_used,
        words,
        stats_end,
        meta_end,
        data,
        total,
    })
}

/// Bump chunk size for an arena: at most 16 MiB (so that an SM refills its chunk once per
/// hundreds of warps even at 1 KiB per request, and a warp of 4 KiB requests still takes the
/// per-SM path), and small enough that every slot can hold a chunk while 3/4 of the arena stays
/// for the rest. `None`: too small to chunk.
pub fn bump_chunk_log2(capacity: u64, nslots: u32) -> Option<u32> {
    let per_slot = capacity / (4 * nslots.max(1) as u64);
    if per_slot < 4096 {
        return None;
    }
    Some((63 - per_slot.leading_zeros()).min(24))
}

/// Class slots in a [`GeneralHeader`]: [`NUM_CLASSES`](crate::size_class::NUM_CLASSES) used, the
/// rest 0 (room for more classes without moving the header's fields).
pub const GENERAL_CLASS_SLOTS: usize = 56;
/// The general header's size: its counters follow at this offset.
pub const GENERAL_HEADER_BYTES: usize = 512;
/// Offset of class 0's slab segment from the general region's start: the header and its counters
/// fit below, and class segments start 4096-byte aligned when the region is.
pub const GENERAL_CLASSES_OFFSET: usize = 4096;
/// Smallest class stride (log2): one block of the largest class (64 KiB, aligned to 4 KiB) and its
/// slab metadata fit in 128 KiB.
pub const GENERAL_MIN_STRIDE_LOG2: u32 = 17;
/// Largest class stride (log2): 1 TiB per class.
pub const GENERAL_MAX_STRIDE_LOG2: u32 = 40;

/// The header of a general heap (`carve_malloc` / `carve_free`), at offset 0 of its region.
///
/// A general heap is one region: `[header | counters | pad to 4096 | class 0 | class 1 | ...]`.
/// Class `c`'s slab segment is an ordinary slab region (a [`HeapHandle`] of kind [`KIND_SLAB`]
/// and its arrays, then its blocks of `class_size(c)` bytes) of exactly `1 << stride_log2` bytes
/// at `base + (c << stride_log2)`. So the class of a pointer is `(ptr - base) >> stride_log2`:
/// `carve_free` needs no size and no search, one subtract and one shift; a pointer below `base`
/// or past the last class is no block of the heap. Every class gets the same bytes (small classes
/// many blocks, large ones few).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct GeneralHeader {
    /// [`HEAP_MAGIC`].
    pub magic: u32,
    /// [`KIND_GENERAL`].
    pub kind: u32,
    /// Classes in use (the plan's `nclasses`: every small class, and the large ones whose block
    /// fits a class's bytes); requests of a class at or past it fail.
    pub nclasses: u32,
    /// log2 of the bytes between consecutive class segments.
    pub stride_log2: u32,
    /// Address of class 0's segment (its [`HeapHandle`]).
    pub base: u64,
    /// Address of the `COUNTERS × COUNTER_SLOTS` `u64` counters of requests no class serves
    /// (failed allocations: 0 bytes, more than the largest class in use) and of frees outside
    /// every class.
    pub counters: u64,
    /// Per class, the address of its slab segment's handle (`base + (c << stride_log2)`); 0 past
    /// `nclasses`.
    pub classes: [u64; GENERAL_CLASS_SLOTS],
    /// Room for later fields.
    pub reserved: [u64; 4],
}

const_assert_eq!(core::mem::size_of::<GeneralHeader>(), GENERAL_HEADER_BYTES);
const_assert_eq!(core::mem::align_of::<GeneralHeader>(), 8);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, magic), 0);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, kind), 4);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, nclasses), 8);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, stride_log2), 12);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, base), 16);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, counters), 24);
const_assert_eq!(core::mem::offset_of!(GeneralHeader, classes), 32);
const_assert!(GENERAL_HEADER_BYTES + COUNTERS_BYTES <= GENERAL_CLASSES_OFFSET);
// `carve_malloc` reads the header's class pointer before it knows the region is a general heap:
// every region carve formats (a slab or bump handle and its counters first) must hold it.
const_assert!(HANDLE_BYTES + COUNTERS_BYTES >= GENERAL_HEADER_BYTES);
const_assert!(crate::size_class::NUM_CLASSES <= GENERAL_CLASS_SLOTS);

/// One class of a [`GeneralPlan`]: a slab segment of `capacity` blocks of `block_size` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeneralClass {
    /// Bytes per block (`class_size(c)`).
    pub block_size: u64,
    /// Blocks: as many as fit in the stride with their metadata.
    pub capacity: u64,
    /// The slab's geometry.
    pub geometry: SlabGeometry,
    /// The slab's layout, offsets from the class segment's start.
    pub layout: RegionLayout,
}

/// Where everything of a general heap lives, relative to its region's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GeneralPlan {
    /// log2 of the class stride.
    pub stride_log2: u32,
    /// Total region bytes.
    pub total: usize,
    /// Classes in use: every small class, then the large classes whose one block and its
    /// metadata fit the stride.
    pub nclasses: usize,
    /// Every class's plan, by class index; only the first `nclasses` are used ([`Self::classes`]).
    pub table: [GeneralClass; crate::size_class::NUM_CLASSES],
}

impl GeneralPlan {
    /// The classes in use, by class index.
    pub fn classes(&self) -> &[GeneralClass] {
        &self.table[..self.nclasses]
    }
}

/// The plan of a general heap with at least `bytes_per_class` bytes per class (rounded up to a
/// power of two, at least `1 << GENERAL_MIN_STRIDE_LOG2`); `None` for 0 or past
/// `1 << GENERAL_MAX_STRIDE_LOG2`.
pub fn general_plan(bytes_per_class: u64) -> Option<GeneralPlan> {
    if bytes_per_class == 0 || bytes_per_class > 1 << GENERAL_MAX_STRIDE_LOG2 {
        return None;
    }
    let stride_log2 = bytes_per_class
        .next_power_of_two()
        .trailing_zeros()
        .max(GENERAL_MIN_STRIDE_LOG2);
    let stride = 1u64 << stride_log2;
    let mut classes = [GeneralClass {
        block_size: 0,
        capacity: 0,
        geometry: SlabGeometry {
            nwords: 0,
            nshards: 0,
            shard_words_log2: 0,
        },
        layout: RegionLayout {
            counters: 0,
            shard_used: 0,
            shard_peak: 0,
            words: 0,
            stats_end: 0,
            meta_end: 0,
            data: 0,
            total: 0,
        },
    }; crate::size_class::NUM_CLASSES];
    let mut nclasses = 0;
    for (c, class) in classes.iter_mut().enumerate() {
        let size = crate::size_class::class_size(c as u32) as u64;
        let fits = |k: u64| {
            let g = slab_geometry(k)?;
            let l = slab_layout(g, k, size, slab_block_align(size))?;
            (l.total as u64 <= stride).then_some((g, l))
        };
        if fits(1).is_none() {
            // Every small class fits the smallest stride; a large class that does not, and
            // every larger one, stays out of use.
            if c < crate::size_class::NUM_SMALL_CLASSES {
                return None;
            }
            break;
        }
        nclasses = c + 1;
        // The most blocks that fit: binary search (the metadata grows with the count).
        let (mut lo, mut hi) = (1u64, stride / size);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid).is_some() {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        let (geometry, layout) = fits(lo)?;
        *class = GeneralClass {
            block_size: size,
            capacity: lo,
            geometry,
            layout,
        };
    }
    let total =
        (GENERAL_CLASSES_OFFSET as u64).checked_add(stride.checked_mul(nclasses as u64)?)?;
    if total > isize::MAX as u64 || usize::try_from(total).is_err() {
        return None;
    }
    Some(GeneralPlan {
        stride_log2,
        total: total as usize,
        nclasses,
        table: classes,
    })
}

impl GeneralPlan {
    /// Offset of class `c`'s segment from the region's start.
    pub fn class_offset(&self, c: usize) -> usize {
        GENERAL_CLASSES_OFFSET + (c << self.stride_log2)
    }

    /// The header of this plan's heap placed at `base` (the region's start).
    pub fn header(&self, base: u64) -> GeneralHeader {
        let mut classes = [0u64; GENERAL_CLASS_SLOTS];
        for (c, a) in classes.iter_mut().take(self.nclasses).enumerate() {
            *a = base + self.class_offset(c) as u64;
        }
        GeneralHeader {
            magic: HEAP_MAGIC,
            kind: KIND_GENERAL,
            nclasses: self.nclasses as u32,
            stride_log2: self.stride_log2,
            base: base + GENERAL_CLASSES_OFFSET as u64,
            counters: base + GENERAL_HEADER_BYTES as u64,
            classes,
            reserved: [0; 4],
        }
    }

    /// Class `c`'s slab handle, its arrays relocated into the region at `base`; its flags are
    /// `flags` and [`FLAG_CURSOR_SHARDS`].
    pub fn class_handle(&self, c: usize, base: u64, flags: u32) -> HeapHandle {
        let k = &self.classes()[c];
        let seg = base + self.class_offset(c) as u64;
        let l = &k.layout;
        HeapHandle {
            data: seg + l.data as u64,
            counters: seg + l.counters as u64,
            shard_used: seg + l.shard_used as u64,
            shard_peak: seg + l.shard_peak as u64,
            words: seg + l.words as u64,
            ..HeapHandle::slab(
                k.geometry,
                k.capacity,
                k.block_size,
                flags | FLAG_CURSOR_SHARDS,
            )
        }
    }

    /// The header's layout as a [`RegionLayout`]: its counters, and the end of its statistics.
    pub fn header_layout(&self) -> RegionLayout {
        let end = GENERAL_HEADER_BYTES + COUNTERS_BYTES;
        RegionLayout {
            counters: GENERAL_HEADER_BYTES,
            shard_used: end,
            shard_peak: end,
            words: end,
            stats_end: end,
            meta_end: end,
            data: GENERAL_CLASSES_OFFSET,
            total: self.total,
        }
    }
}

#[cfg(test)]
mod tests;
