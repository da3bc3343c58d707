//! [`ExpandableMemoryResource`]: the expandable pool, two [`VirtualMemoryResource`]s in
//! expandable mode over one backing, as PyTorch keeps small and large segments apart: small
//! requests share small pages, so they never pin a large page; large requests take large pages,
//! so growing costs few driver calls.
//!
//! A move waits for the device and costs an unmap as well as a map, so while the chunks held
//! stay within a *headroom* above the most bytes ever live ([`ExpandableOptions::headroom`],
//! 5 % by default), a page that must be mapped gets a new chunk; past it, free pages move.
//! Training steps repeat, so once the pages a step needs are held, later steps map nothing.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::cuda_backing::{CudaBacking, CudaBackingOptions};
use super::segments::SegmentCallback;
use super::{BackingCounters, CountingBacking, PhysicalBacking, SimulatedBacking};
use super::{VirtualMemoryResource, VirtualOptions, VirtualStats};
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{MemoryResource, Properties};
use crate::stream::StreamRef;
use crate::sync::lock;

/// How an [`ExpandableMemoryResource`] is sized.
#[derive(Clone, Default)]
pub struct ExpandableOptions {
    /// The most physical bytes in chunks at once, both ranges together; `None`: the device's
    /// memory (the simulated capacity).
    pub maximum: Option<usize>,
    /// Requests up to this many bytes go to the small range; `None`: 1 MiB.
    pub small_limit: Option<usize>,
    /// The small range's page: `None`: the granularity (2 MiB on current GPUs).
    pub small_chunk: Option<usize>,
    /// The large range's page: `None`: 16 times the granularity (32 MiB).
    pub large_chunk: Option<usize>,
    /// How streams are ordered (see [`VirtualOptions::order`]).
    pub order: Option<Arc<dyn StreamOrder>>,
    /// How far above the most bytes ever live (as a fraction of them) the chunks held may grow
    /// by creating chunks while free pages could move instead; `None`:
    /// [`ExpandableOptions::DEFAULT_HEADROOM`].
    /// Zero moves a free page whenever one exists: the least memory, the most driver calls.
    pub headroom: Option<f64>,
    /// See [`VirtualOptions::mark_every_free`]; off by default.
    pub mark_every_free: bool,
    /// Told of every chunk either range maps and unmaps (see
    /// [`ExpandableMemoryResource::set_segment_callback`]).
    pub on_segment: Option<SegmentCallback>,
}

impl ExpandableOptions {
    /// [`ExpandableOptions::headroom`]'s default. Creating chunks instead of moving free pages
    /// then never takes what the pool holds past 1.05× the most bytes live; on five PyTorch
    /// training traces, ten passes each, it moved 0 to 7 pages in all.
    pub const DEFAULT_HEADROOM: f64 = 0.05;
}

impl fmt::Debug for ExpandableOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpandableOptions")
            .field("maximum", &self.maximum)
            .field("small_limit", &self.small_limit)
            .field("small_chunk", &self.small_chunk)
            .field("large_chunk", &self.large_chunk)
            .field("headroom", &self.headroom)
            .field("mark_every_free", &self.mark_every_free)
            .field("on_segment", &self.on_segment.is_some())
            .finish_non_exhaustive()
    }
}

/// A snapshot of an [`ExpandableMemoryResource`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpandableStats {
    /// Physical bytes in chunks now, both ranges.
    pub physical: usize,
    /// The most physical bytes in chunks at once: what the pool took from the device.
    pub peak_physical: usize,
    /// The small range.
    pub small: VirtualStats,
    /// The large range.
    pub large: VirtualStats,
    /// The driver calls both ranges made (successful ones), and the physical bytes.
    pub calls: BackingCounters,
}

impl ExpandableStats {
    /// Bytes handed out and not freed, both ranges.
    pub fn bytes_in_use(&self) -> usize {
        self.small.bytes_in_use + self.large.bytes_in_use
    }

    /// Live blocks, both ranges.
    pub fn live_blocks(&self) -> usize {
        self.small.live_blocks + self.large.live_blocks
    }
}

/// One of the two ranges.
type Range<B> = VirtualMemoryResource<Arc<CountingBacking<B>>>;

/// The expandable pool, in the role of PyTorch's expandable segments for any client: two
/// growing ranges ([`VirtualMemoryResource`] in expandable mode) over one backing, small
/// requests (up to 1 MiB) sharing 2 MiB pages and larger ones 32 MiB pages. Free pages anywhere
/// are unmapped and their memory mapped where it is needed, so a large request never fails for
/// lack of a contiguous hole while free memory exists. Cheap to clone.
pub struct ExpandableMemoryResource<B: PhysicalBacking = CudaBacking> {
    backing: Arc<CountingBacking<B>>,
    small: Range<B>,
    large: Range<B>,
    small_limit: usize,
    live: Arc<Live>,
    headroom: f64,
}

/// Requested bytes live now and at most, for the headroom.
#[derive(Debug, Default)]
struct Live {
    bytes: AtomicUsize,
    peak: AtomicUsize,
}

impl<B: PhysicalBacking> Clone for ExpandableMemoryResource<B> {
    fn clone(&self) -> Self {
        ExpandableMemoryResource {
            backing: self.backing.clone(),
            small: self.small.clone(),
            large: self.large.clone(),
            small_limit: self.small_limit,
            live: self.live.clone(),
            headroom: self.headroom,
        }
    }
}

impl ExpandableMemoryResource<CudaBacking> {
    /// The expandable pool on `device`.
    pub fn on_device(
        device: &Device,
        backing: CudaBackingOptions,
        mut options: ExpandableOptions,
    ) -> Result<Self> {
        let backing = CudaBacking::new(device, backing)?;
        super::options::fill_device_defaults(device, &mut options.maximum, &mut options.order)?;
        Self::new(backing, options)
    }
}

impl ExpandableMemoryResource<SimulatedBacking> {
    /// The expandable pool over `capacity` bytes of address-only memory (2 MiB granularity):
    /// no GPU needed; its pointers must never be dereferenced.
    pub fn simulated(capacity: usize, options: ExpandableOptions) -> Result<Self> {
        let backing = SimulatedBacking::new(capacity, 2 << 20)?;
        let options = ExpandableOptions {
            maximum: Some(options.maximum.unwrap_or(capacity).min(backing.capacity())),
            ..options
        };
        Self::new(backing, options)
    }
}

impl<B: PhysicalBacking> ExpandableMemoryResource<B> {
    /// The expandable pool over `backing`; `options.maximum` must be given (the device
    /// constructors fill it in).
    pub fn new(backing: B, options: ExpandableOptions) -> Result<Self> {
        let g = backing.granularity();
        let maximum = options.maximum.ok_or_else(|| {
            Error::InvalidArgument("ExpandableMemoryResource: no maximum size".to_owned())
        })?;
        let headroom = options
            .headroom
            .unwrap_or(ExpandableOptions::DEFAULT_HEADROOM);
        if !(0.0..=1.0).contains(&headroom) {
            return Err(Error::InvalidArgument(format!(
                "ExpandableMemoryResource: headroom {headroom} is not a fraction in [0, 1]"
            )));
        }
        // One order for both ranges: events on the backing's device, unless given.
        let order = match options.order {
            Some(o) => o,
            None => crate::resource::engine::stream_order::order_for(
                backing.properties(),
                backing.device(),
                &backing,
            )?,
        };
        let backing = Arc::new(CountingBacking::new(backing, maximum));
        let range = |chunk: usize| {
            let mut o = VirtualOptions::expandable()
                .chunk_size(chunk)
                .maximum(maximum.max(chunk));
            o.order = Some(order.clone());
            o.mark_every_free = options.mark_every_free;
            o.on_segment = options.on_segment.clone();
            VirtualMemoryResource::new(backing.clone(), o)
        };
        let small = range(options.small_chunk.unwrap_or(g))?;
        let large = range(options.large_chunk.unwrap_or(16 * g))?;
        Ok(ExpandableMemoryResource {
            small,
            large,
            small_limit: options.small_limit.unwrap_or(1 << 20),
            backing,
            live: Arc::default(),
            headroom,
        })
    }

    /// The backing both ranges map from.
    pub fn backing(&self) -> &B {
        self.backing.inner()
    }

    /// The headroom in use ([`ExpandableOptions::headroom`]).
    pub fn headroom(&self) -> f64 {
        self.headroom
    }

    /// Both ranges and the physical memory now.
    pub fn stats(&self) -> ExpandableStats {
        ExpandableStats {
            physical: self.backing.physical(),
            peak_physical: self.backing.peak_physical(),
            small: self.small.stats(),
            large: self.large.stats(),
            calls: self.backing.counters(),
        }
    }

    /// Unmaps and frees every free page of both ranges (see [`VirtualMemoryResource::trim`]).
    pub fn trim(&self) -> Result<usize> {
        Ok(self.small.trim()? + self.large.trim()?)
    }

    /// As [`VirtualMemoryResource::export_chunk`], for a block of either range: a descriptor
    /// for the physical chunk holding `ptr`, its start and its size (the small or the large
    /// page). Needs a backing created exportable ([`CudaBackingOptions::exportable`]).
    #[cfg(unix)]
    pub fn export_chunk(&self, ptr: NonNull<u8>) -> Result<(std::os::fd::OwnedFd, usize, usize)> {
        match self.small.export_chunk(ptr) {
            Err(Error::UnknownPointer { .. }) => self.large.export_chunk(ptr),
            r => r,
        }
    }

    /// As [`VirtualMemoryResource::set_segment_callback`], for both ranges: `callback` hears of
    /// every small and large chunk mapped and unmapped.
    pub fn set_segment_callback(&self, callback: Option<SegmentCallback>) {
        self.small.set_segment_callback(callback.clone());
        self.large.set_segment_callback(callback);
    }

    /// Segment callbacks that panicked, both ranges.
    pub fn segment_callback_panics(&self) -> u64 {
        self.small.segment_callback_panics() + self.large.segment_callback_panics()
    }

    /// Checks both ranges, and that the chunks counted are the pages mapped.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.small.check_invariants()?;
        self.large.check_invariants()?;
        // Chunks are created and released under a range's lock: with both held, the count
        // stands still. Nothing else takes both.
        let (small, large) = (lock(&self.small.inner.state), lock(&self.large.inner.state));
        let physical = self.backing.physical();
        let (s, l) = (small.pages.held_bytes(), large.pages.held_bytes());
        if physical != s + l {
            return Err(format!(
                "{physical} bytes in chunks, {s} + {l} held by the small and large ranges"
            ));
        }
        Ok(())
    }

    /// Bytes of chunks an allocation may create while free pages could move instead: what the
    /// headroom above the most bytes ever live leaves (a heuristic: read without a lock).
    fn spare(&self) -> usize {
        let peak = self.live.peak.load(Ordering::Relaxed);
        let budget = peak.saturating_add((peak as f64 * self.headroom) as usize);
        budget
            .min(self.backing.limit())
            .saturating_sub(self.backing.physical())
    }

    /// The range a request of `bytes` goes to, and the other one.
    fn route(&self, bytes: usize) -> (&Range<B>, &Range<B>) {
        if bytes <= self.small_limit {
            (&self.small, &self.large)
        } else {
            (&self.large, &self.small)
        }
    }
}

// SAFETY: pure routing by size to two resources that uphold the contract over disjoint
// reservations; a block is freed to the one that allocated it (same size, same route).
unsafe impl<B: PhysicalBacking> MemoryResource for ExpandableMemoryResource<B> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let (mine, other) = self.route(bytes);
        let spare = self.spare();
        let mut r = mine.allocate_with_spare(stream, bytes, align, spare);
        if spare > 0 && r.as_ref().is_err_and(Error::is_out_of_memory) {
            // The device may hold less than the headroom assumed: move free pages instead.
            r = mine.allocate(stream, bytes, align);
        }
        let r = match r {
            // The other range's free pages are physical memory too: release them and retry.
            Err(e) if e.is_out_of_memory() && other.stats().free_mapped > 0 => {
                other.trim()?;
                mine.allocate(stream, bytes, align)
            }
            r => r,
        };
        if r.is_ok() {
            let now = self.live.bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
            if now > self.live.peak.load(Ordering::Relaxed) {
                self.live.peak.fetch_max(now, Ordering::Relaxed);
            }
        }
        r
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract; `route` picks the range that allocated it.
        let r = unsafe { self.route(bytes).0.deallocate(stream, ptr, bytes, align) };
        if r.is_ok() {
            self.live.bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        r
    }

    fn properties(&self) -> Properties {
        self.small.properties()
    }

    fn device(&self) -> Option<Device> {
        self.small.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: s.bytes_in_use(),
            bytes_reserved: Some(s.physical),
            peak_bytes: None,
            live_blocks: Some(s.live_blocks()),
            detail: vec![
                (c"physical", n(s.physical)),
                (c"peak_physical", n(s.peak_physical)),
                (c"bytes_in_use", n(s.bytes_in_use())),
                (c"live_blocks", n(s.live_blocks())),
            ],
        }))
    }
    fn release_unused(&self) -> crate::error::Result<usize> {
        self.trim()
    }
}

impl<B: PhysicalBacking> fmt::Debug for ExpandableMemoryResource<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpandableMemoryResource")
            .field("small_limit", &self.small_limit)
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
#[path = "expandable_tests.rs"]
mod tests;
