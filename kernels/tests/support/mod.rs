//! Heaps in host memory for the host-build tests: the same handle and arrays the GPU uses, made
//! of `carve_kernels::sync` atomics (loom's under `--cfg carve_loom`).
#![allow(dead_code)]

use carve_kernels::heap_layout::*;
use carve_kernels::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The next value of a xorshift64 generator with state `s` (not 0): the tests' random choices.
pub fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// The [`Warp`](carve_kernels::warp::Warp) methods a test's wrapper warp takes as they are from
/// its field `$f` (a lock-step lane, or another warp): the lane, the collectives and the slot.
/// The wrapper writes `active` and the atomics it changes itself.
#[allow(unused_macros)]
macro_rules! forward_collectives {
    ($f:ident) => {
        fn lane(&self) -> u32 {
            self.$f.lane()
        }
        fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
            self.$f.shfl(mask, v, src)
        }
        fn match_any(&self, mask: u32, v: u64) -> u32 {
            self.$f.match_any(mask, v)
        }
        fn match_all(&self, mask: u32, v: u64) -> bool {
            self.$f.match_all(mask, v)
        }
        fn ballot(&self, mask: u32, pred: bool) -> u32 {
            self.$f.ballot(mask, pred)
        }
        fn slot_hint(&self) -> u32 {
            self.$f.slot_hint()
        }
    };
}
#[allow(unused_imports)]
pub(crate) use forward_collectives;

/// A formatted heap segment whose arrays live in this struct.
pub struct HostHeap {
    pub handle: Box<HeapHandle>,
    // Vecs, not boxes: moving a `Box` retags it under Miri's Stacked Borrows, which would
    // invalidate the addresses the handle holds.
    counters: Vec<AtomicU64>,
    used: Vec<AtomicU32>,
    peak: Vec<AtomicU32>,
    offset: Vec<AtomicU64>,
    words: Vec<AtomicU64>,
    data: Vec<u128>,
}

fn atomics64(n: usize) -> Vec<AtomicU64> {
    (0..n).map(|_| AtomicU64::new(0)).collect()
}
fn atomics32(n: usize) -> Vec<AtomicU32> {
    (0..n).map(|_| AtomicU32::new(0)).collect()
}

impl HostHeap {
    /// A slab of `capacity` blocks of `block_size` bytes, with shards of `1 << shard_words_log2`
    /// words (the host's geometry when `None`).
    pub fn slab(capacity: u64, block_size: u64, shard_words_log2: Option<u32>, flags: u32) -> Self {
        let mut g = slab_geometry(capacity).unwrap();
        if let Some(l) = shard_words_log2 {
            g.shard_words_log2 = l;
            g.nshards = (g.nwords as u64).div_ceil(1 << l) as u32;
        }
        let data: Vec<u128> = vec![0; (capacity * block_size).div_ceil(16) as usize];
        let mut heap = HostHeap {
            handle: Box::new(HeapHandle::zeroed_handle()),
            counters: atomics64(COUNTERS * COUNTER_SLOTS),
            used: atomics32(g.nshards as usize),
            peak: atomics32(g.nshards as usize),
            offset: atomics64(1),
            words: atomics64(g.nwords as usize),
            data,
        };
        *heap.handle = HeapHandle {
            data: heap.data.as_ptr() as u64,
            counters: heap.counters.as_ptr() as u64,
            shard_used: heap.used.as_ptr() as u64,
            shard_peak: heap.peak.as_ptr() as u64,
            words: heap.words.as_ptr() as u64,
            ..HeapHandle::slab(g, capacity, block_size, flags)
        };
        heap
    }

    /// A bump arena of `capacity` bytes with `nslots` chunk slots of `1 << chunk_log2` bytes.
    pub fn bump(capacity: u64, nslots: u32, chunk_log2: u32) -> Self {
        let data: Vec<u128> = vec![0; capacity.div_ceil(16) as usize];
        let mut heap = HostHeap {
            handle: Box::new(HeapHandle::zeroed_handle()),
            counters: atomics64(COUNTERS * COUNTER_SLOTS),
            used: atomics32(0),
            peak: atomics32(0),
            offset: atomics64(1),
            words: atomics64(nslots as usize * BUMP_SLOT_STRIDE),
            data,
        };
        *heap.handle = HeapHandle {
            magic: HEAP_MAGIC,
            kind: KIND_BUMP,
            capacity,
            data: heap.data.as_ptr() as u64,
            counters: heap.counters.as_ptr() as u64,
            shard_used: heap.offset.as_ptr() as u64,
            words: heap.words.as_ptr() as u64,
            nwords: nslots,
            shard_words_log2: chunk_log2,
            ..HeapHandle::zeroed_handle()
        };
        heap
    }

    pub fn data_start(&self) -> u64 {
        self.handle.data
    }

    /// Blocks counted as used, over all shards.
    pub fn in_use(&self) -> u64 {
        self.used
            .iter()
            .map(|u| u.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Sum of the shard peaks.
    pub fn peak_sum(&self) -> u64 {
        self.peak
            .iter()
            .map(|u| u.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Bitmap bits set.
    pub fn bits_set(&self) -> u64 {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    }

    pub fn counter(&self, which: usize) -> u64 {
        self.counters[which * COUNTER_SLOTS..(which + 1) * COUNTER_SLOTS]
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .sum()
    }

    /// A quiet slab's invariants: see [`check_slab`].
    pub fn check(&self) {
        check_slab(&self.handle);
    }

    /// Whether block `idx`'s bit is set.
    pub fn is_claimed(&self, idx: u64) -> bool {
        is_claimed(&self.handle, idx)
    }

    /// The index of `p` if it is the start of one of this slab's blocks.
    pub fn index_of(&self, p: *mut u8) -> Option<u64> {
        block_index(&self.handle, p)
    }

    pub fn bump_offset(&self) -> u64 {
        self.offset[0].load(Ordering::Relaxed)
    }
}

// SAFETY: the test heap outlives every use, and blocks are used only by their owner.
unsafe impl Send for HostHeap {}
// SAFETY: the test heap outlives every use, and blocks are used only by their owner.
unsafe impl Sync for HostHeap {}

/// A quiet slab's invariants (no call in flight): each shard's count equals the bits set in its
/// words, no count passes its peak nor a peak its shard's blocks, and no bit past the capacity is
/// set. With cursors ([`FLAG_CURSOR_SHARDS`]: a general heap's classes) the counts are where the
/// next runs start, and no peak is kept: only the bitmap is checked.
pub fn check_slab(h: &HeapHandle) {
    assert_eq!(h.kind, KIND_SLAB, "check is for slabs");
    // SAFETY: a formatted slab's arrays: `nwords` words, `nshards` counts and peaks.
    let (words, used, peak) = unsafe {
        (
            std::slice::from_raw_parts(h.words as *const AtomicU64, h.nwords as usize),
            std::slice::from_raw_parts(h.shard_used as *const AtomicU32, h.nshards as usize),
            std::slice::from_raw_parts(h.shard_peak as *const AtomicU32, h.nshards as usize),
        )
    };
    let per = 1usize << h.shard_words_log2;
    let cursor = h.flags & FLAG_CURSOR_SHARDS != 0;
    for s in (0..h.nshards as usize).filter(|_| !cursor) {
        let bits: u64 = words[s * per..((s + 1) * per).min(words.len())]
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum();
        let used = used[s].load(Ordering::Relaxed) as u64;
        let peak = peak[s].load(Ordering::Relaxed) as u64;
        let blocks = (h.capacity - (s * per * 64) as u64).min((per * 64) as u64);
        assert_eq!(used, bits, "shard {s}: count {used}, bits set {bits}");
        assert!(
            used <= peak,
            "shard {s}: count {used} above its peak {peak}"
        );
        assert!(
            peak <= blocks,
            "shard {s}: peak {peak} above its {blocks} blocks"
        );
    }
    if cursor {
        assert!(
            peak.iter().all(|p| p.load(Ordering::Relaxed) == 0),
            "a slab with cursors keeps no peak"
        );
    }
    for (i, w) in words.iter().enumerate() {
        let first = i as u64 * 64;
        let valid = match h.capacity.saturating_sub(first) {
            0 => 0,
            n if n >= 64 => u64::MAX,
            n => (1u64 << n) - 1,
        };
        let v = w.load(Ordering::Relaxed);
        assert_eq!(v & !valid, 0, "word {i}: bits past the capacity: {v:#x}");
    }
}

/// Blocks in use in the slab `h`: the bits set in its bitmap when its shard counts are cursors
/// ([`FLAG_CURSOR_SHARDS`]), else the sum of its shard counts.
pub fn blocks_in_use(h: &HeapHandle) -> u64 {
    // SAFETY: a formatted slab's arrays: `nwords` words, `nshards` counts.
    let (words, used) = unsafe {
        (
            std::slice::from_raw_parts(h.words as *const AtomicU64, h.nwords as usize),
            std::slice::from_raw_parts(h.shard_used as *const AtomicU32, h.nshards as usize),
        )
    };
    if h.flags & FLAG_CURSOR_SHARDS != 0 {
        words
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
            .sum()
    } else {
        used.iter().map(|u| u.load(Ordering::Relaxed) as u64).sum()
    }
}

/// Whether block `idx` of the slab `h` is claimed (its bit set).
pub fn is_claimed(h: &HeapHandle, idx: u64) -> bool {
    assert!(idx < h.capacity);
    // SAFETY: word `idx / 64` of a formatted slab's bitmap.
    let w = unsafe { &*(h.words as *const AtomicU64).add((idx / 64) as usize) };
    w.load(Ordering::Relaxed) >> (idx % 64) & 1 != 0
}

/// The index of `p` in the slab `h` if it is the start of one of its blocks.
pub fn block_index(h: &HeapHandle, p: *mut u8) -> Option<u64> {
    let off = (p as u64).checked_sub(h.data)?;
    (off % h.block_size == 0 && off / h.block_size < h.capacity).then(|| off / h.block_size)
}

trait Zeroed {
    fn zeroed_handle() -> Self;
}
impl Zeroed for HeapHandle {
    fn zeroed_handle() -> Self {
        bytemuck::Zeroable::zeroed()
    }
}
pub mod entry;
pub mod general;
pub mod lockstep;
