//! [`ExpandableMemoryResource`]: the expandable pool, [`VirtualMemoryResource`]s in expandable
//! mode over one backing, as PyTorch keeps small and large segments apart: small requests share
//! small pages, so they never pin a large page; large requests take large pages, so growing
//! costs few driver calls.
//!
//! As PyTorch keeps each stream's segments apart, the first stream that allocates (the main
//! one) has its pair of ranges and every other stream shares a second pair. Blocks freed on a
//! side stream then never fragment the main stream's range, whose layout repeats from one
//! training step to the next: on a PyTorch trace with a side stream (gpt_small), one shared
//! pair moved 261 pages over 10 passes and the side pair none. Ranges of one page size take
//! each other's free pages before creating one, so the split holds no more memory.
//!
//! A move waits for the device and costs an unmap as well as a map, so while the chunks held
//! stay within a *headroom* above the most bytes ever live ([`ExpandableOptions::headroom`],
//! 4 % by default), a page that must be mapped gets a new chunk; past it, free pages move.
//! Training steps repeat, so once the pages a step needs are held, later steps map nothing.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::cuda_backing::{CudaBacking, CudaBackingOptions};
use super::{BackingCounters, CountingBacking, PhysicalBacking, SimulatedBacking};
use super::{VirtualMemoryResource, VirtualOptions, VirtualStats};
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::{MemoryResource, Properties, StreamOrder};
use crate::stream::StreamRef;

/// How an [`ExpandableMemoryResource`] is sized.
#[derive(Clone, Default)]
pub struct ExpandableOptions {
    /// The most physical bytes in chunks at once, every range together; `None`: the device's
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
    /// by creating chunks while free pages could move instead; `None`: 0.04. Zero moves a free
    /// page whenever one exists: the least memory, the most driver calls.
    pub headroom: Option<f64>,
}

/// [`ExpandableOptions::headroom`]'s default: on PyTorch training traces with a side stream,
/// 2–3.5 % let later passes map no page, and 4 % keeps a margin under issue 12's 1.05× (see
/// BENCHMARKS.md, 2026-11-25, tenth session).
pub const DEFAULT_HEADROOM: f64 = 0.04;

impl fmt::Debug for ExpandableOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExpandableOptions")
            .field("maximum", &self.maximum)
            .field("small_limit", &self.small_limit)
            .field("small_chunk", &self.small_chunk)
            .field("large_chunk", &self.large_chunk)
            .field("headroom", &self.headroom)
            .finish_non_exhaustive()
    }
}

/// A snapshot of an [`ExpandableMemoryResource`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpandableStats {
    /// Physical bytes in chunks now, every range.
    pub physical: usize,
    /// The most physical bytes in chunks at once: what the pool took from the device.
    pub peak_physical: usize,
    /// The main stream's small range.
    pub small: VirtualStats,
    /// The main stream's large range.
    pub large: VirtualStats,
    /// The other streams' small range.
    pub side_small: VirtualStats,
    /// The other streams' large range.
    pub side_large: VirtualStats,
    /// The driver calls every range made (successful ones), and the physical bytes.
    pub calls: BackingCounters,
}

impl ExpandableStats {
    /// The four ranges: the main stream's small and large, then the other streams'.
    pub fn ranges(&self) -> [&VirtualStats; 4] {
        [&self.small, &self.large, &self.side_small, &self.side_large]
    }

    /// Bytes handed out and not freed, every range.
    pub fn bytes_in_use(&self) -> usize {
        self.ranges().iter().map(|r| r.bytes_in_use).sum()
    }

    /// Live blocks, every range.
    pub fn live_blocks(&self) -> usize {
        self.ranges().iter().map(|r| r.live_blocks).sum()
    }

    /// Mapped bytes with no live block, every range.
    pub fn free_mapped(&self) -> usize {
        self.ranges().iter().map(|r| r.free_mapped).sum()
    }
}

/// One of the ranges.
type Range<B> = VirtualMemoryResource<Arc<CountingBacking<B>>>;

/// [`ExpandableMemoryResource::main`] before any allocation.
const NO_STREAM: usize = usize::MAX;

/// The expandable pool, in the role of PyTorch's expandable segments for any client: growing
/// ranges ([`VirtualMemoryResource`] in expandable mode) over one backing, small requests (up to
/// 1 MiB) sharing 2 MiB pages and larger ones 32 MiB pages, one pair for the first stream that
/// allocates and one for all others. Free pages anywhere are unmapped and their memory mapped
/// where it is needed, so a large request never fails for lack of a contiguous hole while free
/// memory exists. Cheap to clone.
pub struct ExpandableMemoryResource<B: PhysicalBacking = CudaBacking> {
    backing: Arc<CountingBacking<B>>,
    /// The main stream's small and large ranges, then the other streams'.
    ranges: Arc<[Range<B>; 4]>,
    small_limit: usize,
    /// The id of the first stream that allocated ([`NO_STREAM`] before).
    main: Arc<AtomicUsize>,
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
            ranges: self.ranges.clone(),
            small_limit: self.small_limit,
            live: self.live.clone(),
            headroom: self.headroom,
            main: self.main.clone(),
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
        super::fill_device_defaults(device, &mut options.maximum, &mut options.order)?;
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
        let headroom = options.headroom.unwrap_or(DEFAULT_HEADROOM);
        if !(0.0..=1.0).contains(&headroom) {
            return Err(Error::InvalidArgument(format!(
                "ExpandableMemoryResource: headroom {headroom} is not a fraction in [0, 1]"
            )));
        }
        let backing = Arc::new(CountingBacking::new(backing, maximum));
        let range = |chunk: usize| {
            let mut o = VirtualOptions::expandable()
                .chunk_size(chunk)
                .maximum(maximum.max(chunk));
            o.order = options.order.clone();
            VirtualMemoryResource::new(backing.clone(), o)
        };
        let (small, large) = (
            options.small_chunk.unwrap_or(g),
            options.large_chunk.unwrap_or(16 * g),
        );
        let ranges = [range(small)?, range(large)?, range(small)?, range(large)?];
        ranges[0].share_free_pages(&ranges[2])?;
        ranges[1].share_free_pages(&ranges[3])?;
        Ok(ExpandableMemoryResource {
            ranges: Arc::new(ranges),
            small_limit: options.small_limit.unwrap_or(1 << 20),
            main: Arc::new(AtomicUsize::new(NO_STREAM)),
            backing,
            live: Arc::default(),
            headroom,
        })
    }

    /// The backing every range maps from.
    pub fn backing(&self) -> &B {
        self.backing.inner()
    }

    /// Every range and the physical memory now.
    pub fn stats(&self) -> ExpandableStats {
        let [small, large, side_small, side_large] = &*self.ranges;
        ExpandableStats {
            physical: self.backing.physical(),
            peak_physical: self.backing.peak_physical(),
            small: small.stats(),
            large: large.stats(),
            side_small: side_small.stats(),
            side_large: side_large.stats(),
            calls: self.backing.counters(),
        }
    }

    /// Unmaps and frees every free page of every range (see [`VirtualMemoryResource::trim`]).
    pub fn trim(&self) -> Result<usize> {
        let mut freed = 0;
        for r in self.ranges.iter() {
            freed += r.trim()?;
        }
        Ok(freed)
    }

    /// Checks every range, and that the chunks counted are the pages mapped.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut mapped = 0;
        for r in self.ranges.iter() {
            r.check_invariants()?;
            mapped += r.stats().mapped;
        }
        let physical = self.backing.physical();
        if physical != mapped {
            return Err(format!("{physical} bytes in chunks, {mapped} mapped"));
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

    /// The range a request of `bytes` on `stream` goes to.
    fn route(&self, stream: StreamRef<'_>, bytes: usize) -> &Range<B> {
        let id = stream.id().get();
        let mut main = self.main.load(Ordering::Relaxed);
        if main == NO_STREAM {
            // Only the first allocation needs the exchange; later ones only read.
            main = match self.main.compare_exchange(
                NO_STREAM,
                id,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => id,
                Err(first) => first,
            };
        }
        let side = if id == main { 0 } else { 2 };
        &self.ranges[side + usize::from(bytes > self.small_limit)]
    }
}

// SAFETY: pure routing to resources that uphold the contract over disjoint reservations; a
// block is freed to the one whose reservation holds it.
unsafe impl<B: PhysicalBacking> MemoryResource for ExpandableMemoryResource<B> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let mine = self.route(stream, bytes);
        let spare = self.spare();
        let mut r = mine.allocate_with_spare(stream, bytes, align, spare);
        if spare > 0 && r.as_ref().is_err_and(Error::is_out_of_memory) {
            // The device may hold less than the headroom assumed: move free pages instead.
            r = mine.allocate(stream, bytes, align);
        }
        let r = match r {
            // The other ranges' free pages are physical memory too: release them and retry.
            Err(e) if e.is_out_of_memory() => {
                let mut freed = 0;
                for range in self.ranges.iter().filter(|r| !std::ptr::eq(*r, mine)) {
                    if range.stats().free_mapped > 0 {
                        freed += range.trim()?;
                    }
                }
                if freed == 0 {
                    return Err(e);
                }
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
        let addr = ptr.as_ptr() as usize;
        // By address, not by stream: a block may be freed on another stream than its own.
        let Some(r) = self.ranges.iter().find(|r| r.contains(addr)) else {
            return Err(Error::UnknownPointer {
                resource: "ExpandableMemoryResource",
                ptr: addr,
            });
        };
        // SAFETY: the caller's contract; `r` is the range whose reservation holds the block.
        let r = unsafe { r.deallocate(stream, ptr, bytes, align) };
        if r.is_ok() {
            self.live.bytes.fetch_sub(bytes, Ordering::Relaxed);
        }
        r
    }

    fn properties(&self) -> Properties {
        self.ranges[0].properties()
    }

    fn device(&self) -> Option<Device> {
        self.ranges[0].device()
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
