//! Heaps in memory that carve does not own: a Python (Numba, CuPy, PyTorch) device array, or any
//! other allocator's block. A heap region reads as fresh when it is zero except for its handle,
//! so formatting one is "zero `bytes()` bytes at an `align()`-aligned base, then write
//! `handle_at(base)` over its first 128 bytes": exactly what [`DeviceHeap`](super::DeviceHeap)
//! does in memory it reserved itself.

use carve_kernels::heap_layout::{self as layout, HeapHandle, RegionLayout, HANDLE_BYTES};

use super::region::{bump_plan, region_align, relocate, slab_plan, HeapKind};
use super::stats::HeapStats;
use crate::error::{Error, Result};

/// How to format a heap of one kind and capacity in someone else's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForeignHeapPlan {
    kind: HeapKind,
    handle: HeapHandle,
    layout: RegionLayout,
}

impl ForeignHeapPlan {
    /// A slab of `capacity` blocks of `block_size` bytes, with checked frees (as
    /// [`DeviceHeap::slab`](super::DeviceHeap::slab)).
    pub fn slab(capacity: u64, block_size: u64) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let (handle, layout) = slab_plan(capacity, block_size, layout::FLAG_CHECKED_FREES)?;
        Ok(ForeignHeapPlan {
            kind: HeapKind::Slab { block_size },
            handle,
            layout,
        })
    }

    /// A bump arena of `capacity` bytes (as [`DeviceHeap::bump`](super::DeviceHeap::bump)).
    pub fn bump(capacity: u64) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let (handle, layout) = bump_plan(capacity)?;
        Ok(ForeignHeapPlan {
            kind: HeapKind::Bump,
            handle,
            layout,
        })
    }

    /// The heap's kind.
    pub fn kind(&self) -> HeapKind {
        self.kind
    }

    /// Bytes the region needs.
    pub fn bytes(&self) -> usize {
        self.layout.total
    }

    /// The alignment the region's base needs (the blocks' alignment, at least 256).
    pub fn align(&self) -> u64 {
        region_align(self.kind) as u64
    }

    /// Bytes at the region's start that hold the statistics ([`ForeignHeapPlan::stats`]).
    pub fn stats_bytes(&self) -> usize {
        self.layout.stats_len(self.handle.flags)
    }

    /// The handle to write at `base`, the start of a zeroed region of [`bytes`](Self::bytes)
    /// bytes. Kernels then take `base` as the heap's address.
    pub fn handle_at(&self, base: u64) -> Result<HeapHandle> {
        if base == 0 || base % self.align() != 0 {
            return Err(Error::InvalidArgument(format!(
                "heap base {base:#x} is not a non-null multiple of {}",
                self.align()
            )));
        }
        if base.checked_add(self.layout.total as u64).is_none() {
            return Err(Error::SizeOverflow {
                bytes: self.layout.total,
                align: self.align() as usize,
            });
        }
        let mut h = self.handle;
        relocate(&mut h, &self.layout, base);
        Ok(h)
    }

    /// [`handle_at`](Self::handle_at) as the 128 bytes to copy.
    pub fn handle_bytes_at(&self, base: u64) -> Result<[u8; HANDLE_BYTES]> {
        let h = self.handle_at(base)?;
        let mut out = [0u8; HANDLE_BYTES];
        out.copy_from_slice(bytemuck::bytes_of(&h));
        Ok(out)
    }

    /// Decodes the statistics from the region's first [`stats_bytes`](Self::stats_bytes) bytes.
    pub fn stats(&self, prefix: &[u8]) -> Result<HeapStats> {
        if prefix.len() < self.stats_bytes() {
            return Err(Error::InvalidArgument(format!(
                "{} bytes of heap prefix given, {} needed",
                prefix.len(),
                self.stats_bytes()
            )));
        }
        Ok(HeapStats::parse(
            self.kind,
            &self.handle,
            &self.layout,
            prefix,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handle_points_inside_the_region() {
        let p = ForeignHeapPlan::slab(1 << 20, 64).unwrap();
        let base = 0x7f00_0000_0000u64;
        let h = p.handle_at(base).unwrap();
        assert_eq!((h.magic, h.kind), (layout::HEAP_MAGIC, layout::KIND_SLAB));
        assert_eq!((h.capacity, h.block_size, h.next), (1 << 20, 64, 0));
        assert_eq!(h.flags, layout::FLAG_CHECKED_FREES);
        let end = base + p.bytes() as u64;
        for a in [h.counters, h.shard_used, h.shard_peak, h.words, h.data] {
            assert!(a > base && a < end, "{a:#x}");
        }
        assert_eq!(h.data + (1 << 20) * 64, end);
        assert_eq!(h.data % 64, 0);
        let bytes = p.handle_bytes_at(base).unwrap();
        assert_eq!(bytemuck::pod_read_unaligned::<HeapHandle>(&bytes), h);
    }

    #[test]
    fn bad_bases_and_sizes_are_typed_errors() {
        let p = ForeignHeapPlan::slab(100, 1024).unwrap();
        assert_eq!(p.align(), 1024);
        assert!(matches!(p.handle_at(0), Err(Error::InvalidArgument(_))));
        assert!(matches!(p.handle_at(256), Err(Error::InvalidArgument(_))));
        assert!(p.handle_at(4096).is_ok());
        assert!(matches!(
            p.handle_at(u64::MAX - 1023),
            Err(Error::SizeOverflow { .. })
        ));
        assert!(matches!(ForeignHeapPlan::slab(0, 64), Err(Error::ZeroSize)));
        assert!(matches!(ForeignHeapPlan::bump(0), Err(Error::ZeroSize)));
        assert!(matches!(
            ForeignHeapPlan::slab(10, 20),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(p.stats(&[0u8; 8]), Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn a_zeroed_prefix_reads_as_an_empty_heap() {
        let p = ForeignHeapPlan::bump(1 << 30).unwrap();
        assert_eq!(p.align(), 256);
        let h = p.handle_at(1 << 40).unwrap();
        assert_eq!((h.kind, h.capacity), (layout::KIND_BUMP, 1 << 30));
        let s = p.stats(&vec![0u8; p.stats_bytes()]).unwrap();
        assert_eq!(
            (s.capacity, s.in_use, s.failed_allocs, s.kind),
            (1 << 30, 0, 0, HeapKind::Bump)
        );
    }
}
