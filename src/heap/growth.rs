//! What heap growth is told and reports ([`GrowOptions`], [`GrowthPolicy`], [`GrowthReport`],
//! [`TrimReport`]), the state a heap keeps for it ([`Growth`]), and its planning (segment sizes,
//! the policy's need, which segments trim unlinks and how the chain is relinked) as pure
//! functions, tested without a GPU. The operations are in `growable.rs` and
//! `general_growth.rs`; the model is in the `heap` module's documentation ("Growth").

use std::fmt;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use carve_kernels::heap_layout::HeapHandle;

use super::general_range::GeneralGrowth;
use super::region::{bump_plan, raw_len_of, slab_plan, HeapKind};
use super::stats::HeapStats;
use crate::error::{Error, Result};
use crate::resource::{PhysicalBacking, VirtualMemoryResource, VirtualStats};
use crate::sync::lock;

pub(super) const NAME: &str = "DeviceHeap";

/// When [`DeviceHeap::after_launch`](crate::DeviceHeap::after_launch) grows a heap.
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
    pub(super) fn check(&self) -> Result<()> {
        if !(self.watermark > 0.0 && self.watermark <= 1.0) {
            return Err(Error::InvalidArgument(format!(
                "growth watermark {} is not in (0, 1]",
                self.watermark
            )));
        }
        Ok(())
    }
}

/// How [`DeviceHeap::growable`](crate::DeviceHeap::growable) sizes a heap.
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
    /// What [`DeviceHeap::after_launch`](crate::DeviceHeap::after_launch) does.
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

/// What a growth did ([`DeviceHeap::ensure_free`](crate::DeviceHeap::ensure_free),
/// [`DeviceHeap::after_launch`](crate::DeviceHeap::after_launch)).
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

/// What [`DeviceHeap::trim`](crate::DeviceHeap::trim) did.
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
pub(super) trait Mapped: Send + Sync + fmt::Debug {
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
    pub(super) vmm: Option<Box<dyn Mapped>>,
    /// A growable general heap's mapped range and class chains.
    pub(super) general: Option<Box<GeneralGrowth>>,
    /// Behind a lock because [`DeviceHeap::reset`](crate::DeviceHeap::reset) (`&self`) restarts
    /// them.
    pub(super) seen: Mutex<Seen>,
}

/// Counters the host keeps across launches.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// Failed allocations the last
    /// [`DeviceHeap::after_launch`](crate::DeviceHeap::after_launch) saw.
    pub(super) failed: u64,
    /// Counters and peaks of segments trim removed (capacity and use 0).
    retired: Option<HeapStats>,
    /// Per class of a growable general heap, the failed allocations the last
    /// [`DeviceHeap::after_launch`](crate::DeviceHeap::after_launch) saw.
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
        let mut seen = self.seen();
        if seen.class_failed.len() <= c {
            seen.class_failed.resize(c + 1, 0);
        }
        let new = failed.saturating_sub(seen.class_failed[c]);
        seen.class_failed[c] = failed;
        new
    }

    /// Replaces the counters of removed segments.
    pub(super) fn set_retired(&self, retired: HeapStats) {
        self.seen().retired = Some(retired);
    }

    pub(super) fn seen(&self) -> MutexGuard<'_, Seen> {
        lock(&self.seen)
    }

    /// Forgets the counters: the heap's statistics restarted.
    pub(super) fn reset(&self) {
        *self.seen() = Seen::default();
    }

    /// Counters and peaks of the segments trim removed.
    pub(super) fn retired(&self) -> Option<HeapStats> {
        self.seen().retired
    }

    /// Device bytes a segment whose resource block is `raw_len` bytes takes.
    pub(super) fn footprint(&self, raw_len: usize) -> usize {
        raw_len.next_multiple_of(self.chunk)
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
pub(super) fn units_for_bytes(kind: HeapKind, bytes: u64) -> Result<u64> {
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
pub(super) fn trim_plan(in_use: &[u64]) -> Vec<usize> {
    (1..in_use.len()).filter(|&i| in_use[i] == 0).collect()
}

/// The `next` rewrites that unlink `remove` (ascending, never 0) from the chain of segments at
/// `ptrs`: (kept segment, its new next), only where it changes.
pub(super) fn relink(ptrs: &[u64], remove: &[usize]) -> Vec<(usize, u64)> {
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
