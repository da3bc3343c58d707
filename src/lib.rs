//! # carve
//!
//! Composable, stream-ordered CUDA memory resources (the role of RAPIDS RMM), plus allocators
//! that run *inside* kernels, carving blocks from a pool the host reserved.
//!
//! ## Design
//!
//! - **One trait.** [`MemoryResource`] allocates and deallocates in stream order. Every
//!   resource is a cheap `Clone` handle and any resource can be the upstream of another.
//! - **No GPU needed to test the algorithms.** Suballocators keep their bookkeeping in host
//!   structs, so they run over [`HostMemoryResource`] in CI. GPU tests skip (saying why) unless
//!   `CARVE_REQUIRE_GPU=1`.
//! - **One source per algorithm.** The device allocators live in the `no_std` crate
//!   `carve-kernels`; `build.rs` compiles it to PTX ([`driver::PTX`]), and the same code runs
//!   on CPU threads and under loom (`--cfg carve_loom`).
//! - **Driver access through cudarc**, loaded at run time: on a machine without libcuda every
//!   call returns [`Error::NoDriver`] instead of panicking.
//!
//! ## Example
//!
//! ```no_run
//! use std::sync::Arc;
//! use carve::resource::PoolOptions;
//! use carve::{current, CudaMemoryResource, Device, DeviceVec, PoolMemoryResource};
//!
//! # fn main() -> carve::Result<()> {
//! let dev = Device::get(0)?;
//! let pool = PoolMemoryResource::new(CudaMemoryResource::new(&dev), PoolOptions::new(1 << 30))?;
//! current::set(0, Arc::new(pool))?; // returns the previous resource
//! let stream = dev.new_stream()?;
//! let v = DeviceVec::from_slice(&[1u32, 2, 3], &stream, current::get(0)?)?;
//! assert_eq!(v.to_vec()?, [1, 2, 3]); // frees through the pool on drop
//! # Ok(())
//! # }
//! ```
//!
//! ## Layout
//!
//! | module | holds |
//! |---|---|
//! | [`resource`] | the trait, in three layers: sources (cuda, managed, pinned, driver pool, host, simulated, virtual memory), engines (coalescing, stream order, ledger) and suballocators (pool, arena, binning, fixed-size, graph-safe) |
//! | [`adaptor`] | limiting, statistics, tracking, logging, failure callback, aligned, prefetch |
//! | [`current`] | the per-device current resource and `reinitialize` |
//! | [`buffer`] | `DeviceBuffer`, `DeviceVec<T: Pod>` |
//! | [`heap`] | `DeviceHeap`: blocks that kernels allocate and free |
//! | [`driver`] | devices, streams, events, the embedded PTX |
//! | [`snapshot`] | PyTorch's memory-snapshot format, written for its viewer |
//! | [`deferred`] | errors from `Drop` and undo paths, kept for [`take_deferred_error`] |

pub mod adaptor;
pub mod buffer;
pub mod current;
pub mod deferred;
pub mod driver;
pub mod error;
pub mod heap;
pub mod resource;
pub mod snapshot;
pub mod stream;
#[allow(dead_code)]
mod sync;
#[doc(hidden)]
pub mod testing;

pub use buffer::{DeviceBuffer, DeviceVec};
pub use deferred::{deferred_error_count, take_deferred_error, DeferredError};
pub use driver::{Device, Event, Stream};
pub use error::{Error, Result};
pub use heap::{DeviceHeap, HeapStats};
pub use resource::{
    ArenaMemoryResource, BinningMemoryResource, CudaMemoryResource, FixedSizeMemoryResource,
    HostMemoryResource, MemoryResource, MemoryStats, PoolMemoryResource, Properties,
    SharedResource, SimulatedMemoryResource,
};
pub use resource::{
    AsyncMemoryResource, AsyncPoolOptions, Location, ManagedBuffer, ManagedMemoryResource,
    PinnedBuffer, PinnedFlags, PinnedHostMemoryResource,
};
pub use resource::{ExpandableMemoryResource, GraphSafeMemoryResource, VirtualMemoryResource};
pub use stream::{StreamId, StreamRef};

/// Re-exported so users name the same cudarc version carve links.
pub use cudarc;
