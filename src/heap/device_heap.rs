//! [`DeviceHeap`]: a heap's segments, reserved from a resource and formatted; its statistics
//! read back, reset and release.

use std::ptr::NonNull;

use carve_kernels::heap_layout::{self as layout, GeneralPlan, HeapHandle};
use cudarc::driver::{result, sys};

use super::growth::Growth;
use super::region::{
    bump_plan, check_block_size, general_plan, raw_len_of, region_align, relocate, slab_plan,
    HeapKind, Segment,
};
use super::stats::HeapStats;
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::resource::{SharedResource, DEFAULT_ALIGNMENT};

/// A heap in device memory that kernels allocate from. Its segments go back to the resource on
/// drop (ordered on the heap's stream).
#[derive(Debug)]
pub struct DeviceHeap {
    pub(super) kind: HeapKind,
    pub(super) flags: u32,
    /// Where segments come from; `None` for a growable general heap, whose memory its
    /// [`Growth`] maps.
    pub(super) resource: Option<SharedResource>,
    pub(super) stream: Stream,
    pub(super) segments: Vec<Segment>,
    /// A general heap's plan (its one segment holds the header and every class).
    pub(super) general: Option<Box<GeneralPlan>>,
    /// Bound, policy and virtual range of growth; counters of trimmed segments.
    pub(super) growth: Growth,
}

// SAFETY: the heap owns its regions; the host touches them only through stream-ordered driver
// copies, and `&DeviceHeap` exposes no mutation.
unsafe impl Send for DeviceHeap {}
// SAFETY: as above.
unsafe impl Sync for DeviceHeap {}

impl DeviceHeap {
    /// A slab of `capacity` blocks of `block_size` bytes (a multiple of 16), reserved from
    /// `resource` and ordered on `stream`. Frees are checked (double frees are counted, not
    /// trusted); see [`DeviceHeap::slab_unchecked`]. A double free is seen only while the block
    /// is still free: once it was handed out again, a stale free of the old pointer frees the
    /// new owner's block, uncounted (`kernels/carve_heap.h`).
    ///
    /// Where the memory comes from matters a little: on an H100, a heap in memory that
    /// cuMemAlloc handed out after a large allocation (1.5 GiB or more) was freed took about 4 %
    /// longer to free blocks, while one over a [`VirtualMemoryResource`](crate::VirtualMemoryResource)
    /// (a virtual range of its own) did not; `carve bench device-alloc` uses the latter.
    pub fn slab(
        resource: SharedResource,
        stream: &Stream,
        capacity: u64,
        block_size: u64,
    ) -> Result<Self> {
        Self::new_slab(
            resource,
            stream,
            capacity,
            block_size,
            layout::FLAG_CHECKED_FREES,
        )
    }

    /// As [`DeviceHeap::slab`], but double frees are not counted in the statistics (they are
    /// still ignored: neither the bitmap nor the block counts change).
    pub fn slab_unchecked(
        resource: SharedResource,
        stream: &Stream,
        capacity: u64,
        block_size: u64,
    ) -> Result<Self> {
        Self::new_slab(resource, stream, capacity, block_size, 0)
    }

    fn new_slab(
        resource: SharedResource,
        stream: &Stream,
        capacity: u64,
        block_size: u64,
        flags: u32,
    ) -> Result<Self> {
        check_block_size(block_size)?;
        let mut heap = DeviceHeap {
            kind: HeapKind::Slab { block_size },
            flags,
            resource: Some(resource),
            stream: stream.clone(),
            segments: Vec::new(),
            general: None,
            growth: Growth::plain(),
        };
        heap.check_resource()?;
        heap.push_segment(capacity)?;
        Ok(heap)
    }

    /// A bump arena of `capacity` bytes reserved from `resource`, ordered on `stream`.
    pub fn bump(resource: SharedResource, stream: &Stream, capacity: u64) -> Result<Self> {
        let mut heap = DeviceHeap {
            kind: HeapKind::Bump,
            flags: 0,
            resource: Some(resource),
            stream: stream.clone(),
            segments: Vec::new(),
            general: None,
            growth: Growth::plain(),
        };
        heap.check_resource()?;
        heap.push_segment(capacity)?;
        Ok(heap)
    }

    /// A general heap: `carve_malloc(heap, bytes)` serves any size from 1 byte to 64 KiB from
    /// one slab per size class (44 classes, at most a fifth of a block wasted), larger requests
    /// up to 16 MiB from large classes of whole power-of-two blocks, and `carve_free(heap, ptr)`
    /// finds the class from the pointer. Each class in use gets `bytes_per_class` bytes (rounded
    /// up to a power of two, at least 128 KiB), metadata included, so small classes hold many
    /// blocks and large ones few; a large class is in use when one of its blocks fits (all eight
    /// from 32 MiB per class). The region is `classes in use × bytes_per_class` plus 4 KiB.
    /// Requests of 0 bytes or past the largest class in use return null and count as failed
    /// allocations.
    /// Frees are checked, as for [`DeviceHeap::slab`]. This heap does not grow; one made with
    /// [`DeviceHeap::growable`] and [`HeapKind::General`] grows class by class.
    pub fn general(
        resource: SharedResource,
        stream: &Stream,
        bytes_per_class: u64,
    ) -> Result<Self> {
        let plan = general_plan(bytes_per_class)?;
        let mut heap = DeviceHeap {
            kind: HeapKind::General {
                bytes_per_class: 1 << plan.stride_log2,
            },
            flags: layout::FLAG_CHECKED_FREES,
            resource: Some(resource),
            stream: stream.clone(),
            segments: Vec::new(),
            general: Some(Box::new(plan)),
            growth: Growth::plain(),
        };
        heap.check_resource()?;
        heap.push_general()?;
        Ok(heap)
    }

    /// The statistics of each size class of a general heap, by class (kind
    /// [`HeapKind::Slab`] with the class's block size; one copy per class); empty for other
    /// heaps. Requests no class serves and frees outside every class are in [`DeviceHeap::stats`]
    /// only, as are the counters of class segments [`trim`](DeviceHeap::trim) removed. A class of
    /// a growable general heap counts its whole chain.
    pub fn class_stats(&self) -> Result<Vec<HeapStats>> {
        let Some(plan) = &self.general else {
            return Ok(Vec::new());
        };
        (0..plan.classes().len())
            .map(|c| self.class_stat(c))
            .collect()
    }

    /// The heap's kind.
    pub fn kind(&self) -> HeapKind {
        self.kind
    }

    /// The device address to pass to kernels (the first segment's handle).
    pub fn device_ptr(&self) -> u64 {
        self.segments[0].ptr.as_ptr() as u64
    }

    /// The first segment's handle, as written to the device. For a general heap (whose region
    /// starts with a `GeneralHeader` instead), a summary: kind `KIND_GENERAL`, `capacity` the
    /// blocks over all classes, `data` class 0's segment, `counters` the header's counters.
    pub fn handle(&self) -> &HeapHandle {
        &self.segments[0].handle
    }

    /// Total capacity over all segments: blocks (slab) or bytes (bump).
    pub fn capacity(&self) -> u64 {
        self.segments.iter().map(|s| s.handle.capacity).sum::<u64>() + self.general_extra_capacity()
    }

    /// The stream the heap's formatting, statistics and release are ordered on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Adds a segment of `capacity` more blocks (slab) or bytes (bump). Kernels launched after
    /// this (on the heap's stream, or synchronised with it) allocate from it once the earlier
    /// segments are full. Must not run while a kernel uses the heap. On a
    /// [`growable`](DeviceHeap::growable) heap, a segment past the maximum is an
    /// [`Error::OutOfMemory`]; [`ensure_free`](DeviceHeap::ensure_free) sizes segments itself.
    pub fn grow(&mut self, capacity: u64) -> Result<()> {
        if self.general.is_some() {
            return Err(Error::Unsupported(
                "a general heap does not grow yet".to_string(),
            ));
        }
        self.push_segment(capacity)
    }

    /// Reads the statistics back (one copy per segment), waiting for the heap's stream.
    pub fn stats(&self) -> Result<HeapStats> {
        if self.general.is_some() {
            let seg = &self.segments[0];
            let mut prefix = vec![0u8; seg.layout.stats_end];
            self.copy_out(seg.ptr, &mut prefix)?;
            let mut total = HeapStats::parse(self.kind, &seg.handle, &seg.layout, &prefix);
            total.capacity = 0;
            if let Some(retired) = self.growth.retired() {
                total.add(&retired);
            }
            for class in self.class_stats()? {
                total.add(&class);
            }
            return Ok(total);
        }
        let mut total = self
            .growth
            .retired()
            .unwrap_or_else(|| HeapStats::empty(self.kind));
        for seg in &self.segments {
            total.add(&self.segment_stat(seg)?);
        }
        Ok(total)
    }

    /// One segment's statistics (one copy; a class segment of a general heap reads as a slab).
    pub(super) fn segment_stat(&self, seg: &Segment) -> Result<HeapStats> {
        let mut prefix = vec![0u8; seg.layout.stats_len(seg.handle.flags)];
        self.copy_out(seg.ptr, &mut prefix)?;
        let kind = match self.kind {
            // A class segment of a growable general heap.
            HeapKind::General { .. } => HeapKind::Slab {
                block_size: seg.handle.block_size,
            },
            k => k,
        };
        Ok(HeapStats::parse(kind, &seg.handle, &seg.layout, &prefix))
    }

    /// Forgets every allocation: the bump arena starts over, a slab is empty again. Statistics
    /// restart too. Blocks handed out before must not be used after this.
    pub fn reset(&self) -> Result<()> {
        for seg in &self.segments {
            self.memset_meta(seg)?;
        }
        self.memset_classes()?;
        self.growth.reset();
        self.stream.synchronize()
    }

    pub(super) fn check_resource(&self) -> Result<()> {
        let r = self.resource()?;
        if !r.properties().device_accessible {
            return Err(Error::InvalidArgument(format!(
                "a device heap needs device-accessible memory; {r:?} is not"
            )));
        }
        Ok(())
    }

    /// The resource segments come from.
    pub(super) fn resource(&self) -> Result<&SharedResource> {
        self.resource.as_ref().ok_or_else(|| {
            Error::Unsupported("a growable general heap grows by class only".to_string())
        })
    }

    pub(super) fn push_segment(&mut self, capacity: u64) -> Result<()> {
        if capacity == 0 {
            return Err(Error::ZeroSize);
        }
        let (handle, region) = match self.kind {
            HeapKind::Slab { block_size } => slab_plan(capacity, block_size, self.flags)?,
            HeapKind::Bump => bump_plan(capacity)?,
            HeapKind::General { .. } => {
                return Err(Error::Unsupported(
                    "a general heap does not grow yet".to_string(),
                ))
            }
        };
        self.check_budget(raw_len_of(region.total, self.kind)?)?;
        let (raw, raw_len, ptr) = self.reserve_region(region.total)?;
        let mut seg = Segment {
            ptr,
            raw,
            raw_len,
            layout: region,
            handle,
        };
        relocate(&mut seg.handle, &region, ptr.as_ptr() as u64);
        if let Err(e) = self.format(&seg) {
            // SAFETY: allocated just above with these arguments, never published.
            let undo = unsafe {
                self.resource()?
                    .deallocate(self.stream.as_ref(), raw, raw_len, DEFAULT_ALIGNMENT)
            };
            crate::deferred::record("DeviceHeap: undoing a segment", undo);
            return Err(e);
        }
        if let Some(last) = self.segments.last_mut() {
            last.handle.next = ptr.as_ptr() as u64;
            let at = last.ptr.as_ptr() as u64 + std::mem::offset_of!(HeapHandle, next) as u64;
            let next = [last.handle.next];
            copy_in(&self.stream, at, bytemuck::cast_slice(&next))?;
            self.stream.synchronize()?;
        }
        self.segments.push(seg);
        Ok(())
    }

    /// A block of the resource for a region of `total` bytes: (the block, its length, the
    /// region's start inside it). Slab blocks are aligned to their size (up to 4 KiB), which not
    /// every resource can give (cuMemAlloc promises 256 B): the block holds the slack and the
    /// region starts aligned inside it.
    fn reserve_region(&self, total: usize) -> Result<(NonNull<u8>, usize, NonNull<u8>)> {
        self.stream.device().bind()?;
        let align = region_align(self.kind);
        let raw_len = raw_len_of(total, self.kind)?;
        let raw = self
            .resource()?
            .allocate(self.stream.as_ref(), raw_len, DEFAULT_ALIGNMENT)?;
        let offset = (raw.as_ptr() as usize).next_multiple_of(align) - raw.as_ptr() as usize;
        // The resource honoured DEFAULT_ALIGNMENT, so offset <= align - DEFAULT_ALIGNMENT and
        // the region fits in the block.
        let ptr = NonNull::new(raw.as_ptr().wrapping_add(offset)).unwrap_or(raw);
        Ok((raw, raw_len, ptr))
    }

    /// Reserves and formats a general heap's one region: the header, then every class's slab
    /// segment at its stride.
    fn push_general(&mut self) -> Result<()> {
        let Some(plan) = self.general.as_deref().copied() else {
            return Err(Error::InvalidArgument("not a general heap".to_string()));
        };
        let (raw, raw_len, ptr) = self.reserve_region(plan.total)?;
        self.install_general(plan, ptr, raw, raw_len)
    }

    /// Formats a general heap of `plan` in the region at `ptr` (the resource block `raw`, or
    /// mapped memory with `raw_len` 0), whose header and every class's first segment must be
    /// backed.
    pub(super) fn install_general(
        &mut self,
        plan: GeneralPlan,
        ptr: NonNull<u8>,
        raw: NonNull<u8>,
        raw_len: usize,
    ) -> Result<()> {
        let base = ptr.as_ptr() as u64;
        let header = plan.header(base);
        let summary = HeapHandle {
            magic: layout::HEAP_MAGIC,
            kind: layout::KIND_GENERAL,
            capacity: plan.classes().iter().map(|k| k.capacity).sum(),
            data: header.base,
            counters: header.counters,
            ..bytemuck::Zeroable::zeroed()
        };
        self.segments.push(Segment {
            ptr,
            raw,
            raw_len,
            layout: plan.header_layout(),
            handle: summary,
        });
        // On failure the segment is already ours: dropping the heap returns it.
        self.memset_meta(&self.segments[0])?;
        self.memset_classes()?;
        let handles: Vec<HeapHandle> = (0..plan.classes().len())
            .map(|c| plan.class_handle(c, base, self.flags))
            .collect();
        for (c, h) in handles.iter().enumerate() {
            copy_in(
                &self.stream,
                base + plan.class_offset(c) as u64,
                bytemuck::bytes_of(h),
            )?;
        }
        copy_in(&self.stream, base, bytemuck::bytes_of(&header))?;
        // The header and handles live on our stack: wait before they go.
        self.stream.synchronize()
    }

    /// Zeroes every class's slab metadata of a general heap (nothing for other heaps).
    fn memset_classes(&self) -> Result<()> {
        let Some(plan) = &self.general else {
            return Ok(());
        };
        let base = self.segments[0].ptr.as_ptr() as u64;
        for (c, k) in plan.classes().iter().enumerate() {
            let start = base + (plan.class_offset(c) + k.layout.counters) as u64;
            // SAFETY: [counters, meta_end) of class `c`'s segment lies inside the region, which
            // we own.
            unsafe { self.zero(start, k.layout.meta_end - k.layout.counters) }?;
        }
        if let Some(g) = &self.growth.general {
            for seg in g.classes.iter().flat_map(|c| &c.extra) {
                self.memset_meta(seg)?;
            }
        }
        Ok(())
    }

    pub(super) fn format(&self, seg: &Segment) -> Result<()> {
        self.memset_meta(seg)?;
        copy_in(
            &self.stream,
            seg.ptr.as_ptr() as u64,
            bytemuck::bytes_of(&seg.handle),
        )?;
        // The handle lives on our stack: wait before it goes.
        self.stream.synchronize()
    }

    fn memset_meta(&self, seg: &Segment) -> Result<()> {
        let start = seg.layout.counters;
        // SAFETY: [counters, meta_end) lies inside the segment's region, which we own.
        unsafe {
            self.zero(
                seg.ptr.as_ptr() as u64 + start as u64,
                seg.layout.meta_end - start,
            )
        }
    }

    /// Zeroes `len` bytes at device address `at`, in stream order.
    ///
    /// # Safety
    /// `[at, at + len)` lies in device memory we own and nothing else uses before the stream
    /// reaches it.
    unsafe fn zero(&self, at: u64, len: usize) -> Result<()> {
        self.stream.device().bind()?;
        // SAFETY: the caller's contract.
        unsafe { result::memset_d8_async(at, 0, len, self.stream.as_ref().as_raw()) }
            .map_err(|e| Error::driver("cuMemsetD8Async", e))
    }

    pub(super) fn copy_out(&self, ptr: NonNull<u8>, dst: &mut [u8]) -> Result<()> {
        self.stream.device().bind()?;
        // SAFETY: `dst.len()` bytes from the region's start lie inside it; we wait before `dst`
        // is read.
        unsafe {
            result::memcpy_dtoh_async(
                dst,
                ptr.as_ptr() as sys::CUdeviceptr,
                self.stream.as_ref().as_raw(),
            )
        }
        .map_err(|e| Error::driver("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()
    }
}

impl Drop for DeviceHeap {
    fn drop(&mut self) {
        let Some(resource) = &self.resource else {
            // A growable general heap: its `Growth` unmaps everything, after waiting.
            return;
        };
        for seg in self.segments.drain(..) {
            // SAFETY: each region came from this resource with these arguments, once; kernels
            // using it are ordered before the free on the heap's stream.
            let r = unsafe {
                resource.deallocate(
                    self.stream.as_ref(),
                    seg.raw,
                    seg.raw_len,
                    DEFAULT_ALIGNMENT,
                )
            };
            crate::deferred::record("DeviceHeap drop: returning a segment", r);
        }
    }
}

/// Copies `src` to device address `dst`, in the order of `stream`.
pub(super) fn copy_in(stream: &Stream, dst: u64, src: &[u8]) -> Result<()> {
    stream.device().bind()?;
    // SAFETY: callers pass a destination inside a region they own, `src.len()` bytes long, and
    // synchronise before `src` goes away.
    unsafe { result::memcpy_htod_async(dst, src, stream.as_ref().as_raw()) }
        .map_err(|e| Error::driver("cuMemcpyHtoDAsync", e))
}
