//! [`VirtualMemoryResource`]: one reserved virtual range that grows in place, with physical
//! chunks mapped on demand and unmapped wherever they fall free; in expandable mode, a pool in
//! the role of PyTorch's expandable segments, for any client ([`ExpandableMemoryResource`]).
//!
//! The struct's documentation says how blocks are placed and pages mapped, moved and trimmed;
//! BENCHMARKS.md, "Why it is built this way", gives the counts on training traces. A segment
//! callback ([`VirtualMemoryResource::set_segment_callback`]) hears of every chunk mapped and
//! unmapped, to register the memory with NCCL as it appears.

mod backing;
mod counting;
mod cuda_backing;
mod expandable;
#[cfg(target_os = "linux")]
mod host_backing;
#[cfg(unix)]
mod imported;
mod options;
mod pages;
mod segments;
mod simulated;

use crate::sync::lock;
pub use backing::{PhysicalBacking, PhysicalHandle};
pub use counting::CountingBacking;
use counting::SyncCounter;
pub use cuda_backing::{ChunkLocation, CudaBacking, CudaBackingOptions, Fabric, Granularity};
pub use expandable::{ExpandableMemoryResource, ExpandableOptions, ExpandableStats};
#[cfg(target_os = "linux")]
pub use host_backing::HostBacking;
#[cfg(unix)]
pub use imported::ImportedChunk;
use options::fill_device_defaults;
pub use options::{VirtualOptions, VirtualStats};
pub use segments::{SegmentCallback, SegmentChange, SegmentEvent};
pub use simulated::{BackingCounters, BackingFaults, CallTimes, SimulatedBacking};

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use self::pages::{Pages, Settled};
use self::segments::Segments;
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::engine::coalescing::{
    allocate_from, footprint, OnStream, Placer, PoolCore, Reach, GRAIN,
};
use crate::resource::engine::stream_order::order_for;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{align_up, check_request, MemoryResource, Properties};
use crate::stream::StreamRef;

pub(crate) const NAME: &str = "VirtualMemoryResource";

/// One reserved virtual range that grows in place, mapping physical chunks on demand. Cheap to
/// clone (clones share the resource).
///
/// The range is reserved once ([`PhysicalBacking::reserve`]), so addresses never move. Blocks
/// are placed by carve's coalescing engine (TLSF best fit, stream-ordered reuse, as in
/// [`PoolMemoryResource`](crate::PoolMemoryResource)) over the part of the range in use, which
/// grows in large steps when no free block fits: a request never fails for want of a
/// contiguous hole. Physical memory is counted in chunks (pages, a power-of-two multiple of the
/// driver's granularity); a page is mapped while a live block touches it. A page whose blocks
/// are all freed stays mapped and free; when a block needs a page mapped elsewhere, the chunk
/// of a free page moves there (after waiting for the stream, or the device, that may still use
/// it), so the memory held
/// follows the pages in use, not the history of the range; blocks go to free space on mapped
/// pages before space whose pages are unmapped, so moves stay rare. [`trim`](Self::trim) unmaps
/// and frees every free page.
///
/// Two modes: whole chunks per block ([`VirtualOptions::new`]; a free leaves its pages free at
/// once; a good upstream for other suballocators), or blocks of 256-byte grains that share
/// pages ([`VirtualOptions::expandable`]; see also [`ExpandableMemoryResource`], which keeps
/// small and large requests in two such ranges).
///
/// The backing is the CUDA driver ([`CudaBacking`]) or an address-only simulation
/// ([`SimulatedBacking`]) that answers "would this fit in N GiB?" with no GPU.
pub struct VirtualMemoryResource<B: PhysicalBacking = CudaBacking> {
    inner: Arc<Inner<B>>,
}

struct Inner<B: PhysicalBacking> {
    backing: B,
    order: SyncCounter,
    base: usize,
    reserved: usize,
    expandable: bool,
    state: Mutex<State>,
    segments: Segments,
}

struct State {
    core: PoolCore,
    pages: Pages,
    /// Bytes of the range the core indexes, from `base`.
    extent: usize,
}

impl<B: PhysicalBacking> Clone for VirtualMemoryResource<B> {
    fn clone(&self) -> Self {
        VirtualMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

impl VirtualMemoryResource<CudaBacking> {
    /// A resource on `device` with the driver's virtual memory management.
    pub fn on_device(
        device: &Device,
        backing: CudaBackingOptions,
        mut options: VirtualOptions,
    ) -> Result<Self> {
        let backing = CudaBacking::new(device, backing)?;
        fill_device_defaults(device, &mut options.maximum, &mut options.order)?;
        Self::new(backing, options)
    }
}

impl VirtualMemoryResource<SimulatedBacking> {
    /// Address-only virtual memory of `capacity` physical bytes with 2 MiB chunks, as on current
    /// GPUs: no GPU needed. Its pointers must never be dereferenced.
    pub fn simulated(capacity: usize, options: VirtualOptions) -> Result<Self> {
        let backing = SimulatedBacking::new(capacity, 2 << 20)?;
        let options = VirtualOptions {
            maximum: Some(options.maximum.unwrap_or(capacity).min(backing.capacity())),
            ..options
        };
        Self::new(backing, options)
    }
}

impl<B: PhysicalBacking> VirtualMemoryResource<B> {
    /// A resource over `backing`. `options.maximum` must be given (the device constructors fill
    /// it in); chunk and reservation sizes must be multiples of the backing's granularity.
    pub fn new(backing: B, options: VirtualOptions) -> Result<Self> {
        let g = backing.granularity();
        let invalid = |why: String| Err(Error::InvalidArgument(format!("{NAME}: {why}")));
        let page = options.chunk_size.unwrap_or(g);
        if !page.is_power_of_two() || page % g != 0 || page % GRAIN != 0 {
            return invalid(format!(
                "chunk size {page} is not a power-of-two multiple of the granularity {g}"
            ));
        }
        let Some(maximum) = options.maximum else {
            return invalid("no maximum size".to_owned());
        };
        let max_pages = maximum / page;
        if max_pages == 0 {
            return invalid(format!("maximum {maximum} is less than one chunk ({page})"));
        }
        if max_pages >= u32::MAX as usize {
            return invalid(format!("maximum {maximum} is too many chunks of {page}"));
        }
        let reserved = match options.reserve {
            Some(r) if r % page != 0 || r < max_pages * page => {
                return invalid(format!(
                    "reservation {r} must be a multiple of the chunk size and at least the \
                     maximum"
                ))
            }
            Some(r) => r,
            None => (max_pages * page)
                .checked_mul(4)
                .filter(|&r| r <= 1 << 48)
                .unwrap_or(max_pages * page),
        };
        let order = match options.order {
            Some(o) => o,
            None => order_for(backing.properties(), backing.device(), &backing)?,
        };
        let base = backing.reserve(reserved, page)?;
        let segments = Segments::default();
        let _none = segments.set(options.on_segment, std::iter::empty());
        Ok(VirtualMemoryResource {
            inner: Arc::new(Inner {
                order: SyncCounter::new(order),
                base,
                reserved,
                expandable: options.expandable,
                state: Mutex::new(State {
                    core: PoolCore::marking_every_free(options.mark_every_free),
                    pages: Pages::new(base, page, max_pages),
                    extent: 0,
                }),
                segments,
                backing,
            }),
        })
    }

    /// The backing.
    pub fn backing(&self) -> &B {
        &self.inner.backing
    }

    /// The start of the reserved range: every block lies in `[base, base + reserved)`.
    pub fn base(&self) -> usize {
        self.inner.base
    }

    /// Range, mapping and use now.
    pub fn stats(&self) -> VirtualStats {
        let mut st = lock(&self.inner.state);
        let c = st.pages.counters();
        let page = st.pages.page_size();
        VirtualStats {
            reserved: self.inner.reserved,
            extent: st.extent,
            mapped: c.mapped * page,
            peak_mapped: c.peak_mapped * page,
            free_mapped: c.free * page,
            unreleased: st.pages.unreleased() * page,
            maximum: st.pages.max_pages() * page,
            mappable: st.pages.mappable_bytes(),
            bytes_in_use: st.core.in_use(),
            live_blocks: st.core.live_count(),
            largest_free_block: st.core.largest_free(),
            chunk_size: page,
            chunks_created: c.creates,
            chunks_moved: c.moves,
            chunks_released: c.releases,
            maps: c.maps,
            unmaps: c.unmaps,
            access_grants: c.access_grants,
            synchronizations: self.inner.order.syncs(),
            stream_synchronizations: self.inner.order.stream_syncs(),
            synchronization_time: self.inner.order.sync_time(),
            marks: self.inner.order.marks(),
            mark_queries: self.inner.order.queries(),
            mark_time: self.inner.order.mark_time(),
        }
    }

    /// Unmaps and frees every page no live block touches, after waiting for all work on the
    /// device. Returns the bytes released. Addresses stay reserved; blocks placed there later
    /// map pages again. When the wait fails nothing is unmapped; a page whose unmap the backing
    /// refuses stays mapped and free, and a chunk whose release it refuses stays held
    /// ([`VirtualStats::unreleased`]): the next trim, or the drop, tries again.
    pub fn trim(&self) -> Result<usize> {
        let mut st = lock(&self.inner.state);
        self.inner.order.synchronize_all()?;
        st.core.merge_all();
        let r = st.pages.trim(&self.inner.backing);
        self.publish(st);
        r
    }

    /// Calls `callback` for every chunk mapped from now on (once the backing's access is
    /// granted, before the block on it is handed out) and every chunk unmapped (after the
    /// unmap, with no live block or queued work on it), to register the memory with NCCL or
    /// NIXL as it appears; `None` removes it. A new callback first hears of every chunk mapped
    /// now; events not yet delivered to the one it replaces are dropped. See
    /// [`SegmentCallback`] for where it runs. At drop, every chunk still mapped is announced
    /// unmapped before it is unmapped.
    pub fn set_segment_callback(&self, callback: Option<SegmentCallback>) {
        let st = lock(&self.inner.state);
        let mapped = st.pages.mapped_segments(SegmentChange::Mapped);
        let replaced = self.inner.segments.set(callback, mapped);
        self.publish(st);
        drop(replaced);
    }

    /// Segment callbacks that panicked (each caught, and recorded as a deferred error).
    pub fn segment_callback_panics(&self) -> u64 {
        self.inner.segments.panics()
    }

    /// Queues the page table's segment events, releases the lock and delivers them.
    fn publish(&self, mut st: MutexGuard<'_, State>) {
        self.inner.segments.push(&mut st.pages.events);
        drop(st);
        self.inner.segments.deliver();
    }

    /// A POSIX file descriptor for the physical chunk that holds `ptr` (a live block's address),
    /// with the chunk's start address and size, for another process to map with
    /// [`ImportedChunk::import`]. Needs a backing created exportable
    /// ([`CudaBackingOptions::exportable`]).
    #[cfg(unix)]
    pub fn export_chunk(&self, ptr: NonNull<u8>) -> Result<(std::os::fd::OwnedFd, usize, usize)> {
        let st = lock(&self.inner.state);
        let addr = ptr.as_ptr() as usize;
        if !st.core.owns(addr) {
            return Err(Error::UnknownPointer {
                resource: NAME,
                ptr: addr,
            });
        }
        let (start, handle) = st.pages.chunk_at(addr).ok_or(Error::UnknownPointer {
            resource: NAME,
            ptr: addr,
        })?;
        let fd = self.inner.backing.export_fd(handle)?;
        Ok((fd, start, st.pages.page_size()))
    }

    /// Checks the block index and the page table against each other.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut st = lock(&self.inner.state);
        st.core.check_invariants()?;
        if st.core.pool_size() != st.extent {
            return Err(format!(
                "extent {} but the index holds {}",
                st.extent,
                st.core.pool_size()
            ));
        }
        let live = st.core.live_ranges();
        st.pages.check(&live)
    }

    /// Bytes and alignment a request takes in the index: whole chunks unless expandable.
    fn shape(&self, page: usize, bytes: usize, align: usize) -> Result<(usize, usize)> {
        if self.inner.expandable {
            return Ok((bytes, align));
        }
        let size = align_up(bytes, page).ok_or(Error::SizeOverflow { bytes, align })?;
        Ok((size, align.max(page)))
    }

    /// Grows the indexed part of the range by at least `needed` bytes (in large steps: the
    /// walk of the index this takes stays rare). False when the reservation is used up.
    fn extend(&self, st: &mut State, needed: usize) -> bool {
        let page = st.pages.page_size();
        let room = self.inner.reserved - st.extent;
        let step = needed.max(st.extent / 8).max(32 * page);
        let grow = match align_up(step, page) {
            Some(g) => g.min(room),
            None => room,
        };
        if grow == 0 {
            return false;
        }
        if st.extent == 0 {
            st.core.add_chunk(self.inner.base, grow, None);
        } else {
            st.core.extend_chunk(self.inner.base, grow);
        }
        st.extent += grow;
        true
    }

    fn out_of_memory(&self, st: &mut State, bytes: usize, why: String) -> Error {
        let c = st.pages.counters();
        let page = st.pages.page_size();
        Error::OutOfMemory {
            bytes,
            resource: NAME,
            detail: format!(
                "{why}; {} bytes mapped of at most {}, {} of them free, {} in use; \
                 the largest request that could be mapped is {} bytes",
                c.mapped * page,
                st.pages.max_pages() * page,
                c.free * page,
                st.core.in_use(),
                st.pages.mappable_bytes()
            ),
        }
    }
}

impl<B: PhysicalBacking> VirtualMemoryResource<B> {
    /// [`MemoryResource::allocate`], creating up to `spare` bytes of chunks rather than moving
    /// free pages (the expandable pool's headroom).
    pub(crate) fn allocate_with_spare(
        &self,
        stream: StreamRef<'_>,
        bytes: usize,
        align: usize,
        spare: usize,
    ) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, GRAIN)?;
        let mut st = lock(&self.inner.state);
        let r = self.allocate_locked(&mut st, stream, bytes, align, spare);
        self.publish(st);
        r
    }

    fn allocate_locked(
        &self,
        st: &mut State,
        stream: StreamRef<'_>,
        bytes: usize,
        align: usize,
        spare: usize,
    ) -> Result<NonNull<u8>> {
        let spare_pages = spare / st.pages.page_size();
        st.pages.set_spare(spare_pages);
        let (bytes, align) = self.shape(st.pages.page_size(), bytes, align)?;
        let (size, needed) = footprint(bytes, align).ok_or(Error::SizeOverflow { bytes, align })?;
        let order = &self.inner.order;
        let reach = Reach::Synchronize;
        let place = Some(&st.pages as &dyn Placer);
        let found = match allocate_from(
            &mut st.core,
            order,
            OnStream::new(stream),
            bytes,
            align,
            reach,
            place,
        )? {
            Some(p) => Some(p),
            None if self.extend(st, needed) => {
                let place = Some(&st.pages as &dyn Placer);
                allocate_from(
                    &mut st.core,
                    order,
                    OnStream::new(stream),
                    bytes,
                    align,
                    reach,
                    place,
                )?
            }
            None => None,
        };
        let Some(p) = found else {
            let why = format!(
                "the reserved range ({} bytes) has no free block of {needed} bytes",
                self.inner.reserved
            );
            return Err(self.out_of_memory(st, bytes, why));
        };
        let (mut p, mut synced) = (p, false);
        let mut start = p.as_ptr() as usize;
        if st.pages.moves_for(st.pages.cost(start, start + size)) > 0
            && st.core.others_hold_free(stream.id())
        {
            // Moving a chunk waits for the whole device anyway; after that wait, every free
            // block is open to this stream, and one of other streams' may lie on mapped pages.
            let _ = st.core.free(NAME, stream.id(), start, bytes);
            order.synchronize_all()?;
            synced = true;
            st.core.merge_all();
            // The block just freed is free to any stream now, so something fits.
            let Some(q) = st.core.take_placed(stream.id(), bytes, align, &st.pages) else {
                let why = "no free block after merging".to_owned();
                return Err(self.out_of_memory(st, bytes, why));
            };
            (p, start) = (q, q.as_ptr() as usize);
        }
        let settled = if synced {
            Settled::Device
        } else if st.core.others_hold_free(stream.id()) {
            Settled::No
        } else {
            Settled::ByStream(stream)
        };
        // The commit may unwind out of the order's wait (it leaves the page table as it was):
        // the block goes back to the index before the panic goes on.
        let committed = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let backing = &self.inner.backing;
            st.pages
                .commit(backing, order, settled, start, start + size)
        }));
        let committed = committed.unwrap_or_else(|panic| {
            let _ = st.core.free(NAME, stream.id(), start, bytes);
            std::panic::resume_unwind(panic)
        });
        if let Err(e) = committed {
            // Never used: back to the index (a block of ours with its own size cannot fail).
            let _ = st.core.free(NAME, stream.id(), start, bytes);
            return Err(match e {
                Error::OutOfMemory { detail, .. } => self.out_of_memory(st, bytes, detail),
                e => e,
            });
        }
        Ok(p)
    }
}

// SAFETY: blocks are carved by the coalescing engine (disjoint, aligned, each handed out once)
// from `[base, base + reserved)`, which the backing reserved for us alone; before a block is
// returned every page it touches is mapped with the backing's access (`Pages::commit`), and a
// page is unmapped only with no live block on it, after waiting for all work that used it: the
// device's, or the allocating stream's when no other stream holds free blocks (`Settled`).
unsafe impl<B: PhysicalBacking> MemoryResource for VirtualMemoryResource<B> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        self.allocate_with_spare(stream, bytes, align, 0)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let mut st = lock(&self.inner.state);
        let (bytes, _) = self.shape(st.pages.page_size(), bytes, align.max(1))?;
        let start = ptr.as_ptr() as usize;
        let st = &mut *st;
        let freed = st.core.free(NAME, stream.id(), start, bytes)?;
        let size = align_up(bytes, GRAIN).expect("the block was allocated with this size");
        st.pages.decommit(start, start + size);
        // The free is booked in full before the order is called, which may fail or unwind. A
        // failed mark only keeps the fresh blocks private to `stream` (others reach them after
        // a device-wide synchronisation): nothing to report.
        if freed.mark_due && self.inner.order.mark(stream).is_ok() {
            st.core.seal(stream.id());
        }
        Ok(())
    }

    fn properties(&self) -> Properties {
        self.inner.backing.properties()
    }

    fn device(&self) -> Option<Device> {
        self.inner.backing.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: s.bytes_in_use,
            bytes_reserved: Some(s.mapped),
            peak_bytes: None,
            live_blocks: Some(s.live_blocks),
            detail: vec![
                (c"reserved", n(s.reserved)),
                (c"mapped", n(s.mapped)),
                (c"peak_mapped", n(s.peak_mapped)),
                (c"free_mapped", n(s.free_mapped)),
                (c"bytes_in_use", n(s.bytes_in_use)),
                (c"live_blocks", n(s.live_blocks)),
                (c"largest_free_block", n(s.largest_free_block)),
                (c"chunk_size", n(s.chunk_size)),
            ],
        }))
    }
    fn release_unused(&self) -> crate::error::Result<usize> {
        self.trim()
    }
}

impl<B: PhysicalBacking> Drop for Inner<B> {
    fn drop(&mut self) {
        // Blocks may still be in use by queued work; unmapping needs the device idle. When the
        // wait fails, that work may still run: every chunk and the reservation leak. A panic
        // in the order counts as a failure (one out of a drop during unwinding would abort).
        let synced = std::panic::catch_unwind(AssertUnwindSafe(|| self.order.synchronize_all()))
            .unwrap_or_else(|_| {
                Err(Error::InvalidArgument(
                    "the stream order panicked while waiting for the device".to_owned(),
                ))
            });
        if synced.is_err() {
            crate::deferred::record(
                "VirtualMemoryResource drop: waiting for the device before unmapping",
                synced,
            );
            return;
        }
        let st = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        // Announced before the unmaps, so that registrations go first.
        let mut gone: Vec<_> = st.pages.mapped_segments(SegmentChange::Unmapped).collect();
        st.pages.events.clear();
        self.segments.push(&mut gone);
        self.segments.deliver();
        if st.pages.release_all(&self.backing) {
            // SAFETY: our reservation, with every page unmapped above; never used again.
            let r = unsafe { self.backing.free_reservation(self.base, self.reserved) };
            crate::deferred::record("VirtualMemoryResource drop: returning the reservation", r);
        }
    }
}

impl<B: PhysicalBacking> fmt::Debug for VirtualMemoryResource<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("backing", &self.inner.backing)
            .field("expandable", &self.inner.expandable)
            .field("stats", &self.stats())
            .finish()
    }
}

#[cfg(test)]
mod fault_tests;
#[cfg(test)]
mod placement_tests;
#[cfg(test)]
mod segment_tests;
#[cfg(test)]
mod tests;
