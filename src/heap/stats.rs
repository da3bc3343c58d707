//! Statistics of a device heap, decoded from the metadata prefix that one copy brings back.

use carve_kernels::heap_layout::{
    HeapHandle, RegionLayout, COUNTER_DOUBLE_FREES, COUNTER_FAILED_ALLOCS, COUNTER_FOREIGN_FREES,
    COUNTER_SLOTS, FLAG_CURSOR_SHARDS,
};

use super::region::HeapKind;

/// What a heap has handed out. Units are blocks for a slab and a general heap (summed over its
/// classes; [`DeviceHeap::class_stats`](super::DeviceHeap::class_stats) gives them class by
/// class) and bytes for a bump arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeapStats {
    /// Slab or bump.
    pub kind: HeapKind,
    /// Blocks (slab) or bytes (bump) over all segments.
    pub capacity: u64,
    /// Blocks in use (slab), or bytes reserved since the last reset, including alignment and
    /// chunk padding (bump).
    pub in_use: u64,
    /// Slab: the sum over shards of each shard's peak, an upper bound on the peak number of
    /// blocks in use that equals it when the peak came before the first free. The classes of a
    /// general heap keep no peak (their frees touch nothing but the bitmap): `in_use`. Bump:
    /// equal to `in_use` (nothing is freed).
    pub high_water: u64,
    /// Requests that returned null (refused sizes and alignments included; for a general heap,
    /// requests of 0 bytes or past its largest class too).
    pub failed_allocs: u64,
    /// Frees of a block that was already free (checked slabs). A stale free of a block that was
    /// handed out again frees the new owner's block instead; only the new owner's own free is
    /// then counted here.
    pub double_frees: u64,
    /// Frees of a pointer that is no block of this heap.
    pub foreign_frees: u64,
}

impl HeapStats {
    pub(super) fn empty(kind: HeapKind) -> Self {
        HeapStats {
            kind,
            capacity: 0,
            in_use: 0,
            high_water: 0,
            failed_allocs: 0,
            double_frees: 0,
            foreign_frees: 0,
        }
    }

    pub(super) fn add(&mut self, o: &HeapStats) {
        self.capacity += o.capacity;
        self.in_use += o.in_use;
        self.high_water += o.high_water;
        self.failed_allocs += o.failed_allocs;
        self.double_frees += o.double_frees;
        self.foreign_frees += o.foreign_frees;
    }

    /// Decodes one segment's prefix (`[0, layout.stats_len(h.flags))` of its region: through
    /// the bitmap for a general heap's class, whose blocks in use are its bits set). Sums
    /// saturate: a prefix that is not a heap's (a wrong copy, garbage) gives large numbers,
    /// never a panic; so does one too short to hold the bitmap.
    pub(super) fn parse(kind: HeapKind, h: &HeapHandle, l: &RegionLayout, prefix: &[u8]) -> Self {
        let u64_at = |off: usize| u64::from_le_bytes(prefix[off..off + 8].try_into().unwrap());
        let u32_at = |off: usize| u32::from_le_bytes(prefix[off..off + 4].try_into().unwrap());
        let sum = |values: &mut dyn Iterator<Item = u64>| values.fold(0u64, u64::saturating_add);
        let counter = |which: usize| -> u64 {
            sum(&mut (0..COUNTER_SLOTS)
                .map(|s| u64_at(l.counters + 8 * (which * COUNTER_SLOTS + s))))
        };
        let (in_use, high_water) = match kind {
            HeapKind::Slab { .. } if h.flags & FLAG_CURSOR_SHARDS != 0 => {
                let bits = l.words..l.words.saturating_add(8 * h.nwords as usize);
                let used = prefix.get(bits).map_or(u64::MAX, |words| {
                    words
                        .chunks_exact(8)
                        .map(|w| u64::from_le_bytes(w.try_into().unwrap()).count_ones() as u64)
                        .sum()
                });
                (used, used)
            }
            HeapKind::Slab { .. } => {
                let n = h.nshards as usize;
                let used = sum(&mut (0..n).map(|i| u32_at(l.shard_used + 4 * i) as u64));
                let peak = sum(&mut (0..n).map(|i| u32_at(l.shard_peak + 4 * i) as u64));
                (used, peak)
            }
            HeapKind::Bump => {
                let off = u64_at(l.shard_used).min(h.capacity);
                (off, off)
            }
            // The header holds counters only; the blocks are the classes' (see
            // `DeviceHeap::class_stats`).
            HeapKind::General { .. } => (0, 0),
        };
        HeapStats {
            kind,
            capacity: h.capacity,
            in_use,
            high_water,
            failed_allocs: counter(COUNTER_FAILED_ALLOCS),
            double_frees: counter(COUNTER_DOUBLE_FREES),
            foreign_frees: counter(COUNTER_FOREIGN_FREES),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve_kernels::heap_layout::{slab_geometry, slab_layout};

    #[test]
    fn parses_counters_and_shards() {
        let g = slab_geometry(300).unwrap();
        let l = slab_layout(g, 300, 16, 16).unwrap();
        let h = HeapHandle {
            capacity: 300,
            nshards: g.nshards,
            ..bytemuck::Zeroable::zeroed()
        };
        let mut p = vec![0u8; l.stats_end];
        let mut put64 = |off: usize, v: u64| p[off..off + 8].copy_from_slice(&v.to_le_bytes());
        put64(l.counters + 8 * 3, 5); // failed, slot 3
        put64(l.counters + 8 * (COUNTER_SLOTS + 1), 2); // double frees
        put64(l.counters + 8 * (2 * COUNTER_SLOTS + 31), 7); // foreign
        for i in 0..g.nshards as usize {
            p[l.shard_used + 4 * i..l.shard_used + 4 * i + 4].copy_from_slice(&10u32.to_le_bytes());
            p[l.shard_peak + 4 * i..l.shard_peak + 4 * i + 4].copy_from_slice(&12u32.to_le_bytes());
        }
        let s = HeapStats::parse(HeapKind::Slab { block_size: 16 }, &h, &l, &p);
        assert_eq!(s.in_use, 10 * g.nshards as u64);
        assert_eq!(s.high_water, 12 * g.nshards as u64);
        assert_eq!(
            (s.failed_allocs, s.double_frees, s.foreign_frees),
            (5, 2, 7)
        );
    }

    /// A general heap's class counts its blocks in use in its bitmap, whatever its cursors
    /// hold; a prefix that stops short of the bitmap reads as full, never as empty.
    #[test]
    fn cursor_shards_count_bits_set() {
        let g = slab_geometry(300).unwrap();
        let l = slab_layout(g, 300, 16, 16).unwrap();
        let h = HeapHandle {
            capacity: 300,
            nshards: g.nshards,
            nwords: g.nwords,
            flags: FLAG_CURSOR_SHARDS,
            ..bytemuck::Zeroable::zeroed()
        };
        assert_eq!(l.stats_len(h.flags), l.meta_end);
        let mut p = vec![0u8; l.stats_len(h.flags)];
        for i in 0..g.nshards as usize {
            p[l.shard_used + 4 * i..l.shard_used + 4 * i + 4]
                .copy_from_slice(&999u32.to_le_bytes());
        }
        p[l.words..l.words + 8].copy_from_slice(&0b1011u64.to_le_bytes());
        p[l.words + 16..l.words + 24].copy_from_slice(&u64::MAX.to_le_bytes());
        let s = HeapStats::parse(HeapKind::Slab { block_size: 16 }, &h, &l, &p);
        assert_eq!((s.in_use, s.high_water), (67, 67));
        let s = HeapStats::parse(HeapKind::Slab { block_size: 16 }, &h, &l, &p[..l.stats_end]);
        assert_eq!(s.in_use, u64::MAX);
    }

    /// Found by tests/fuzz.rs: counters of a garbage prefix overflowed their sum (a panic in
    /// debug builds, a wrong small number in release).
    #[test]
    fn garbage_prefixes_saturate_instead_of_overflowing() {
        let g = slab_geometry(300).unwrap();
        let l = slab_layout(g, 300, 16, 16).unwrap();
        let h = HeapHandle {
            capacity: 300,
            nshards: g.nshards,
            ..bytemuck::Zeroable::zeroed()
        };
        let p = vec![0xffu8; l.stats_end];
        let s = HeapStats::parse(HeapKind::Slab { block_size: 16 }, &h, &l, &p);
        assert_eq!(
            (s.failed_allocs, s.double_frees, s.foreign_frees),
            (u64::MAX, u64::MAX, u64::MAX)
        );
        assert_eq!(s.in_use, u32::MAX as u64 * g.nshards as u64);
    }
}
