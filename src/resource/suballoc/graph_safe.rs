//! [`GraphSafeMemoryResource`]: allocation that CUDA graph capture can record, as PyTorch's
//! graph pools.
//!
//! A request on a stream being captured (`cuStreamBeginCapture`) is served from a private pool
//! of that capture, grown from the upstream with the thread's capture mode relaxed (so
//! `cuMemAlloc` does not invalidate the capture). Its blocks keep their addresses after the
//! capture ends: the graph has them baked in and may be launched again and again. A free of such
//! a block, during the capture or after it, is deferred: the memory stays the graph's until
//! [`release_graph_pool`](GraphSafeMemoryResource::release_graph_pool), called once the graphs
//! that use it are destroyed. Requests on other streams go to the upstream unchanged.

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::engine::stream_order::HostOrder;
use crate::resource::memory_resource::{MemoryResource, Properties};
use crate::resource::suballoc::pool::{PoolMemoryResource, PoolOptions, PoolStats};
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

const NAME: &str = "GraphSafeMemoryResource";

/// What a [`GraphSafeMemoryResource`] needs to know about capture, behind a trait so that its
/// logic runs without a GPU.
pub trait CaptureQuery: Send + Sync + fmt::Debug {
    /// The id of the capture `stream` takes part in, or `None` when it is not captured.
    fn capture_id(&self, stream: StreamRef<'_>) -> Result<Option<u64>>;
    /// Runs `f` where synchronous allocator calls do not disturb a capture.
    fn relaxed(&self, f: &mut dyn FnMut());
    /// Waits for all work on the device (outside any capture), for upstreams that name no
    /// device.
    fn synchronize(&self) -> Result<()>;
}

/// The CUDA driver's view of capture (`cuStreamGetCaptureInfo`,
/// `cuThreadExchangeStreamCaptureMode`, `cuCtxSynchronize`).
#[derive(Clone, Copy, Debug, Default)]
pub struct DriverCapture;

impl CaptureQuery for DriverCapture {
    fn capture_id(&self, stream: StreamRef<'_>) -> Result<Option<u64>> {
        crate::driver::capture::capture_id(stream)
    }
    fn relaxed(&self, f: &mut dyn FnMut()) {
        crate::driver::capture::relaxed(f)
    }
    fn synchronize(&self) -> Result<()> {
        if crate::driver::init().is_err() {
            return Ok(());
        }
        Device::current()?.synchronize()
    }
}

/// Capture as a test says: streams are "captured" between [`begin`](Self::begin) and
/// [`end`](Self::end), with no driver.
#[derive(Debug, Default)]
pub struct SimulatedCapture {
    captures: Mutex<HashMap<StreamId, u64>>,
}

impl SimulatedCapture {
    /// No stream captured.
    pub fn new() -> Self {
        Self::default()
    }
    /// `stream` is captured, in capture `id`, from now on.
    pub fn begin(&self, stream: StreamRef<'_>, id: u64) {
        lock(&self.captures).insert(stream.id(), id);
    }
    /// `stream`'s capture ended.
    pub fn end(&self, stream: StreamRef<'_>) {
        lock(&self.captures).remove(&stream.id());
    }
}

impl CaptureQuery for SimulatedCapture {
    fn capture_id(&self, stream: StreamRef<'_>) -> Result<Option<u64>> {
        Ok(lock(&self.captures).get(&stream.id()).copied())
    }
    fn relaxed(&self, f: &mut dyn FnMut()) {
        f()
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
}

/// The upstream as a graph pool sees it: every call in a relaxed capture scope.
struct Relaxed<R> {
    upstream: R,
    query: Arc<dyn CaptureQuery>,
}

impl<R: fmt::Debug> fmt::Debug for Relaxed<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Relaxed").field(&self.upstream).finish()
    }
}

// SAFETY: pure delegation; only the thread's capture mode changes around the calls.
unsafe impl<R: MemoryResource> MemoryResource for Relaxed<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let mut out = None;
        self.query
            .relaxed(&mut || out = Some(self.upstream.allocate(stream, bytes, align)));
        out.expect("relaxed runs its closure")
    }
    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let mut out = None;
        self.query.relaxed(&mut || {
            // SAFETY: forwarded caller contract.
            out = Some(unsafe { self.upstream.deallocate(stream, ptr, bytes, align) })
        });
        out.expect("relaxed runs its closure")
    }
    fn properties(&self) -> Properties {
        self.upstream.properties()
    }
    fn device(&self) -> Option<Device> {
        self.upstream.device()
    }
}

/// The private pool of one capture.
struct GraphPool<R: MemoryResource + Clone> {
    pool: PoolMemoryResource<Relaxed<R>>,
    /// Blocks allocated in the capture: (bytes, align, freed by the client).
    blocks: HashMap<usize, (usize, usize, bool)>,
}

/// A snapshot of one graph pool.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GraphPoolStats {
    /// The capture id.
    pub capture: u64,
    /// Blocks allocated during the capture.
    pub blocks: usize,
    /// Of those, blocks the client freed (deferred).
    pub deferred_frees: usize,
    /// The pool's own state.
    pub pool: PoolStats,
}

/// Graph-capture-safe allocation over any upstream, as PyTorch's graph pools. Cheap to clone.
///
/// A request on a stream being captured is served from a private pool of that capture, grown
/// from the upstream with the thread's capture mode relaxed. Its blocks keep their addresses
/// after the capture, so the graph can be launched again and again; their frees (during the
/// capture or after) are deferred until [`release_graph_pool`](Self::release_graph_pool).
/// A free of an upstream block on a captured stream is done at the next call on a stream that
/// is not captured. Requests on other streams go to the upstream, which should be a synchronous
/// allocator
/// ([`CudaMemoryResource`](crate::CudaMemoryResource), a virtual-memory resource).
pub struct GraphSafeMemoryResource<R: MemoryResource + Clone> {
    inner: Arc<Inner<R>>,
}

struct Inner<R: MemoryResource + Clone> {
    upstream: R,
    query: Arc<dyn CaptureQuery>,
    /// Capture id -> its pool. Also indexes every graph block (by pool), so a free finds its
    /// pool without a driver call.
    pools: Mutex<HashMap<u64, GraphPool<R>>>,
    /// Frees of upstream blocks asked for on a captured stream (the upstream's free, e.g.
    /// cuMemFree, would invalidate the capture): done at the next call on a stream that is not
    /// captured, after a device-wide synchronisation. (address, bytes, align).
    pending: Mutex<Vec<(usize, usize, usize)>>,
}

impl<R: MemoryResource + Clone> Clone for GraphSafeMemoryResource<R> {
    fn clone(&self) -> Self {
        GraphSafeMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource + Clone> GraphSafeMemoryResource<R> {
    /// Graph-safe allocation over `upstream`, asking the driver about capture.
    pub fn new(upstream: R) -> Self {
        Self::with_query(upstream, Arc::new(DriverCapture))
    }

    /// Graph-safe allocation over `upstream`, asking `query` about capture.
    pub fn with_query(upstream: R, query: Arc<dyn CaptureQuery>) -> Self {
        GraphSafeMemoryResource {
            inner: Arc::new(Inner {
                upstream,
                query,
                pools: Mutex::new(HashMap::new()),
                pending: Mutex::new(Vec::new()),
            }),
        }
    }

    /// The upstream.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Every graph pool's state.
    pub fn graph_pools(&self) -> Vec<GraphPoolStats> {
        let pools = lock(&self.inner.pools);
        let mut out: Vec<GraphPoolStats> = pools
            .iter()
            .map(|(&capture, gp)| GraphPoolStats {
                capture,
                blocks: gp.blocks.len(),
                deferred_frees: gp.blocks.values().filter(|b| b.2).count(),
                pool: gp.pool.stats(),
            })
            .collect();
        out.sort_by_key(|s| s.capture);
        out
    }

    /// The capture whose pool holds `ptr`, if any.
    pub fn graph_pool_of(&self, ptr: NonNull<u8>) -> Option<u64> {
        let addr = ptr.as_ptr() as usize;
        lock(&self.inner.pools)
            .iter()
            .find(|(_, gp)| gp.blocks.contains_key(&addr))
            .map(|(&id, _)| id)
    }

    /// Frees capture `capture`'s pool, with every block in it (freed or not), back to the
    /// upstream, after waiting for the device. Returns the bytes returned.
    ///
    /// # Safety
    /// No graph captured with these blocks may be launched again (destroy them first), and no
    /// live pointer into the pool may be used again.
    pub unsafe fn release_graph_pool(&self, capture: u64) -> Result<usize> {
        self.synchronize()?;
        let Some(gp) = lock(&self.inner.pools).remove(&capture) else {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: no graph pool for capture {capture}"
            )));
        };
        let size = gp.pool.stats().pool_size;
        // Dropping the last handle returns every chunk to the upstream.
        drop(gp);
        Ok(size)
    }

    /// Upstream frees deferred by a capture and not done yet.
    pub fn pending_frees(&self) -> usize {
        lock(&self.inner.pending).len()
    }

    /// Does the upstream frees a capture deferred, on `stream` (not captured), once the work
    /// queued before them (on streams that may be gone) is done.
    fn flush_pending(&self, stream: StreamRef<'_>) -> Result<()> {
        self.synchronize()?;
        let pending = std::mem::take(&mut *lock(&self.inner.pending));
        let mut first_error = Ok(());
        for (addr, bytes, align) in pending {
            let ptr = NonNull::new(addr as *mut u8).expect("pending frees are non-null");
            // SAFETY: a block of the upstream the client freed (its contract), taken out of the
            // list so it is freed once; the device is idle, so no work uses it.
            let r = unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) };
            if first_error.is_ok() {
                first_error = r;
            }
        }
        first_error
    }

    /// Waits for the upstream's device (the query's idea of the device when the upstream has
    /// none).
    fn synchronize(&self) -> Result<()> {
        match self.inner.upstream.device() {
            Some(d) => d.synchronize(),
            None => self.inner.query.synchronize(),
        }
    }

    /// The capture `stream` is in, asked in the upstream device's context (the legacy stream
    /// is per context).
    fn capture_of(&self, stream: StreamRef<'_>) -> Result<Option<u64>> {
        if let Some(d) = self.inner.upstream.device() {
            d.bind()?;
        }
        self.inner.query.capture_id(stream)
    }
}

// SAFETY: blocks come from the upstream (outside capture) or from a private pool over it, both
// upholding the contract; a graph block is never handed out again before its pool is released.
unsafe impl<R: MemoryResource + Clone> MemoryResource for GraphSafeMemoryResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let Some(capture) = self.capture_of(stream)? else {
            if !lock(&self.inner.pending).is_empty() {
                self.flush_pending(stream)?;
            }
            return self.inner.upstream.allocate(stream, bytes, align);
        };
        let mut pools = lock(&self.inner.pools);
        let gp = match pools.entry(capture) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                // No driver call may order streams inside a capture: host ordering, and no
                // block is reused before the pool is released.
                let pool = PoolMemoryResource::new(
                    Relaxed {
                        upstream: self.inner.upstream.clone(),
                        query: self.inner.query.clone(),
                    },
                    PoolOptions::new(0).order(Arc::new(HostOrder)),
                )?;
                e.insert(GraphPool {
                    pool,
                    blocks: HashMap::new(),
                })
            }
        };
        let p = gp.pool.allocate(stream, bytes, align)?;
        gp.blocks.insert(p.as_ptr() as usize, (bytes, align, false));
        Ok(p)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        {
            let mut pools = lock(&self.inner.pools);
            for gp in pools.values_mut() {
                if let Some(block) = gp.blocks.get_mut(&addr) {
                    if block.2 {
                        return Err(Error::DoubleFree {
                            resource: NAME,
                            ptr: addr,
                        });
                    }
                    if block.0 != bytes {
                        return Err(Error::SizeMismatch {
                            resource: NAME,
                            ptr: addr,
                            allocated: block.0,
                            freed: bytes,
                        });
                    }
                    // Deferred: the graph may still be launched with this address.
                    block.2 = true;
                    return Ok(());
                }
            }
        }
        if self.capture_of(stream)?.is_some() {
            lock(&self.inner.pending).push((addr, bytes, align));
            return Ok(());
        }
        if !lock(&self.inner.pending).is_empty() {
            self.flush_pending(stream)?;
        }
        // SAFETY: not a graph block, so it came from the upstream: the caller's contract.
        unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) }
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }

    fn device(&self) -> Option<Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let pools = self.graph_pools();
        let sum = |f: fn(&GraphPoolStats) -> usize| pools.iter().map(f).sum::<usize>();
        let (in_use, held) = (sum(|g| g.pool.bytes_in_use), sum(|g| g.pool.pool_size));
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: in_use,
            bytes_reserved: Some(held),
            peak_bytes: None,
            live_blocks: Some(sum(|g| g.pool.live_blocks)),
            detail: vec![
                (c"graph_pools", n(pools.len())),
                (c"blocks", n(sum(|g| g.blocks))),
                (c"deferred_frees", n(sum(|g| g.deferred_frees))),
                (c"pool_size", n(held)),
                (c"bytes_in_use", n(in_use)),
            ],
        }))
    }
}

impl<R: MemoryResource + Clone> fmt::Debug for GraphSafeMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("upstream", &self.inner.upstream)
            .field("graph_pools", &self.graph_pools())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::source::simulated::SimulatedMemoryResource;

    const S: StreamRef<'static> = StreamRef::simulated(1);
    const T: StreamRef<'static> = StreamRef::simulated(2);

    fn nn(a: usize) -> NonNull<u8> {
        NonNull::new(a as *mut u8).unwrap()
    }

    #[test]
    fn captured_blocks_come_from_a_private_pool_and_their_frees_wait_for_release() {
        let sim = SimulatedMemoryResource::new(1 << 30).unwrap();
        let capture = Arc::new(SimulatedCapture::new());
        let r = GraphSafeMemoryResource::with_query(sim.clone(), capture.clone());
        let outside = r.allocate(T, 1000, 256).unwrap();
        capture.begin(S, 7);
        let a = r.allocate(S, 4096, 256).unwrap();
        let b = r.allocate(S, 100, 256).unwrap();
        // SAFETY: simulated memory; `a` came from `r`.
        unsafe { r.deallocate(S, a, 4096, 256) }.unwrap();
        // Freed in the capture, but not reused: the graph still writes to `a`.
        let c = r.allocate(S, 4096, 256).unwrap();
        assert_ne!(c, a);
        capture.end(S);
        assert_eq!(r.graph_pool_of(a), Some(7));
        assert_eq!(r.graph_pool_of(outside), None);
        let stats = r.graph_pools();
        assert_eq!((stats[0].blocks, stats[0].deferred_frees), (3, 1));
        // After the capture, frees of graph blocks are still deferred.
        // SAFETY: as above.
        unsafe {
            assert!(matches!(
                r.deallocate(T, a, 4096, 256),
                Err(Error::DoubleFree { .. })
            ));
            assert!(matches!(
                r.deallocate(T, b, 99, 256),
                Err(Error::SizeMismatch { .. })
            ));
            r.deallocate(T, b, 100, 256).unwrap();
            r.deallocate(T, outside, 1000, 256).unwrap();
        }
        let held = sim.usage().used;
        assert!(held > 0);
        // A block from before the capture, freed inside it: the upstream's free waits for a
        // stream that is not captured.
        let before = r.allocate(T, 512, 256).unwrap();
        capture.begin(S, 8);
        // SAFETY: from `r` with these arguments.
        unsafe { r.deallocate(S, before, 512, 256) }.unwrap();
        assert_eq!(r.pending_frees(), 1);
        capture.end(S);
        let after = r.allocate(T, 512, 256).unwrap();
        assert_eq!(r.pending_frees(), 0);
        // SAFETY: from `r` with these arguments.
        unsafe { r.deallocate(T, after, 512, 256) }.unwrap();
        // SAFETY: no graph uses the pool (there is none), and no pointer into it is used.
        let released = unsafe { r.release_graph_pool(7) }.unwrap();
        assert_eq!(released, held);
        assert_eq!(sim.usage().used, 0);
        assert!(r.graph_pools().is_empty());
        // SAFETY: as above.
        assert!(unsafe { r.release_graph_pool(7) }.is_err());
        // Unknown pointers go to the upstream, which refuses them.
        // SAFETY: a refused free changes nothing.
        assert!(unsafe { r.deallocate(T, nn(0x10), 8, 256) }.is_err());
    }
}
