//! A general heap in host memory for the host-build tests, laid out exactly as on the device.
#![allow(dead_code)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use carve_kernels::general;
use carve_kernels::heap_layout::*;
use carve_kernels::size_class::class_of;
use carve_kernels::warp::Warp;

/// A general heap in one host region laid out exactly as on the device.
pub struct HostGeneral {
    pub base: *mut u8,
    layout: Layout,
    pub plan: GeneralPlan,
}

// SAFETY: the region outlives every use; blocks are used only by their owner, metadata only
// through atomics.
unsafe impl Send for HostGeneral {}
// SAFETY: as above.
unsafe impl Sync for HostGeneral {}

impl HostGeneral {
    pub fn new(bytes_per_class: u64) -> Self {
        let plan = general_plan(bytes_per_class).unwrap();
        let layout = Layout::from_size_align(plan.total, 4096).unwrap();
        // SAFETY: a non-zero size.
        let base = unsafe { alloc_zeroed(layout) };
        assert!(!base.is_null());
        let b = base as u64;
        // SAFETY: the header and each class handle lie inside the fresh, zeroed region, at
        // 8-byte aligned offsets.
        unsafe {
            (base as *mut GeneralHeader).write(plan.header(b));
            for c in 0..plan.nclasses {
                (base.add(plan.class_offset(c)) as *mut HeapHandle).write(plan.class_handle(
                    c,
                    b,
                    FLAG_CHECKED_FREES,
                ));
            }
        }
        HostGeneral { base, layout, plan }
    }

    /// A general heap laid out as one that grew: every class a chain of two segments in its
    /// stride, the first (at the stride's start) of at most `first` blocks, and after it the
    /// head of the chain, of as many blocks as the rest of the stride holds (a class whose
    /// stride has no room for two stays one segment).
    pub fn grown(bytes_per_class: u64, first: u64) -> Self {
        let heap = Self::new(bytes_per_class);
        let stride = 1usize << heap.plan.stride_log2;
        for c in 0..heap.plan.nclasses {
            let k = &heap.plan.classes()[c];
            let (bs, align) = (k.block_size, slab_block_align(k.block_size));
            let seg = heap.plan.class_offset(c);
            let cap_a = first.min(k.capacity);
            let la = slab_layout(slab_geometry(cap_a).unwrap(), cap_a, bs, align).unwrap();
            let off_b = seg + la.total.next_multiple_of(4096);
            let fits = |n: u64| {
                slab_geometry(n)
                    .and_then(|g| slab_layout(g, n, bs, align))
                    .is_some_and(|l| off_b + l.total <= seg + stride)
            };
            let mut cap_b = ((seg + stride - off_b) as u64) / bs;
            while cap_b > 0 && !fits(cap_b) {
                cap_b -= 1;
            }
            if cap_b == 0 {
                // A large class whose stride holds one block or two: it stays one segment.
                continue;
            }
            let a = heap.format_slab(seg, cap_a, bs, 0);
            let b = heap.format_slab(off_b, cap_b, bs, a);
            let slot = core::mem::offset_of!(GeneralHeader, classes) + 8 * c;
            // SAFETY: the header's class pointer `c`, inside the region; nothing reads it now.
            unsafe { (heap.base.add(slot) as *mut u64).write(b) };
        }
        heap
    }

    /// Formats a class slab segment of `capacity` blocks of `block_size` at byte `off` of the
    /// zeroed region, linked to `next`; returns its address.
    fn format_slab(&self, off: usize, capacity: u64, block_size: u64, next: u64) -> u64 {
        let g = slab_geometry(capacity).unwrap();
        let l = slab_layout(g, capacity, block_size, slab_block_align(block_size)).unwrap();
        let seg = self.base as u64 + off as u64;
        let h = HeapHandle {
            data: seg + l.data as u64,
            counters: seg + l.counters as u64,
            shard_used: seg + l.shard_used as u64,
            shard_peak: seg + l.shard_peak as u64,
            words: seg + l.words as u64,
            next,
            ..HeapHandle::slab(
                g,
                capacity,
                block_size,
                FLAG_CHECKED_FREES | FLAG_CURSOR_SHARDS,
            )
        };
        // SAFETY: `off` is inside the region, 4096-byte aligned; its metadata is still zero.
        unsafe { (self.base.add(off) as *mut HeapHandle).write(h) };
        seg
    }

    /// The segments of class `c`'s chain, head first.
    pub fn chain(&self, c: usize) -> Vec<&HeapHandle> {
        let mut v = vec![self.class(c)];
        while v.last().unwrap().next != 0 {
            // SAFETY: `next` is a formatted segment handle inside the region.
            v.push(unsafe { &*(v.last().unwrap().next as *const HeapHandle) });
        }
        v
    }

    /// Blocks in use over every segment of every class.
    pub fn chain_in_use(&self) -> u64 {
        (0..self.plan.nclasses)
            .flat_map(|c| self.chain(c))
            .map(super::blocks_in_use)
            .sum()
    }

    /// Double frees counted over every segment of every class.
    pub fn chain_double_frees(&self) -> u64 {
        (0..self.plan.nclasses)
            .flat_map(|c| self.chain(c))
            .map(|h| {
                Self::sum64(
                    h.counters + (8 * COUNTER_DOUBLE_FREES * COUNTER_SLOTS) as u64,
                    32,
                )
            })
            .sum()
    }

    pub fn header(&self) -> &GeneralHeader {
        // SAFETY: formatted in `new`.
        unsafe { general::header(self.base as *const GeneralHeader) }.unwrap()
    }

    pub fn class(&self, c: usize) -> &HeapHandle {
        // SAFETY: formatted in `new`.
        unsafe { self.header().class_handle(c as u32) }
    }

    pub fn malloc<W: Warp>(&self, w: &W, bytes: u64) -> *mut u8 {
        // SAFETY: a formatted heap that outlives the call.
        unsafe { general::malloc(self.header(), w, bytes, 0) }
    }

    pub fn free<W: Warp>(&self, w: &W, p: *mut u8) {
        // SAFETY: as above; callers free only what they own (or test foreign pointers).
        unsafe { general::free(self.header(), w, p) }
    }

    pub fn sum64(addr: u64, n: usize) -> u64 {
        // SAFETY: `addr` is an array of `n` atomics inside the region.
        (0..n)
            .map(|i| unsafe { &*(addr as *const AtomicU64).add(i) }.load(Ordering::Relaxed))
            .sum()
    }

    pub fn sum32(addr: u64, n: usize) -> u64 {
        // SAFETY: as for `sum64`.
        (0..n)
            .map(|i| unsafe { &*(addr as *const AtomicU32).add(i) }.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Header counter `which` (requests no class serves, frees outside every class).
    pub fn header_counter(&self, which: usize) -> u64 {
        Self::sum64(
            self.header().counters + (8 * which * COUNTER_SLOTS) as u64,
            COUNTER_SLOTS,
        )
    }

    /// Class `c`: (in use, peak sum, failed, foreign, double). In use is the bits set in the
    /// class's bitmap (its shard counts are cursors); the peaks stay 0.
    pub fn class_stats(&self, c: usize) -> (u64, u64, u64, u64, u64) {
        let h = self.class(c);
        let counter = |w: usize| Self::sum64(h.counters + (8 * w * COUNTER_SLOTS) as u64, 32);
        (
            super::blocks_in_use(h),
            Self::sum32(h.shard_peak, h.nshards as usize),
            counter(COUNTER_FAILED_ALLOCS),
            counter(COUNTER_FOREIGN_FREES),
            counter(COUNTER_DOUBLE_FREES),
        )
    }

    /// The header's address, as kernels pass it.
    pub fn ptr(&self) -> *const GeneralHeader {
        self.base as *const GeneralHeader
    }

    /// Every class slab's invariants ([`super::check_slab`]).
    pub fn check(&self) {
        for c in 0..self.plan.nclasses {
            super::check_slab(self.class(c));
        }
    }

    /// The class and block index of `p`, if it is the start of a block of this heap.
    pub fn block_of(&self, p: *mut u8) -> Option<(usize, u64)> {
        let c = self.header().class_of_ptr(p)? as usize;
        Some((c, super::block_index(self.class(c), p)?))
    }

    /// Whether `p` is the start of a claimed block of this heap.
    pub fn is_claimed(&self, p: *mut u8) -> bool {
        self.block_of(p)
            .is_some_and(|(c, i)| super::is_claimed(self.class(c), i))
    }

    pub fn total_in_use(&self) -> u64 {
        (0..self.plan.nclasses).map(|c| self.class_stats(c).0).sum()
    }

    pub fn total_double_frees(&self) -> u64 {
        (0..self.plan.nclasses).map(|c| self.class_stats(c).4).sum()
    }

    /// Asserts `p` is a block start of the class serving `bytes`, inside its data range.
    pub fn assert_block_of(&self, p: *mut u8, bytes: u64) {
        let c = class_of(bytes as u32).unwrap() as usize;
        let h = self.class(c);
        let a = p as u64;
        assert!(
            a >= h.data && a < h.data + h.capacity * h.block_size,
            "{bytes} B -> {a:#x} outside class {c}"
        );
        assert_eq!(
            (a - h.data) % h.block_size,
            0,
            "{bytes} B: not a block start"
        );
        assert_eq!(self.header().class_of_ptr(p), Some(c as u32));
        assert_eq!(
            a % slab_block_align(h.block_size),
            0,
            "{bytes} B: misaligned"
        );
    }
}

impl Drop for HostGeneral {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { dealloc(self.base, self.layout) };
    }
}
