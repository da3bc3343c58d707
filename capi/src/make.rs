//! Building and composing resources: one function per kind, shared by the C functions and the
//! Python package. Upstreams are entries; the new entry holds its upstream's `Arc`.

use std::sync::Arc;

use carve::adaptor::{
    LimitingResourceAdaptor, LoggingResourceAdaptor, StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
};
use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::{
    ArenaMemoryResource, AsyncMemoryResource, AsyncPoolOptions, BinningMemoryResource,
    CudaMemoryResource, Device, FixedSizeMemoryResource, HostMemoryResource, ManagedMemoryResource,
    PinnedFlags, PinnedHostMemoryResource, PoolMemoryResource, SharedResource,
};

use crate::error::{FfiError, FfiResult};
use crate::registry::Entry;

/// `CARVE_PINNED_PORTABLE`.
pub const PINNED_PORTABLE: u32 = 1;
/// `CARVE_PINNED_DEVICE_MAPPED`.
pub const PINNED_DEVICE_MAPPED: u32 = 2;
/// `CARVE_PINNED_WRITE_COMBINED`.
pub const PINNED_WRITE_COMBINED: u32 = 4;

fn up(upstream: &Entry) -> SharedResource {
    upstream.resource.clone()
}

/// `cuMemAlloc` on device `device`.
pub fn cuda(device: usize) -> FfiResult<Arc<Entry>> {
    let r = CudaMemoryResource::on(device)?;
    Ok(Entry::new(c"cuda", Arc::new(r)))
}

/// Managed memory (`cuMemAllocManaged`) on device `device`.
pub fn managed(device: usize) -> FfiResult<Arc<Entry>> {
    let r = ManagedMemoryResource::on(device)?;
    Ok(Entry::new(c"managed", Arc::new(r)))
}

/// Pinned host memory; `flags` is a mask of the `PINNED_*` bits.
pub fn pinned(device: usize, flags: u32) -> FfiResult<Arc<Entry>> {
    if flags & !(PINNED_PORTABLE | PINNED_DEVICE_MAPPED | PINNED_WRITE_COMBINED) != 0 {
        return Err(FfiError::invalid(format!(
            "unknown pinned flags {flags:#x}"
        )));
    }
    let f = PinnedFlags {
        portable: flags & PINNED_PORTABLE != 0,
        device_mapped: flags & PINNED_DEVICE_MAPPED != 0,
        write_combined: flags & PINNED_WRITE_COMBINED != 0,
    };
    let r = PinnedHostMemoryResource::new(&Device::get(device)?, f)?;
    Ok(Entry::new(c"pinned", Arc::new(r)))
}

/// A new driver pool (`cuMemPoolCreate`) on `device`.
pub fn async_pool(
    device: usize,
    initial_size: usize,
    release_threshold: Option<usize>,
    hard_limit: Option<usize>,
) -> FfiResult<Arc<Entry>> {
    let options = AsyncPoolOptions {
        initial_size,
        release_threshold,
        hard_limit,
        ipc_export: false,
    };
    let r = AsyncMemoryResource::on(device, &options)?;
    Ok(Arc::new(Entry {
        kind: c"async",
        driver_pool: Some(r.handle() as usize),
        resource: Arc::new(r),
        chunks: None,
    }))
}

/// Pageable host memory (no GPU needed).
pub fn host() -> Arc<Entry> {
    let r = HostMemoryResource::new();
    Entry::new(c"host", Arc::new(r))
}

/// A coalescing pool over `upstream`.
pub fn pool(upstream: &Entry, initial: usize, maximum: Option<usize>) -> FfiResult<Arc<Entry>> {
    let mut options = PoolOptions::new(initial);
    options.maximum_size = maximum;
    let r = PoolMemoryResource::new(up(upstream), options)?;
    Ok(Entry::new(c"pool", Arc::new(r)))
}

/// Power-of-two bins `2^min_exp ..= 2^max_exp` over `upstream` (larger requests go upstream).
pub fn binning(upstream: &Entry, min_exp: u32, max_exp: u32) -> FfiResult<Arc<Entry>> {
    let r = BinningMemoryResource::new(up(upstream), min_exp, max_exp)?;
    Ok(Entry::new(c"binning", Arc::new(r)))
}

/// Per-thread arenas over `upstream`; zeros pick the defaults.
pub fn arena(
    upstream: &Entry,
    superblock_size: usize,
    arenas: usize,
    maximum: Option<usize>,
) -> FfiResult<Arc<Entry>> {
    let mut global = PoolOptions::new(0);
    global.maximum_size = maximum;
    let options = ArenaOptions {
        superblock_size,
        arenas,
        global,
    };
    let r = ArenaMemoryResource::new(up(upstream), options)?;
    Ok(Entry::new(c"arena", Arc::new(r)))
}

/// Blocks of `block_size` bytes over `upstream`; `blocks_per_refill` 0 picks the default.
pub fn fixed_size(
    upstream: &Entry,
    block_size: usize,
    blocks_per_refill: u32,
) -> FfiResult<Arc<Entry>> {
    let mut options = FixedSizeOptions::new(block_size);
    if blocks_per_refill != 0 {
        options = options.blocks_per_refill(blocks_per_refill);
    }
    let r = FixedSizeMemoryResource::new(up(upstream), options)?;
    Ok(Entry::new(c"fixed_size", Arc::new(r)))
}

/// Refuses requests once `limit` bytes are live.
pub fn limiting(upstream: &Entry, limit: usize) -> Arc<Entry> {
    let r = LimitingResourceAdaptor::new(up(upstream), limit);
    Entry::new(c"limiting", Arc::new(r))
}

/// Counts current, peak and total bytes and allocations.
pub fn statistics(upstream: &Entry) -> Arc<Entry> {
    let r = StatisticsResourceAdaptor::new(up(upstream));
    Entry::new(c"statistics", Arc::new(r))
}

/// Tracks outstanding blocks (and, with `backtraces`, where each was allocated).
pub fn tracking(upstream: &Entry, backtraces: bool) -> Arc<Entry> {
    let r = TrackingResourceAdaptor::new(up(upstream), backtraces);
    Entry::new(c"tracking", Arc::new(r))
}

/// Logs every call as RMM's CSV to a new file at `path`.
pub fn logging(upstream: &Entry, path: &str, auto_flush: bool) -> FfiResult<Arc<Entry>> {
    if path.is_empty() {
        return Err(FfiError::invalid("the logging adaptor needs a file path"));
    }
    let r = LoggingResourceAdaptor::to_file(up(upstream), path, auto_flush)?;
    Ok(Entry::new(c"logging", Arc::new(r)))
}

/// Returns what `entry` holds and does not use to its upstream (pool, arena: empty chunks;
/// driver pool: trims to zero). Bytes released when the resource can tell, else 0.
pub fn release(entry: &Entry) -> FfiResult<usize> {
    entry.resource.release_unused().map_err(|e| match e {
        carve::Error::Unsupported(_) => carve::Error::Unsupported(format!(
            "release: a {} resource holds nothing to release",
            entry.kind_str()
        ))
        .into(),
        e => e.into(),
    })
}
