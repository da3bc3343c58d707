//! [`VirtualOptions`] and [`VirtualStats`]: how a [`VirtualMemoryResource`] is sized, and what
//! it holds.

use std::fmt;
use std::sync::Arc;

use super::segments::SegmentCallback;
#[cfg(doc)]
use super::VirtualMemoryResource;
use crate::driver::Device;
use crate::error::Result;
use crate::resource::engine::stream_order::{CudaOrder, StreamOrder};

/// How a [`VirtualMemoryResource`] is sized.
#[derive(Clone, Default)]
pub struct VirtualOptions {
    /// The most physical bytes mapped at once; `None`: the device's memory (the simulated
    /// capacity).
    pub maximum: Option<usize>,
    /// Bytes per physical chunk (page): a power-of-two multiple of the backing's granularity;
    /// `None`: the granularity (2 MiB on current GPUs).
    pub chunk_size: Option<usize>,
    /// Bytes of address space to reserve; `None`: four times the maximum.
    pub reserve: Option<usize>,
    /// Blocks share pages (the expandable pool) rather than each taking whole chunks.
    pub expandable: bool,
    /// How streams are ordered; `None`: events on the backing's device for device-accessible
    /// memory (the CUDA backing), nothing for host and simulated memory. A backing of
    /// device-accessible memory that names no device needs one given.
    pub order: Option<Arc<dyn StreamOrder>>,
    /// While several streams allocate, mark a stream at every free (an event record: 120–670 ns
    /// on an H100, the most on the legacy default stream) and hand blocks to every stream once
    /// the device is past them: less memory across streams, slower frees. Off by default.
    pub mark_every_free: bool,
    /// Told of every chunk mapped and unmapped (see
    /// [`VirtualMemoryResource::set_segment_callback`]).
    pub on_segment: Option<SegmentCallback>,
}

impl VirtualOptions {
    /// Whole-chunk blocks, sized by the device.
    pub fn new() -> Self {
        Self::default()
    }
    /// Blocks of 256-byte grains sharing pages: the expandable pool.
    pub fn expandable() -> Self {
        VirtualOptions {
            expandable: true,
            ..Self::default()
        }
    }
    /// Bounds the physical memory mapped at once.
    pub fn maximum(mut self, bytes: usize) -> Self {
        self.maximum = Some(bytes);
        self
    }
    /// Sets the chunk (page) size.
    pub fn chunk_size(mut self, bytes: usize) -> Self {
        self.chunk_size = Some(bytes);
        self
    }
    /// Sets the address space reserved.
    pub fn reserve(mut self, bytes: usize) -> Self {
        self.reserve = Some(bytes);
        self
    }
    /// Uses `order` between streams.
    pub fn order(mut self, order: Arc<dyn StreamOrder>) -> Self {
        self.order = Some(order);
        self
    }
}

impl fmt::Debug for VirtualOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VirtualOptions")
            .field("maximum", &self.maximum)
            .field("chunk_size", &self.chunk_size)
            .field("reserve", &self.reserve)
            .field("expandable", &self.expandable)
            .field("order", &self.order)
            .field("mark_every_free", &self.mark_every_free)
            .field("on_segment", &self.on_segment.is_some())
            .finish()
    }
}

/// Fills in what the device constructors default: the device's total memory as the maximum,
/// and event ordering on the device.
pub(crate) fn fill_device_defaults(
    device: &Device,
    maximum: &mut Option<usize>,
    order: &mut Option<Arc<dyn StreamOrder>>,
) -> Result<()> {
    if maximum.is_none() {
        *maximum = Some(device.mem_info()?.total);
    }
    order.get_or_insert_with(|| Arc::new(CudaOrder::new(device)));
    Ok(())
}

/// A snapshot of a [`VirtualMemoryResource`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct VirtualStats {
    /// Bytes of address space reserved.
    pub reserved: usize,
    /// Bytes of the range in use by the block index (it grows in place).
    pub extent: usize,
    /// Physical bytes mapped now (including free pages).
    pub mapped: usize,
    /// The most physical bytes mapped at once: what the resource took from the device.
    pub peak_mapped: usize,
    /// Mapped bytes of pages no live block touches.
    pub free_mapped: usize,
    /// Bytes of chunks unmapped whose release the backing refused: held, counted against the
    /// maximum, and released by the next [`trim`](VirtualMemoryResource::trim) or at drop.
    pub unreleased: usize,
    /// The bound on mapped bytes.
    pub maximum: usize,
    /// The largest request that could be mapped now (free pages plus pages never created).
    pub mappable: usize,
    /// Bytes in live blocks (rounded to blocks).
    pub bytes_in_use: usize,
    /// Live blocks.
    pub live_blocks: usize,
    /// The largest free block of the range in use.
    pub largest_free_block: usize,
    /// Bytes per chunk (page).
    pub chunk_size: usize,
    /// Chunks created.
    pub chunks_created: u64,
    /// Chunks moved from a free page to one that was needed.
    pub chunks_moved: u64,
    /// Chunks released (trim, failures).
    pub chunks_released: u64,
    /// Successful `map` calls (one per page mapped: a created or a moved chunk).
    pub maps: u64,
    /// Successful `unmap` calls (moves, trims, failures).
    pub unmaps: u64,
    /// Successful `set_access` calls (one per run of pages mapped at once).
    pub access_grants: u64,
    /// Device-wide synchronisations (before moves and trims, and to reach other streams' free
    /// blocks).
    pub synchronizations: u64,
    /// Synchronisations of the allocating stream alone, before moves when no other stream held
    /// free blocks.
    pub stream_synchronizations: u64,
    /// Wall time in synchronisations of either kind.
    pub synchronization_time: std::time::Duration,
    /// Marks recorded on streams (event records), for other streams to reach their free blocks.
    pub marks: u64,
    /// Queries whether a mark is done ([`StreamOrder::mark_complete`]).
    pub mark_queries: u64,
    /// Wall time in marks and queries.
    pub mark_time: std::time::Duration,
}
