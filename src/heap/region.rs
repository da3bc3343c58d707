//! A heap region's plan: its kind, the handle and layout of a slab, bump or general segment
//! (addresses relative to 0 until [`relocate`] places them), and a segment once placed.

use std::ptr::NonNull;

use carve_kernels::heap_layout::{self as layout, GeneralPlan, HeapHandle, RegionLayout};

use crate::error::{Error, Result};
use crate::resource::DEFAULT_ALIGNMENT;

/// Which allocator a heap runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeapKind {
    /// Fixed-size blocks, allocated and freed by kernels.
    Slab {
        /// The size of every block in bytes.
        block_size: u64,
    },
    /// Byte ranges, allocated by kernels and released all at once by
    /// [`DeviceHeap::reset`](crate::DeviceHeap::reset).
    Bump,
    /// Any size from 1 byte to 16 MiB (`carve_malloc` / `carve_free`): one slab per size class
    /// (`carve_kernels::size_class`), each of `bytes_per_class` bytes.
    General {
        /// Bytes of each class's slab segment (a power of two), metadata included.
        bytes_per_class: u64,
    },
}

/// Chunk slots of a bump arena: one per SM on any current GPU (the SM id picks the slot).
pub(super) const BUMP_SLOTS: u32 = 256;

#[derive(Debug)]
pub(super) struct Segment {
    /// The heap's base: aligned for its blocks (see [`region_align`]).
    pub(super) ptr: NonNull<u8>,
    /// What the resource returned, and its length, for the free: the base may sit above it.
    pub(super) raw: NonNull<u8>,
    pub(super) raw_len: usize,
    pub(super) layout: RegionLayout,
    pub(super) handle: HeapHandle,
}

pub(super) fn check_block_size(block_size: u64) -> Result<()> {
    if block_size < layout::MIN_BLOCK || block_size % layout::MIN_BLOCK != 0 {
        return Err(Error::InvalidArgument(format!(
            "slab block size {block_size} is not a positive multiple of {}",
            layout::MIN_BLOCK
        )));
    }
    Ok(())
}

/// The alignment a heap's base needs: its blocks' alignment, and at least [`DEFAULT_ALIGNMENT`].
pub(super) fn region_align(kind: HeapKind) -> usize {
    match kind {
        HeapKind::Slab { block_size } => (block_align(block_size) as usize).max(DEFAULT_ALIGNMENT),
        HeapKind::Bump => DEFAULT_ALIGNMENT,
        // Class segments start at multiples of 4096 from the base: blocks keep their alignment.
        HeapKind::General { .. } => (layout::MAX_BLOCK_ALIGN as usize).max(DEFAULT_ALIGNMENT),
    }
}

/// The resource block a region of `total` bytes takes: room to align its start.
pub(super) fn raw_len_of(total: usize, kind: HeapKind) -> Result<usize> {
    let align = region_align(kind);
    total
        .checked_add(align - DEFAULT_ALIGNMENT)
        .ok_or(Error::SizeOverflow {
            bytes: total,
            align,
        })
}

/// A general heap's plan, or a clear error for 0 or too many bytes per class.
pub(super) fn general_plan(bytes_per_class: u64) -> Result<GeneralPlan> {
    if bytes_per_class == 0 {
        return Err(Error::ZeroSize);
    }
    layout::general_plan(bytes_per_class).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "a general heap of {bytes_per_class} bytes per class: at most {} bytes per class \
             (rounded up to a power of two), and the region must fit the address space",
            1u64 << layout::GENERAL_MAX_STRIDE_LOG2
        ))
    })
}

/// Block alignment: the block size when it is a power of two (up to 4 KiB), else 16.
pub(super) fn block_align(block_size: u64) -> u64 {
    // Shared with the kernels, which promise this alignment to Rust's allocator API.
    layout::slab_block_align(block_size)
}

/// The handle (addresses relative to 0) and layout of a slab segment.
pub(super) fn slab_plan(
    capacity: u64,
    block_size: u64,
    flags: u32,
) -> Result<(HeapHandle, RegionLayout)> {
    check_block_size(block_size)?;
    let too_big = || Error::SizeOverflow {
        bytes: usize::MAX,
        align: block_align(block_size) as usize,
    };
    let g = layout::slab_geometry(capacity).ok_or_else(too_big)?;
    let region = layout::slab_layout(g, capacity, block_size, block_align(block_size))
        .ok_or_else(too_big)?;
    let handle = HeapHandle::slab(g, capacity, block_size, flags);
    Ok((handle, region))
}

/// The handle and layout of a bump segment; chunking only where the arena is roomy and small
/// enough for 32-bit chunk tags.
pub(super) fn bump_plan(capacity: u64) -> Result<(HeapHandle, RegionLayout)> {
    let chunk = layout::bump_chunk_log2(capacity, BUMP_SLOTS)
        .filter(|_| capacity / carve_kernels::bump::GRANULE < u32::MAX as u64 - 1);
    let nslots = if chunk.is_some() { BUMP_SLOTS } else { 0 };
    let region = layout::bump_layout(capacity, nslots).ok_or(Error::SizeOverflow {
        bytes: usize::MAX,
        align: DEFAULT_ALIGNMENT,
    })?;
    let handle = HeapHandle {
        magic: layout::HEAP_MAGIC,
        kind: layout::KIND_BUMP,
        capacity,
        nwords: nslots,
        shard_words_log2: chunk.unwrap_or(0),
        ..bytemuck::Zeroable::zeroed()
    };
    Ok((handle, region))
}

/// Points the handle's arrays into the region at `base`.
pub(super) fn relocate(h: &mut HeapHandle, l: &RegionLayout, base: u64) {
    h.data = base + l.data as u64;
    h.counters = base + l.counters as u64;
    h.shard_used = base + l.shard_used as u64;
    h.shard_peak = if h.kind == layout::KIND_SLAB {
        base + l.shard_peak as u64
    } else {
        0
    };
    h.words = base + l.words as u64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plans_pin_the_arrays_inside_the_region() {
        let (mut h, l) = slab_plan(1000, 48, layout::FLAG_CHECKED_FREES).unwrap();
        relocate(&mut h, &l, 0x10_0000);
        assert_eq!(h.data, 0x10_0000 + l.data as u64);
        assert_eq!(h.block_shift, u32::MAX);
        assert!(l.total as u64 >= 1000 * 48);
        let (h, l) = bump_plan(1 << 30).unwrap();
        assert_eq!(h.nwords, BUMP_SLOTS);
        assert_eq!(h.shard_words_log2, 20);
        assert!(l.meta_end >= l.words + 8 * BUMP_SLOTS as usize);
        let (h, _) = bump_plan(4096).unwrap();
        assert_eq!(h.nwords, 0, "too small to chunk");
    }

    #[test]
    fn bad_requests_are_typed_errors() {
        assert!(matches!(
            slab_plan(10, 8, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            slab_plan(10, 24, 0),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            slab_plan(u64::MAX / 8, 4096, 0),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(
            bump_plan(u64::MAX - 10),
            Err(Error::SizeOverflow { .. })
        ));
        assert_eq!(block_align(64), 64);
        assert_eq!(block_align(1 << 20), 4096);
        assert_eq!(block_align(48), 16);
        assert!(matches!(general_plan(0), Err(Error::ZeroSize)));
        assert!(matches!(
            general_plan(u64::MAX),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            general_plan((1 << 40) + 1),
            Err(Error::InvalidArgument(_))
        ));
        let p = general_plan(1 << 20).unwrap();
        assert_eq!(p.stride_log2, 20);
        assert_eq!(
            region_align(HeapKind::General {
                bytes_per_class: 1 << 20
            }),
            4096
        );
    }
}
