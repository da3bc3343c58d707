//! The [`MemoryResource`] trait and the resources, in three layers.
//!
//! Every resource is a cheap `Clone` handle (an `Arc` inside), and every resource can be the
//! upstream of another: adaptors and suballocators own an upstream `R: MemoryResource`.
//! `Arc<dyn MemoryResource>` ([`SharedResource`]) is itself a resource, for type-erased stacks.
//!
//! | layer | folder | holds |
//! |---|---|---|
//! | sources | `source/` | memory from the driver or the host: [`CudaMemoryResource`], [`ManagedMemoryResource`], [`PinnedHostMemoryResource`], the driver pool [`AsyncMemoryResource`], [`HostMemoryResource`], [`SimulatedMemoryResource`], and virtual memory ([`VirtualMemoryResource`], [`ExpandableMemoryResource`]) |
//! | engines | `engine/` | machinery the others share: the coalescing block index, [`StreamOrder`] (when a freed block is safe for another stream), the ledger of live driver blocks |
//! | suballocators | `suballoc/` | resources that carve an upstream's memory: [`PoolMemoryResource`], [`ArenaMemoryResource`], [`BinningMemoryResource`], [`FixedSizeMemoryResource`], [`GraphSafeMemoryResource`] |
//!
//! Adaptors, which wrap a resource without carving it, live beside this module in
//! [`adaptor`](crate::adaptor).

mod engine;
mod memory_resource;
mod memory_stats;
mod source;
mod suballoc;

pub use engine::fault_pattern::FaultPattern;
pub(crate) use engine::release::{release_in_drop, release_once};
pub use memory_resource::{
    align_up, check_request, MemoryResource, Properties, SharedResource, DEFAULT_ALIGNMENT,
};
pub use memory_stats::MemoryStats;

pub use source::async_pool::{
    AsyncMemoryResource, AsyncPoolOptions, AsyncPoolStats, ImportedPointer, ImportedPool,
    PointerExport, PoolAccess,
};
pub use source::cuda::CudaMemoryResource;
pub use source::host::HostMemoryResource;
pub use source::host_buffer::HostBuffer;
pub(crate) use source::location::check_device;
pub use source::location::{check_ordinal, Location};
pub(crate) use source::managed::prefetch_raw;
pub use source::managed::{
    Advice, ManagedBuffer, ManagedMemoryResource, ManagedRange, RangeAttributes,
};
pub use source::pinned::{
    HostRegistration, PinnedBuffer, PinnedFlags, PinnedHostMemoryResource, PINNED_ALIGNMENT,
};
pub use source::simulated::{SimulatedMemoryResource, SimulatedUsage};
#[cfg(target_os = "linux")]
pub use source::virtual_memory::HostBacking;
#[cfg(unix)]
pub use source::virtual_memory::ImportedChunk;
pub use source::virtual_memory::{
    BackingCounters, BackingFaults, CallTimes, ChunkLocation, CountingBacking, CudaBacking,
    CudaBackingOptions, ExpandableMemoryResource, ExpandableOptions, ExpandableStats, Fabric,
    Granularity, PhysicalBacking, PhysicalHandle, SegmentCallback, SegmentChange, SegmentEvent,
    SimulatedBacking, VirtualMemoryResource, VirtualOptions, VirtualStats,
};

pub use engine::stream_order::{
    CheckedCounts, CheckedOrder, CheckedResource, CountingOrder, CudaOrder, HostOrder, OrderCounts,
    OrderEvent, OrderFaults, RecordingOrder, StreamOrder, MARK_EVERY,
};

pub use suballoc::arena::{ArenaMemoryResource, ArenaOptions, ArenaStats};
pub use suballoc::binning::{Bin, BinningMemoryResource};
pub use suballoc::fixed_size::{FixedSizeMemoryResource, FixedSizeOptions, FixedSizeStats};
pub use suballoc::graph_safe::{
    CaptureQuery, DriverCapture, GraphPoolStats, GraphSafeMemoryResource, SimulatedCapture,
};
pub use suballoc::pool::{PoolMemoryResource, PoolOptions, PoolStats};
