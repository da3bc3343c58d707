//! Heaps that grow between launches: [`DeviceHeap::growable`], [`DeviceHeap::ensure_free`],
//! [`DeviceHeap::after_launch`] (a [`GrowthPolicy`]) and [`DeviceHeap::trim`]. The model is in
//! the `heap` module's documentation ("Growth"). The planning (segment sizes, the policy's need,
//! which segments trim unlinks and how the chain is relinked) is pure functions, tested without
//! a GPU.

use std::fmt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use carve_kernels::heap_layout::{self as layout, HeapHandle};

use super::general_growth::GeneralGrowth;
use super::{bump_plan, copy_in, raw_len_of, slab_plan, DeviceHeap, HeapKind, HeapStats};
use crate::driver::Stream;
use crate::error::{Error, Result};
use crate::resource::{
    CudaBackingOptions, PhysicalBacking, SharedResource, VirtualMemoryResource, VirtualOptions,
    VirtualStats, DEFAULT_ALIGNMENT,
};
use crate::sync::lock;

const NAME: &str = "DeviceHeap";

/// When [`DeviceHeap::after_launch`] grows a heap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowthPolicy {
    /// Fill fraction (`in_use / capacity`, in `(0, 1]`) above which the heap grows; it grows
    /// until the fill is at most this again. A slab also grows after a launch whose allocations
    /// failed, by at least the blocks that failed.
    pub watermark: f64,
    /// The least capacity a growth adds, in blocks (slab) or bytes (bump); 0: no floor. Every
    /// new segment also holds at least the heap's capacity so far (doubling).
    pub step: u64,
}

impl Default for GrowthPolicy {
    /// Grow past 75 % full, doubling.
    fn default() -> Self {
        GrowthPolicy {
            watermark: 0.75,
            step: 0,
        }
    }
}

impl GrowthPolicy {
    fn check(&self) -> Result<()> {
        if !(self.watermark > 0.0 && self.watermark <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "growth watermark {} is not in (0, 1]",
                self.watermark
            )));
        }
        Ok(())
    }
}

/// How [`DeviceHeap::growable`] sizes a heap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GrowOptions {
    /// The most device memory the heap's segments may take, metadata and chunk rounding
    /// included. Address space for it is reserved once, when the heap is made.
    pub max_bytes: usize,
    /// The first segment's capacity in blocks (slab) or bytes (bump), rounded up so that the
    /// segment fills its physical chunks.
    pub initial: u64,
    /// Bytes per physical chunk, a power-of-two multiple of the driver's granularity; `None`:
    /// the granularity (2 MiB on current GPUs). Every segment takes whole chunks.
    pub chunk_size: Option<usize>,
    /// What [`DeviceHeap::after_launch`] does.
    pub policy: GrowthPolicy,
}

impl GrowOptions {
    /// At most `max_bytes` of device memory, starting with `initial` blocks or bytes, growing by
    /// the default policy.
    pub fn new(max_bytes: usize, initial: u64) -> Self {
        GrowOptions {
            max_bytes,
            initial,
            chunk_size: None,
            policy: GrowthPolicy::default(),
        }
    }
}

/// What a growth did ([`DeviceHeap::ensure_free`], [`DeviceHeap::after_launch`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GrowthReport {
    /// Segments appended.
    pub segments_added: usize,
    /// Capacity added: blocks (slab) or bytes (bump).
    pub capacity_added: u64,
    /// Device bytes the new segments took (metadata and chunk rounding included).
    pub bytes_added: usize,
    /// The fill (`in_use / capacity`) the decision read.
    pub fill_before: f64,
    /// Host time of the whole call: reading the statistics, and reserving, mapping, formatting
    /// and linking the segments.
    pub elapsed: Duration,
}

/// What [`DeviceHeap::trim`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TrimReport {
    /// Segments unlinked and given back.
    pub segments_removed: usize,
    /// Their capacity: blocks (slab) or bytes (bump).
    pub capacity_removed: u64,
    /// Device bytes given back to the resource.
    pub bytes_returned: usize,
    /// Physical bytes unmapped (growable heaps; 0 over a plain resource).
    pub bytes_unmapped: usize,
    /// Host time of the whole call.
    pub elapsed: Duration,
}

/// The virtual range a growable heap's segments come from, whatever its backing.
trait Mapped: Send + Sync + fmt::Debug {
    fn trim(&self) -> Result<usize>;
    fn stats(&self) -> VirtualStats;
}

impl<B: PhysicalBacking> Mapped for VirtualMemoryResource<B> {
    fn trim(&self) -> Result<usize> {
        VirtualMemoryResource::trim(self)
    }
    fn stats(&self) -> VirtualStats {
        VirtualMemoryResource::stats(self)
    }
}

/// A heap's growth state.
#[derive(Debug)]
pub(super) struct Growth {
    pub(super) policy: GrowthPolicy,
    /// Bound on the device bytes of all segments; `None`: the resource's own.
    pub(super) max_bytes: Option<usize>,
    /// Segments take whole chunks of this many bytes (1 over a plain resource).
    pub(super) chunk: usize,
    vmm: Option<Box<dyn Mapped>>,
    /// A growable general heap's mapped range and class chains.
    pub(super) general: Option<Box<GeneralGrowth>>,
    /// Behind a lock because [`DeviceHeap::reset`] (`&self`) restarts them.
    seen: Mutex<Seen>,
}

/// Counters the host keeps across launches.
#[derive(Debug, Default)]
struct Seen {
    /// Failed allocations the last [`DeviceHeap::after_launch`] saw.
    failed: u64,
    /// Counters and peaks of segments trim removed (capacity and use 0).
    retired: Option<HeapStats>,
    /// Per class of a growable general heap, the failed allocations the last
    /// [`DeviceHeap::after_launch`] saw.
    class_failed: Vec<u64>,
}

impl Growth {
    /// A heap over a plain resource: no bound, no chunks.
    pub(super) fn plain() -> Self {
        Growth {
            policy: GrowthPolicy::default(),
            max_bytes: None,
            chunk: 1,
            vmm: None,
            general: None,
            seen: Mutex::default(),
        }
    }

    /// New failures of class `c` since the last call (remembering the count).
    pub(super) fn class_failures(&self, c: usize, failed: u64) -> u64 {
        let mut seen = lock(&self.seen);
        if seen.class_failed.len() <= c {
            seen.class_failed.resize(c + 1, 0);
        }
        let new = failed.saturating_sub(seen.class_failed[c]);
        seen.class_failed[c] = failed;
        new
    }

    /// Replaces the counters of removed segments.
    pub(super) fn set_retired(&self, retired: HeapStats) {
        lock(&self.seen).retired = Some(retired);
    }

    /// Forgets the counters: the heap's statistics restarted.
    pub(super) fn reset(&self) {
        *lock(&self.seen) = Seen::default();
    }

    /// Counters and peaks of the segments trim removed.
    pub(super) fn retired(&self) -> Option<HeapStats> {
        lock(&self.seen).retired
    }

    /// Device bytes a segment whose resource block is `raw_len` bytes takes.
    pub(super) fn footprint(&self, raw_len: usize) -> usize {
        raw_len.next_multiple_of(self.chunk)
    }
}

impl DeviceHeap {
    /// A slab or bump heap that grows: its segments come from a [`VirtualMemoryResource`] on
    /// the stream's device that reserves address space for `options.max_bytes` once and maps
    /// physical chunks as segments are added ([`ensure_free`](Self::ensure_free),
    /// [`after_launch`](Self::after_launch), [`grow`](Self::grow)) and unmaps them on
    /// [`trim`](Self::trim). Addresses never move. A slab's frees are checked, as for
    /// [`DeviceHeap::slab`].
    ///
    /// A [`HeapKind::General`] heap grows class by class
    /// ([`ensure_free_class`](Self::ensure_free_class), or the policy applied to each class): it
    /// reserves one chunk and, per size class, a stride of address space as large as
    /// `max_bytes` (rounded up to a power of two; address space only, 44 classes × stride in
    /// all), maps one chunk for its header and `bytes_per_class` (rounded up to a power of two,
    /// at least one chunk) for each class's first segment, and grows a class by mapping a slab
    /// segment inside its stride, so that the kernels' `(ptr - base) >> stride_log2` still finds
    /// the class. `options.initial` is ignored for it; its [`HeapKind`] reports the first
    /// segment's bytes per class.
    pub fn growable(kind: HeapKind, stream: &Stream, options: GrowOptions) -> Result<Self> {
        if let HeapKind::General { bytes_per_class } = kind {
            return Self::growable_general(bytes_per_class, stream, options);
        }
        check_options(kind, &options)?;
        let mut virt = VirtualOptions::new().maximum(options.max_bytes);
        if let Some(c) = options.chunk_size {
            virt = virt.chunk_size(c);
        }
        let vmm =
            VirtualMemoryResource::on_device(stream.device(), CudaBackingOptions::default(), virt)?;
        Self::growable_in(vmm, kind, stream, options)
    }

    /// As [`growable`](Self::growable), with segments from `vmm` (any backing that maps
    /// device-accessible memory; a resource in whole-chunk mode, [`VirtualOptions::new`], so
    /// that a freed segment leaves its chunks free). The heap should be `vmm`'s only client:
    /// [`trim`](Self::trim) trims all of it. `options.chunk_size` is ignored (the resource's
    /// chunk size counts).
    pub fn growable_in<B: PhysicalBacking>(
        vmm: VirtualMemoryResource<B>,
        kind: HeapKind,
        stream: &Stream,
        options: GrowOptions,
    ) -> Result<Self> {
        check_options(kind, &options)?;
        let chunk = vmm.stats().chunk_size;
        let flags = match kind {
            HeapKind::Slab { .. } => layout::FLAG_CHECKED_FREES,
            _ => 0,
        };
        let growth = Growth {
            policy: options.policy,
            max_bytes: Some(options.max_bytes),
            chunk,
            vmm: Some(Box::new(vmm.clone())),
            general: None,
            seen: Mutex::default(),
        };
        let resource: SharedResource = std::sync::Arc::new(vmm);
        let mut heap = DeviceHeap {
            kind,
            flags,
            resource: Some(resource),
            stream: stream.clone(),
            segments: Vec::new(),
            general: None,
            growth,
        };
        heap.check_resource()?;
        let first = plan_segment(
            kind,
            flags,
            options.initial,
            options.initial,
            chunk,
            Some(options.max_bytes),
        )?;
        heap.push_segment(first)?;
        Ok(heap)
    }

    /// Grows the heap, between launches, until at least `bytes` are free: `bytes / block_size`
    /// blocks rounded up (slab), or `bytes` (bump; free bytes summed over segments, so a
    /// request larger than the last segment's room may still fail). Reads the statistics
    /// first; adds nothing when enough is free. Errors: [`Error::ZeroSize`] for 0,
    /// [`Error::OutOfMemory`] when the maximum (or the resource) cannot hold it — segments
    /// added before a failure stay — and [`Error::Unsupported`] for a general heap (see
    /// [`ensure_free_class`](Self::ensure_free_class)).
    pub fn ensure_free(&mut self, bytes: u64) -> Result<GrowthReport> {
        let started = Instant::now();
        self.check_growable()?;
        let want = units_for_bytes(self.kind, bytes)?;
        let s = self.stats()?;
        let need = want.saturating_sub(s.capacity.saturating_sub(s.in_use));
        self.grow_by(need, fill(&s), started)
    }

    /// Applies the heap's [`GrowthPolicy`] between launches: reads the statistics and grows when
    /// the fill is above the watermark (or, for a slab, when allocations failed since the last
    /// call). A growable general heap applies it to each size class on its own (class fill and
    /// class failures). Returns what it did ([`GrowthReport::segments_added`] 0: nothing).
    /// [`Error::Unsupported`] for a general heap that does not grow.
    pub fn after_launch(&mut self) -> Result<GrowthReport> {
        let started = Instant::now();
        if self.general.is_some() {
            return self.after_launch_general(started);
        }
        let s = self.stats()?;
        let failures = {
            let mut seen = lock(&self.growth.seen);
            let new = s.failed_allocs.saturating_sub(seen.failed);
            seen.failed = s.failed_allocs;
            new
        };
        let slab = matches!(self.kind, HeapKind::Slab { .. });
        let need = policy_need(&self.growth.policy, &s, if slab { failures } else { 0 });
        self.grow_by(need, fill(&s), started)
    }

    /// The policy [`after_launch`](Self::after_launch) applies.
    pub fn growth_policy(&self) -> GrowthPolicy {
        self.growth.policy
    }

    /// Sets the policy [`after_launch`](Self::after_launch) applies; a watermark outside
    /// `(0, 1]` is an [`Error::InvalidArgument`].
    pub fn set_growth_policy(&mut self, policy: GrowthPolicy) -> Result<()> {
        policy.check()?;
        self.growth.policy = policy;
        Ok(())
    }

    /// The bound on the device bytes of the heap's segments (`None` over a plain resource).
    pub fn max_bytes(&self) -> Option<usize> {
        self.growth.max_bytes
    }

    /// Device bytes the segments take now (metadata, alignment slack and chunk rounding
    /// included; a growable general heap: the bytes it maps).
    pub fn device_bytes(&self) -> usize {
        if let Some(mapped) = self.general_mapped() {
            return mapped;
        }
        self.segments
            .iter()
            .map(|s| self.growth.footprint(s.raw_len))
            .sum()
    }

    /// The segments' device addresses (their handles), in chain order; the first is
    /// [`device_ptr`](Self::device_ptr).
    pub fn segment_ptrs(&self) -> Vec<u64> {
        self.segments
            .iter()
            .map(|s| s.ptr.as_ptr() as u64)
            .collect()
    }

    /// The virtual range of a growable heap (mapped bytes, chunks created and released);
    /// `None` over a plain resource.
    pub fn virtual_stats(&self) -> Option<VirtualStats> {
        self.growth.vmm.as_ref().map(|v| v.stats())
    }

    /// The statistics of each segment, in chain order (one copy each; a general heap: its one
    /// region). Counters of segments [`trim`](Self::trim) removed are in
    /// [`stats`](Self::stats) only.
    pub fn segment_stats(&self) -> Result<Vec<HeapStats>> {
        if self.general.is_some() {
            return Ok(vec![self.stats()?]);
        }
        self.segments.iter().map(|s| self.segment_stat(s)).collect()
    }

    /// Between launches, unlinks every segment but the first that holds no allocation (slab:
    /// no block in use; bump: nothing allocated since the last [`reset`](Self::reset)) and gives
    /// its memory back; a growable heap then unmaps the chunks left free. Addresses of live
    /// blocks never change. The removed segments' failure and double-free counts and peaks stay
    /// in [`stats`](Self::stats). A growable general heap removes, per class, the empty segments
    /// at the end of the class's chain and unmaps them; [`Error::Unsupported`] for a general heap
    /// that does not grow.
    pub fn trim(&mut self) -> Result<TrimReport> {
        let started = Instant::now();
        if self.general.is_some() {
            return self.trim_general(started);
        }
        let per = self.segment_stats()?;
        let in_use: Vec<u64> = per.iter().map(|s| s.in_use).collect();
        let remove = trim_plan(&in_use);
        let mut report = TrimReport::default();
        if !remove.is_empty() {
            let ptrs = self.segment_ptrs();
            let links = relink(&ptrs, &remove);
            let values: Vec<[u64; 1]> = links.iter().map(|&(_, next)| [next]).collect();
            for (&(i, _), v) in links.iter().zip(&values) {
                let at = next_field(self.segments[i].ptr.as_ptr() as u64);
                copy_in(&self.stream, at, bytemuck::bytes_of(v))?;
            }
            // The new links live in `values`: wait before they go, and before the memory does.
            self.stream.synchronize()?;
            for &(i, next) in &links {
                self.segments[i].handle.next = next;
            }
            let mut retired = self
                .growth
                .retired()
                .unwrap_or_else(|| HeapStats::empty(self.kind));
            for &i in remove.iter().rev() {
                let seg = self.segments.remove(i);
                let mut s = per[i];
                report.capacity_removed += s.capacity;
                report.bytes_returned += self.growth.footprint(seg.raw_len);
                report.segments_removed += 1;
                (s.capacity, s.in_use) = (0, 0);
                retired.add(&s);
                // SAFETY: the region came from this resource with these arguments, once; it is
                // unlinked (the stream reached the new links) and holds no allocation.
                let r = unsafe {
                    self.resource()?.deallocate(
                        self.stream.as_ref(),
                        seg.raw,
                        seg.raw_len,
                        DEFAULT_ALIGNMENT,
                    )
                };
                crate::deferred::record("DeviceHeap trim: returning a segment", r);
            }
            self.growth.set_retired(retired);
        }
        if let Some(vmm) = &self.growth.vmm {
            report.bytes_unmapped = vmm.trim()?;
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Reads every segment's handle back from the device (one copy each, waiting for the
    /// heap's stream) and checks the chain against the host's: the handles are the ones the host
    /// wrote, each `next` names the following segment and the last is 0; a growable general
    /// heap's class chains lie inside their strides; the device bytes are within the maximum.
    /// Between launches only.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        if let Some(max) = self.growth.max_bytes {
            if self.device_bytes() > max {
                return Err(format!(
                    "{} device bytes past the maximum {max}",
                    self.device_bytes()
                ));
            }
        }
        let chains: Vec<Vec<(u64, HeapHandle)>> = if let Some(plan) = &self.general {
            let base = self.device_ptr();
            (0..plan.classes().len())
                .map(|c| {
                    let first = plan.class_handle(c, base, self.flags);
                    let extra = self.growth.general.as_ref().map(|g| &g.classes[c].extra);
                    let extra: Vec<(u64, HeapHandle)> = extra
                        .into_iter()
                        .flatten()
                        .map(|s| (s.ptr.as_ptr() as u64, s.handle))
                        .collect();
                    let mut v = vec![(base + plan.class_offset(c) as u64, first)];
                    v.extend(extra);
                    v
                })
                .collect()
        } else {
            vec![self
                .segments
                .iter()
                .map(|s| (s.ptr.as_ptr() as u64, s.handle))
                .collect()]
        };
        for (c, chain) in chains.iter().enumerate() {
            if let (Some(plan), Some(&(start, _))) = (&self.general, chain.first()) {
                let end = start + (1u64 << plan.stride_log2);
                if chain.iter().any(|&(p, _)| !(start..end).contains(&p)) {
                    return Err(format!("class {c}: a segment outside the class's stride"));
                }
            }
            // A general class's chain runs newest first (address order backwards) from the
            // header's class pointer; a slab or bump heap's runs in address order.
            let general = self.general.is_some();
            if general {
                let head = chain.last().map_or(0, |s| s.0);
                let dev = self.device_class_head(c).map_err(|e| e.to_string())?;
                if dev != head {
                    return Err(format!(
                        "class {c}: the header points at {dev:#x}, not {head:#x}"
                    ));
                }
            }
            for (i, (at, host)) in chain.iter().enumerate() {
                let want = if general {
                    i.checked_sub(1).map_or(0, |j| chain[j].0)
                } else {
                    chain.get(i + 1).map_or(0, |s| s.0)
                };
                if host.next != want {
                    return Err(format!(
                        "chain {c}, segment {i} at {at:#x}: host next {:#x}, expected {want:#x}",
                        host.next
                    ));
                }
                let mut dev = [0u8; std::mem::size_of::<HeapHandle>()];
                let ptr = std::ptr::NonNull::new(*at as *mut u8)
                    .ok_or_else(|| format!("chain {c}, segment {i} at address 0"))?;
                self.copy_out(ptr, &mut dev).map_err(|e| e.to_string())?;
                if dev[..] != *bytemuck::bytes_of(host) {
                    let d: HeapHandle = bytemuck::pod_read_unaligned(&dev);
                    return Err(format!(
                        "chain {c}, segment {i} at {at:#x}: the device holds {d:?}, the host \
                         wrote {host:?}"
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_growable(&self) -> Result<()> {
        if self.general.is_some() {
            return Err(Error::Unsupported(
                "a general heap grows class by class: ensure_free_class".to_string(),
            ));
        }
        Ok(())
    }

    /// Appends segments holding at least `need` more blocks or bytes.
    fn grow_by(&mut self, need: u64, fill_before: f64, started: Instant) -> Result<GrowthReport> {
        let mut report = GrowthReport {
            fill_before,
            ..GrowthReport::default()
        };
        let mut left = need;
        while left > 0 {
            let want = segment_capacity(self.capacity(), left, self.growth.policy.step);
            let room = self
                .growth
                .max_bytes
                .map(|m| m.saturating_sub(self.device_bytes()));
            let cap = plan_segment(self.kind, self.flags, want, left, self.growth.chunk, room)?;
            let before = self.device_bytes();
            self.push_segment(cap)?;
            report.segments_added += 1;
            report.capacity_added += cap;
            report.bytes_added += self.device_bytes() - before;
            left = left.saturating_sub(cap);
        }
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Refuses a segment of `raw_len` bytes past the maximum.
    pub(super) fn check_budget(&self, raw_len: usize) -> Result<()> {
        let Some(max) = self.growth.max_bytes else {
            return Ok(());
        };
        let used = self.device_bytes();
        let add = self.growth.footprint(raw_len);
        if used.checked_add(add).is_some_and(|t| t <= max) {
            return Ok(());
        }
        Err(Error::OutOfMemory {
            bytes: add,
            resource: NAME,
            detail: format!(
                "a segment of {add} bytes past the heap's maximum: {used} of {max} bytes in use"
            ),
        })
    }
}

pub(super) fn check_options(kind: HeapKind, o: &GrowOptions) -> Result<()> {
    if matches!(kind, HeapKind::General { .. }) {
        return Err(Error::Unsupported(
            "a general heap does not grow yet".to_string(),
        ));
    }
    if o.max_bytes == 0 || o.initial == 0 {
        return Err(Error::ZeroSize);
    }
    o.policy.check()
}

/// Device address of a segment handle's `next`, for the segment at `base`.
pub(super) fn next_field(base: u64) -> u64 {
    base + std::mem::offset_of!(HeapHandle, next) as u64
}

pub(super) fn fill(s: &HeapStats) -> f64 {
    if s.capacity == 0 {
        return 1.0;
    }
    s.in_use as f64 / s.capacity as f64
}

/// Blocks (slab) or bytes (bump) that `bytes` free bytes need.
fn units_for_bytes(kind: HeapKind, bytes: u64) -> Result<u64> {
    if bytes == 0 {
        return Err(Error::ZeroSize);
    }
    match kind {
        HeapKind::Slab { block_size } => Ok(bytes.div_ceil(block_size)),
        HeapKind::Bump => Ok(bytes),
        HeapKind::General { .. } => Err(Error::Unsupported(
            "a general heap does not grow yet".to_string(),
        )),
    }
}

/// Capacity the policy adds after a launch that left `s`, with `failures` failed block
/// requests (slab; 0 for bump, whose failures include refused requests): enough that the fill,
/// counting the failed requests as wanted, is at most the watermark again.
pub(super) fn policy_need(p: &GrowthPolicy, s: &HeapStats, failures: u64) -> u64 {
    let demand = s.in_use.saturating_add(failures);
    if failures == 0 && (demand as f64) <= p.watermark * s.capacity as f64 {
        return 0;
    }
    // Saturating float-to-int conversion: a huge demand asks for u64::MAX, which no plan fits.
    let target = (demand as f64 / p.watermark).ceil() as u64;
    target.saturating_sub(s.capacity).max(1)
}

/// The capacity of the next segment when the heap holds `total` and needs `need` more: at least
/// `need`, `step`, and `total` (doubling, so chains stay short).
pub(super) fn segment_capacity(total: u64, need: u64, step: u64) -> u64 {
    need.max(step).max(total)
}

/// Bytes of the resource block a segment of `capacity` takes (alignment slack included).
pub(super) fn raw_bytes(kind: HeapKind, flags: u32, capacity: u64) -> Result<usize> {
    let total = match kind {
        HeapKind::Slab { block_size } => slab_plan(capacity, block_size, flags)?.1.total,
        HeapKind::Bump => bump_plan(capacity)?.1.total,
        HeapKind::General { .. } => {
            return Err(Error::Unsupported(
                "a general heap does not grow yet".to_string(),
            ))
        }
    };
    raw_len_of(total, kind)
}

/// The largest capacity from `at_least` (which fits) whose block fits in `bytes`.
fn fit_capacity(kind: HeapKind, flags: u32, at_least: u64, bytes: usize) -> u64 {
    let fits = |c: u64| raw_bytes(kind, flags, c).is_ok_and(|r| r <= bytes);
    let unit = match kind {
        HeapKind::Slab { block_size } => block_size,
        _ => 1,
    };
    let (mut lo, mut hi) = (at_least, (bytes as u64 / unit).saturating_add(1));
    // `lo` always fits; `hi` never does (a unit takes at least `unit` bytes).
    while hi > lo + 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The capacity of a new segment: `want` (or, if that passes `room` bytes, as much as fits and
/// at least `need`), rounded up to fill its chunks. [`Error::OutOfMemory`] when `need` does not
/// fit.
pub(super) fn plan_segment(
    kind: HeapKind,
    flags: u32,
    want: u64,
    need: u64,
    chunk: usize,
    room: Option<usize>,
) -> Result<u64> {
    if need == 0 {
        return Err(Error::ZeroSize);
    }
    let room = room.unwrap_or(usize::MAX);
    let rounded = |c: u64| -> Option<usize> {
        raw_bytes(kind, flags, c)
            .ok()?
            .checked_next_multiple_of(chunk)
    };
    let fill_chunks = |c: u64, bytes: usize| {
        if chunk == 1 {
            c
        } else {
            fit_capacity(kind, flags, c, bytes)
        }
    };
    if let Some(bytes) = rounded(want).filter(|&b| b <= room) {
        return Ok(fill_chunks(want, bytes));
    }
    match rounded(need) {
        Some(bytes) if bytes <= room => {
            let all = room - room % chunk;
            Ok(fill_chunks(need, all))
        }
        Some(bytes) => Err(Error::OutOfMemory {
            bytes,
            resource: NAME,
            detail: format!(
                "a segment for {need} more blocks or bytes takes {bytes} bytes; \
                 {room} bytes are left under the heap's maximum"
            ),
        }),
        None => {
            // The plan itself fails: a typed error for the size.
            raw_bytes(kind, flags, need)?;
            Err(Error::SizeOverflow {
                bytes: usize::MAX,
                align: chunk,
            })
        }
    }
}

/// Segments trim removes, given each one's use: every empty one but the first.
fn trim_plan(in_use: &[u64]) -> Vec<usize> {
    (1..in_use.len()).filter(|&i| in_use[i] == 0).collect()
}

/// The `next` rewrites that unlink `remove` (ascending, never 0) from the chain of segments at
/// `ptrs`: (kept segment, its new next), only where it changes.
fn relink(ptrs: &[u64], remove: &[usize]) -> Vec<(usize, u64)> {
    let keep: Vec<usize> = (0..ptrs.len()).filter(|i| !remove.contains(i)).collect();
    keep.iter()
        .enumerate()
        .filter_map(|(j, &i)| {
            let next = keep.get(j + 1).map_or(0, |&k| ptrs[k]);
            let old = ptrs.get(i + 1).copied().unwrap_or(0);
            (next != old).then_some((i, next))
        })
        .collect()
}

#[cfg(test)]
mod tests;
