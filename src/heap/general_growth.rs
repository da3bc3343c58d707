//! Growable general heaps: each size class grows inside its own stride of address space.
//!
//! The kernels find a pointer's class as `(ptr - base) >> stride_log2`, so a class's segments
//! must all lie in its stride. A growable general heap reserves one range of
//! `chunk + classes × stride` bytes, with a stride as large as the heap's maximum (address space
//! only), maps one chunk for the header and each class's first segment, and grows a class by
//! mapping a new slab segment right after the class's last one (the kernels' class allocation
//! and free walk the class's chain: `slab::chain_alloc`, `slab::chain_free`).
//!
//! **Newest first.** A new segment goes at the head of its class's chain (its `next` is the old
//! head, and the header's class pointer moves to it), so allocations try the largest, emptiest
//! segment first instead of passing every full one before it; free finds a block's segment
//! whatever the order. Trim removes the newest empty segments, at the head, by moving the
//! class pointer back.
//!
//! Layout of the range: the header sits in the last 4 KiB of chunk 0, so that class 0 (4 KiB
//! after the header) and every later class start on a chunk boundary.

use std::ptr::NonNull;
use std::time::Instant;

use carve_kernels::heap_layout::{self as layout, GeneralPlan};

use super::device_heap::{copy_in, DeviceHeap};
use super::general_range::{ClassChain, GeneralGrowth};
use super::growth::{
    check_options, fill, plan_segment, policy_need, raw_bytes, segment_capacity, GrowOptions,
    Growth, GrowthReport, TrimReport,
};
use super::mapped::MappedRange;
use super::region::{general_plan, relocate, slab_plan, HeapKind, Segment};
use super::stats::HeapStats;
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::resource::{CudaBacking, CudaBackingOptions, PhysicalBacking};

/// Sizes of a growable general heap: (first segment bytes per class, stride) for
/// `bytes_per_class`, `max_bytes` and chunks of `chunk` bytes.
fn general_sizes(bytes_per_class: u64, max_bytes: usize, chunk: usize) -> Result<(usize, usize)> {
    let first = usize::try_from(bytes_per_class)
        .ok()
        .and_then(|b| b.max(chunk).checked_next_power_of_two())
        .ok_or_else(|| Error::InvalidArgument(format!("{bytes_per_class} bytes per class")))?;
    let stride = max_bytes
        .max(first)
        .checked_next_power_of_two()
        .filter(|&s| s <= 1 << layout::GENERAL_MAX_STRIDE_LOG2)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "a growable general heap of at most {max_bytes} bytes: the class stride (the \
                 maximum rounded up to a power of two) must be at most {} bytes",
                1u64 << layout::GENERAL_MAX_STRIDE_LOG2
            ))
        })?;
    // The classes whose block fits a first segment of `first` bytes (every small class).
    let nclasses = layout::general_plan(first as u64)
        .map_or(carve_kernels::size_class::NUM_SMALL_CLASSES, |p| p.nclasses);
    let least = chunk + nclasses * first;
    if least > max_bytes {
        return Err(Error::OutOfMemory {
            bytes: least,
            resource: "DeviceHeap",
            detail: format!(
                "a growable general heap maps one chunk for its header and {first} bytes for \
                 each of its {nclasses} classes: {least} bytes, past the maximum {max_bytes}"
            ),
        });
    }
    Ok((first, stride))
}

/// The plan of a growable general heap: class segments of `first` bytes placed `stride` apart.
fn spread_plan(first: usize, stride: usize) -> Result<GeneralPlan> {
    let mut plan = general_plan(first as u64)?;
    plan.stride_log2 = stride.trailing_zeros();
    plan.total = layout::GENERAL_CLASSES_OFFSET + plan.classes().len() * stride;
    Ok(plan)
}

impl DeviceHeap {
    /// A general heap whose classes grow ([`growable`](Self::growable) with
    /// [`HeapKind::General`]): `bytes_per_class` (rounded up to a power of two, at least one
    /// chunk) is each class's first segment.
    pub(super) fn growable_general(
        bytes_per_class: u64,
        stream: &Stream,
        options: GrowOptions,
    ) -> Result<Self> {
        // `initial` does not apply: the first segments are `bytes_per_class`.
        let sized = GrowOptions {
            initial: 1,
            ..options
        };
        check_options(HeapKind::Slab { block_size: 16 }, &sized)?;
        let backing = CudaBacking::new(stream.device(), CudaBackingOptions::default())?;
        let g = backing.granularity();
        let chunk = options.chunk_size.unwrap_or(g);
        if !chunk.is_power_of_two() || chunk % g != 0 {
            return Err(Error::InvalidArgument(format!(
                "chunk size {chunk} is not a power-of-two multiple of the granularity {g}"
            )));
        }
        let (first, stride) = general_sizes(bytes_per_class, options.max_bytes, chunk)?;
        let plan = spread_plan(first, stride)?;
        let n = plan.classes().len();
        let size = n
            .checked_mul(stride)
            .and_then(|b| b.checked_add(chunk))
            .ok_or(Error::SizeOverflow {
                bytes: usize::MAX,
                align: chunk,
            })?;
        let mut range = MappedRange::new(backing, size)?;
        range.map(0, chunk)?;
        for c in 0..n {
            range.map(chunk + c * stride, first)?;
        }
        let region = range.base() + chunk - layout::GENERAL_CLASSES_OFFSET;
        let ptr = NonNull::new(region as *mut u8)
            .ok_or_else(|| Error::InvalidArgument("a reservation at address 0".to_string()))?;
        let mut growth = Growth::plain();
        growth.policy = options.policy;
        growth.max_bytes = Some(options.max_bytes);
        growth.chunk = chunk;
        growth.general = Some(Box::new(GeneralGrowth {
            device: stream.device().clone(),
            range,
            stride,
            classes_off: chunk,
            first_len: first,
            classes: (0..n).map(|_| ClassChain::default()).collect(),
        }));
        let mut heap = DeviceHeap {
            kind: HeapKind::General {
                bytes_per_class: first as u64,
            },
            flags: layout::FLAG_CHECKED_FREES,
            resource: None,
            stream: stream.clone(),
            segments: Vec::new(),
            general: Some(Box::new(plan)),
            growth,
        };
        heap.install_general(plan, ptr, ptr, 0)?;
        Ok(heap)
    }

    /// Grows size class `class` of a growable general heap, between launches, until at least
    /// `bytes` of it are free (`bytes / class size` blocks, rounded up): appends a slab segment
    /// inside the class's stride and links it. Errors: [`Error::ZeroSize`],
    /// [`Error::InvalidArgument`] for a class past the last, [`Error::OutOfMemory`] past the
    /// maximum or the class's stride, [`Error::Unsupported`] for other heaps.
    pub fn ensure_free_class(&mut self, class: usize, bytes: u64) -> Result<GrowthReport> {
        let started = Instant::now();
        let block = self.class_block_size(class)?;
        if bytes == 0 {
            return Err(Error::ZeroSize);
        }
        let s = self.class_stat(class)?;
        let need = bytes
            .div_ceil(block)
            .saturating_sub(s.capacity.saturating_sub(s.in_use));
        let mut report = GrowthReport {
            fill_before: fill(&s),
            ..GrowthReport::default()
        };
        self.grow_class(class, need, &mut report)?;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// The segment addresses of class `class` of a general heap, in chain order (one for a
    /// general heap that does not grow); empty past the last class or for other heaps.
    pub fn class_segment_ptrs(&self, class: usize) -> Vec<u64> {
        let Some(plan) = &self.general else {
            return Vec::new();
        };
        if class >= plan.classes().len() {
            return Vec::new();
        }
        let first = self.segments[0].ptr.as_ptr() as u64 + plan.class_offset(class) as u64;
        let mut v = vec![first];
        if let Some(g) = &self.growth.general {
            v.extend(g.classes[class].extra.iter().map(|s| s.ptr.as_ptr() as u64));
        }
        v
    }

    /// The policy over every class of a growable general heap (see
    /// [`after_launch`](Self::after_launch)).
    pub(super) fn after_launch_general(&mut self, started: Instant) -> Result<GrowthReport> {
        self.general_growth()?;
        let per = self.class_stats()?;
        let total = per.iter().fold(HeapStats::empty(self.kind), |mut t, s| {
            t.add(s);
            t
        });
        let mut report = GrowthReport {
            fill_before: fill(&total),
            ..GrowthReport::default()
        };
        let policy = self.growth.policy;
        for (c, s) in per.iter().enumerate() {
            let failures = self.growth.class_failures(c, s.failed_allocs);
            let need = policy_need(&policy, s, failures);
            self.grow_class(c, need, &mut report)?;
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Trim of a growable general heap: per class, the empty segments at the end of its chain
    /// (so that each class's mapped part stays one run from its stride's start).
    pub(super) fn trim_general(&mut self, started: Instant) -> Result<TrimReport> {
        let mut report = TrimReport::default();
        let n = self.general_growth()?.classes.len();
        let mut removed: Vec<(usize, Vec<(Segment, HeapStats)>)> = Vec::new();
        for c in 0..n {
            let mut gone = Vec::new();
            loop {
                let last = self.growth.general.as_ref();
                let Some(last) = last.and_then(|g| g.classes[c].extra.last()) else {
                    break;
                };
                let s = self.segment_stat(last)?;
                if s.in_use != 0 {
                    break;
                }
                let seg = self.general_growth()?.classes[c].extra.pop();
                gone.extend(seg.map(|seg| (seg, s)));
            }
            if gone.is_empty() {
                continue;
            }
            // The newest segment left heads the chain again.
            let head = *self.class_segment_ptrs(c).last().unwrap_or(&0);
            self.set_class_head(c, head)?;
            removed.push((c, gone));
        }
        // Wait for the unlinks before unmapping.
        self.stream.synchronize()?;
        let mut retired = self
            .growth
            .retired()
            .unwrap_or_else(|| HeapStats::empty(self.kind));
        let g = self.general_growth()?;
        g.device.synchronize()?;
        for (_, gone) in removed {
            for (seg, mut s) in gone {
                let off = (seg.ptr.as_ptr() as usize) - g.range.base();
                // SAFETY: the segment is unlinked (the stream reached the new `next`), holds no
                // allocation, and the device is idle.
                let len = unsafe { g.range.unmap(off) }?;
                report.segments_removed += 1;
                report.capacity_removed += s.capacity;
                report.bytes_returned += len;
                report.bytes_unmapped += len;
                (s.capacity, s.in_use) = (0, 0);
                retired.add(&s);
            }
        }
        self.growth.set_retired(retired);
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Statistics of one class (its whole chain).
    pub(super) fn class_stat(&self, class: usize) -> Result<HeapStats> {
        let plan = self.plan()?;
        let k = plan.classes().get(class).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "class {class} of a general heap of {} classes",
                plan.classes().len()
            ))
        })?;
        let base = self.segments[0].ptr.as_ptr() as u64;
        let off = plan.class_offset(class);
        let h = plan.class_handle(class, base, self.flags);
        let mut prefix = vec![0u8; k.layout.stats_len(h.flags)];
        // The class segment lies inside the region, `off` bytes from its base.
        let at = NonNull::new(self.segments[0].ptr.as_ptr().wrapping_add(off))
            .unwrap_or(self.segments[0].ptr);
        self.copy_out(at, &mut prefix)?;
        let kind = HeapKind::Slab {
            block_size: k.block_size,
        };
        let mut s = HeapStats::parse(kind, &h, &k.layout, &prefix);
        if let Some(g) = &self.growth.general {
            for seg in &g.classes[class].extra {
                s.add(&self.segment_stat(seg)?);
            }
        }
        Ok(s)
    }

    /// Capacity of the segments after the first of every class (0 unless growable).
    pub(super) fn general_extra_capacity(&self) -> u64 {
        self.growth.general.as_ref().map_or(0, |g| {
            g.classes
                .iter()
                .flat_map(|c| &c.extra)
                .map(|s| s.handle.capacity)
                .sum()
        })
    }

    /// Physical bytes a growable general heap holds.
    pub(super) fn general_mapped(&self) -> Option<usize> {
        self.growth.general.as_ref().map(|g| g.range.held())
    }

    fn plan(&self) -> Result<&GeneralPlan> {
        self.general
            .as_deref()
            .ok_or_else(|| Error::Unsupported("not a general heap".to_string()))
    }

    fn general_growth(&mut self) -> Result<&mut GeneralGrowth> {
        self.growth.general.as_deref_mut().ok_or_else(|| {
            Error::Unsupported(
                "this general heap does not grow: make it with DeviceHeap::growable".to_string(),
            )
        })
    }

    fn class_block_size(&mut self, class: usize) -> Result<u64> {
        self.general_growth()?;
        let plan = self.plan()?;
        plan.classes()
            .get(class)
            .map(|k| k.block_size)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "class {class} of a general heap of {} classes",
                    plan.classes().len()
                ))
            })
    }

    /// Appends segments holding at least `need` more blocks to class `c`.
    fn grow_class(&mut self, c: usize, need: u64, report: &mut GrowthReport) -> Result<()> {
        let block_size = self.class_block_size(c)?;
        let kind = HeapKind::Slab { block_size };
        let flags = self.flags;
        let step = self.growth.policy.step;
        let max = self.growth.max_bytes.unwrap_or(usize::MAX);
        let chunk = self.growth.chunk;
        let mut left = need;
        while left > 0 {
            let total = self.class_stat_capacity(c);
            let g = self.general_growth()?;
            let end = g.class_end(c);
            let room = max
                .saturating_sub(g.range.held())
                .min(g.stride.saturating_sub(end));
            let want = segment_capacity(total, left, step);
            let cap = plan_segment(kind, flags, want, left, chunk, Some(room))?;
            let len = raw_bytes(kind, flags, cap)?.next_multiple_of(chunk);
            let off = g.class_off(c, end);
            g.range.map(off, len)?;
            let at = (g.range.base() + off) as u64;
            let head = *self.class_segment_ptrs(c).last().unwrap_or(&0);
            if let Err(e) = self.format_class_segment(c, at, len, cap, block_size, head) {
                // Nothing links to it unless the link was written, which is the last step.
                let r = self.stream.synchronize().and_then(|()| {
                    let g = self.general_growth()?;
                    // SAFETY: mapped above, never linked; the stream finished with it.
                    unsafe { g.range.unmap(off) }.map(drop)
                });
                crate::deferred::record("DeviceHeap: undoing a class segment", r);
                return Err(e);
            }
            report.segments_added += 1;
            report.capacity_added += cap;
            report.bytes_added += len;
            left = left.saturating_sub(cap);
        }
        Ok(())
    }

    fn class_stat_capacity(&self, c: usize) -> u64 {
        let first = self.general.as_ref().map_or(0, |p| p.classes()[c].capacity);
        first
            + self.growth.general.as_ref().map_or(0, |g| {
                g.classes[c].extra.iter().map(|s| s.handle.capacity).sum()
            })
    }

    /// Points the header's class `c` at the segment at `head` (between launches).
    fn set_class_head(&mut self, c: usize, head: u64) -> Result<()> {
        let at = self.device_ptr()
            + (std::mem::offset_of!(layout::GeneralHeader, classes) + 8 * c) as u64;
        let head = [head];
        copy_in(&self.stream, at, bytemuck::cast_slice(&head))?;
        // `head` lives on our stack.
        self.stream.synchronize()
    }

    /// The class pointer the device holds for class `c`.
    pub(super) fn device_class_head(&self, c: usize) -> Result<u64> {
        let at = self.device_ptr()
            + (std::mem::offset_of!(layout::GeneralHeader, classes) + 8 * c) as u64;
        let mut out = [0u8; 8];
        let ptr = NonNull::new(at as *mut u8)
            .ok_or_else(|| Error::InvalidArgument("a header at address 0".to_string()))?;
        self.copy_out(ptr, &mut out)?;
        Ok(u64::from_le_bytes(out))
    }

    /// Formats a slab segment of `cap` blocks at `at` (`len` bytes mapped) whose `next` is the
    /// class's head, at `head`, and makes it the head.
    fn format_class_segment(
        &mut self,
        c: usize,
        at: u64,
        len: usize,
        cap: u64,
        block_size: u64,
        head: u64,
    ) -> Result<()> {
        // A class's segments all take runs at their shards' cursors (`carve_malloc`'s slabs).
        let flags = self.flags | layout::FLAG_CURSOR_SHARDS;
        let (mut handle, region) = slab_plan(cap, block_size, flags)?;
        relocate(&mut handle, &region, at);
        handle.next = head;
        let ptr = NonNull::new(at as *mut u8)
            .ok_or_else(|| Error::InvalidArgument("a segment at address 0".to_string()))?;
        let seg = Segment {
            ptr,
            raw: ptr,
            raw_len: len,
            layout: region,
            handle,
        };
        self.format(&seg)?;
        // The segment is whole on the device before the header points at it.
        self.set_class_head(c, at)?;
        self.general_growth()?.classes[c].extra.push(seg);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    #[test]
    fn strides_hold_the_maximum_and_classes_start_on_chunks() {
        let (first, stride) = general_sizes(1, 1 << 30, 2 * MIB).unwrap();
        assert_eq!((first, stride), (2 * MIB, 1 << 30));
        let (first, stride) = general_sizes(3 * MIB as u64, 1000 * MIB, 2 * MIB).unwrap();
        assert_eq!((first, stride), (4 * MIB, 1024 * MIB));
        let plan = spread_plan(first, stride).unwrap();
        assert_eq!(plan.stride_log2, 30);
        for (c, k) in plan.classes().iter().enumerate() {
            // Every class's first segment fits its chunks, and starts `stride` after the last.
            assert!(k.layout.total <= first, "class {c}");
            assert_eq!(
                plan.class_offset(c),
                layout::GENERAL_CLASSES_OFFSET + c * stride
            );
        }
        // The header chunk and 44 first segments must fit the maximum.
        assert!(matches!(
            general_sizes(1, 50 * MIB, 2 * MIB),
            Err(Error::OutOfMemory { .. })
        ));
        assert!(matches!(
            general_sizes(1, usize::MAX, 2 * MIB),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            general_sizes(u64::MAX, 1 << 30, 2 * MIB),
            Err(Error::InvalidArgument(_))
        ));
    }
}
