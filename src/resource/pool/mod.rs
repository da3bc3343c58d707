//! [`PoolMemoryResource`]: a coalescing, stream-ordered suballocator in RMM's pool role.
//!
//! Unlike RMM's pool, free blocks are indexed in O(1) size classes and coalesce through
//! neighbour links (so it does not collapse with many live blocks), a free records no event
//! (a stream is marked once per [`MARK_EVERY`](super::MARK_EVERY) frees), free blocks of
//! all streams are merged before the pool grows, and
//! [`release`](PoolMemoryResource::release) returns empty chunks.
//!
//! **Stream lifetime.** The pool names a stream to the driver only inside a call on that
//! stream (see the coalescing engine, `resource::coalescing`), so streams may be destroyed while blocks freed on them sit in the
//! pool. (A new stream that the driver gives a destroyed one's handle is taken for it.)

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::coalescing::core::{allocate_from, footprint, free_into, PoolCore, GRAIN};
use super::stream_order::default_order;
use super::{align_up, check_request, MemoryResource, Properties, StreamOrder};
use crate::error::{Error, Result};
use crate::stream::StreamRef;

const NAME: &str = "PoolMemoryResource";

/// How a pool is sized and ordered.
#[derive(Clone, Default)]
pub struct PoolOptions {
    /// Bytes reserved from the upstream at construction (0: none until the first request).
    pub initial_size: usize,
    /// Upper bound on the pool's total size; `None` for no bound.
    pub maximum_size: Option<usize>,
    /// How streams are ordered; `None` picks events for device-accessible upstreams and nothing
    /// for host memory.
    pub order: Option<Arc<dyn StreamOrder>>,
}

impl PoolOptions {
    /// Options with an initial size and no maximum.
    pub fn new(initial_size: usize) -> Self {
        PoolOptions {
            initial_size,
            ..Self::default()
        }
    }
    /// Bounds the pool.
    pub fn maximum(mut self, bytes: usize) -> Self {
        self.maximum_size = Some(bytes);
        self
    }
    /// Uses `order` between streams.
    pub fn order(mut self, order: Arc<dyn StreamOrder>) -> Self {
        self.order = Some(order);
        self
    }
}

impl fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolOptions")
            .field("initial_size", &self.initial_size)
            .field("maximum_size", &self.maximum_size)
            .field("order", &self.order)
            .finish()
    }
}

/// A snapshot of a pool's state.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolStats {
    /// Bytes held from the upstream.
    pub pool_size: usize,
    /// Bytes in live blocks (rounded to 256 B blocks).
    pub bytes_in_use: usize,
    /// `pool_size - bytes_in_use`.
    pub free_bytes: usize,
    /// The largest single free block.
    pub largest_free_block: usize,
    /// `1 - largest_free_block / free_bytes`: 0 when free memory is one block, near 1 when it is
    /// scattered (0 when nothing is free).
    pub fragmentation: f64,
    /// Live blocks.
    pub live_blocks: usize,
    /// Upstream chunks held.
    pub chunks: usize,
}

/// A coalescing pool over any upstream `R`. Cheap to clone (clones share the pool).
pub struct PoolMemoryResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

struct Inner<R: MemoryResource> {
    upstream: R,
    maximum: Option<usize>,
    order: Arc<dyn StreamOrder>,
    core: Mutex<PoolCore>,
}

impl<R: MemoryResource> Clone for PoolMemoryResource<R> {
    fn clone(&self) -> Self {
        PoolMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> PoolMemoryResource<R> {
    /// A pool over `upstream`, reserving `options.initial_size` bytes now (on the default
    /// stream, synchronised, so every stream may take them).
    pub fn new(upstream: R, options: PoolOptions) -> Result<Self> {
        let order = match options.order {
            Some(o) => o,
            None => default_order(&upstream)?,
        };
        let initial = align_up(options.initial_size, GRAIN).ok_or(Error::SizeOverflow {
            bytes: options.initial_size,
            align: GRAIN,
        })?;
        if let Some(max) = options.maximum_size {
            if initial > max {
                return Err(Error::InvalidArgument(format!(
                    "{NAME}: initial size {initial} exceeds the maximum {max}"
                )));
            }
        }
        let pool = PoolMemoryResource {
            inner: Arc::new(Inner {
                upstream,
                maximum: options.maximum_size,
                order,
                core: Mutex::new(PoolCore::default()),
            }),
        };
        if initial > 0 {
            let base = pool
                .inner
                .upstream
                .allocate(StreamRef::DEFAULT, initial, GRAIN)?;
            pool.lock()
                .add_chunk(base.as_ptr() as usize, initial, Some(StreamRef::DEFAULT));
            // Once the allocation is known complete, every stream may take the chunk. (On
            // failure, dropping the pool returns it.)
            pool.inner.order.synchronize_all()?;
            pool.lock().merge_all();
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Size, use and fragmentation now.
    pub fn stats(&self) -> PoolStats {
        let mut core = self.lock();
        let free = core.pool_size() - core.in_use();
        let largest = core.largest_free();
        PoolStats {
            pool_size: core.pool_size(),
            bytes_in_use: core.in_use(),
            free_bytes: free,
            largest_free_block: largest,
            fragmentation: if free == 0 {
                0.0
            } else {
                1.0 - largest as f64 / free as f64
            },
            live_blocks: core.live_count(),
            chunks: core.chunk_count(),
        }
    }

    /// Returns every upstream chunk with no live block to the upstream, after waiting for all
    /// work on the device (so no stream handle is needed). Returns the bytes released.
    pub fn release(&self) -> Result<usize> {
        let mut core = self.lock();
        // Free blocks of different streams never coalesce; after the synchronisation they are
        // all free to any stream, and merge, so an empty chunk is one block.
        self.inner.order.synchronize_all()?;
        core.merge_all();
        let mut released = 0;
        for (base, size) in core.empty_chunks() {
            core.remove_chunk(base);
            let ptr = NonNull::new(base as *mut u8).expect("chunk bases are non-null");
            // SAFETY: the chunk came from the upstream with this size and GRAIN alignment, and
            // has just left our index, so it is returned exactly once. All work is done.
            unsafe {
                self.inner
                    .upstream
                    .deallocate(StreamRef::DEFAULT, ptr, size, GRAIN)?
            };
            released += size;
        }
        Ok(released)
    }

    /// Checks the pool's internal invariants (tiling, coalescing, indexes, counters).
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.lock().check_invariants()
    }

    fn lock(&self) -> MutexGuard<'_, PoolCore> {
        // Every mutation of the core completes before it can panic (no upstream call or user
        // code runs mid-update), so a poisoned lock still guards a consistent core.
        self.inner
            .core
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Grows by at least `needed` bytes: tries max(needed, pool size), bounded by the maximum,
    /// halving on upstream failure.
    fn grow(
        &self,
        core: &mut PoolCore,
        stream: StreamRef,
        bytes: usize,
        needed: usize,
    ) -> Result<()> {
        let current = core.pool_size();
        let room = self
            .inner
            .maximum
            .map_or(usize::MAX, |m| m.saturating_sub(current));
        let (in_use, largest) = (core.in_use(), core.largest_free());
        let oom = |why: String| Error::OutOfMemory {
            bytes,
            resource: NAME,
            detail: format!(
                "{why}; pool holds {current} bytes ({in_use} in use, largest free block \
                 {largest}, maximum {})",
                self.inner
                    .maximum
                    .map_or("none".to_owned(), |m| m.to_string())
            ),
        };
        if needed > room {
            return Err(oom(format!(
                "growing by {needed} bytes would pass the maximum"
            )));
        }
        let mut attempt = needed.max(current).min(room) & !(GRAIN - 1);
        loop {
            match self.inner.upstream.allocate(stream, attempt, GRAIN) {
                Ok(p) => {
                    core.add_chunk(p.as_ptr() as usize, attempt, Some(stream));
                    // Mark now so other streams can take the rest with one wait; a failed mark
                    // only keeps it private to `stream` for a while.
                    if self.inner.order.mark(stream).is_ok() {
                        core.seal(stream);
                    }
                    return Ok(());
                }
                Err(e) if e.is_out_of_memory() && attempt > needed => {
                    attempt = (attempt / 2).max(needed) & !(GRAIN - 1);
                    attempt = attempt.max(needed);
                }
                Err(e) if e.is_out_of_memory() => {
                    return Err(oom(format!(
                        "the upstream could not supply {attempt} bytes: {e}"
                    )))
                }
                Err(e) => return Err(e),
            }
        }
    }
}

// SAFETY: blocks are carved from upstream chunks that the upstream guarantees disjoint and live;
// the core tiles each chunk exactly (checked by `check_invariants`), hands out each range once,
// aligns to the request, and hands a free block to another stream only after ordering it.
unsafe impl<R: MemoryResource> MemoryResource for PoolMemoryResource<R> {
    fn allocate(&self, stream: StreamRef, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, GRAIN)?;
        let (_, needed) = footprint(bytes, align).ok_or(Error::SizeOverflow { bytes, align })?;
        let mut core = self.lock();
        if let Some(p) = allocate_from(&mut core, &*self.inner.order, stream, bytes, align)? {
            return Ok(p);
        }
        self.grow(&mut core, stream, bytes, needed)?;
        core.take(stream, bytes, align)
            .ok_or_else(|| Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: "a fresh chunk did not fit the request".to_owned(),
            })
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        let mut core = self.lock();
        free_into(
            &mut core,
            &*self.inner.order,
            NAME,
            stream,
            ptr.as_ptr() as usize,
            bytes,
        )
        .map(drop)
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        // Blocks may still be in use by queued work on any stream; the upstream may reuse the
        // chunks at once. Drop cannot report a failure.
        let _ = self.order.synchronize_all();
        let core = self.core.get_mut().unwrap_or_else(PoisonError::into_inner);
        for (base, size) in core.chunks() {
            let ptr = NonNull::new(base as *mut u8).expect("chunk bases are non-null");
            // SAFETY: each chunk came from the upstream with this size and alignment and is
            // returned once, as the last handle to the pool goes away. Drop cannot report.
            let _ = unsafe {
                self.upstream
                    .deallocate(StreamRef::DEFAULT, ptr, size, GRAIN)
            };
        }
    }
}

impl<R: MemoryResource> fmt::Debug for PoolMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("upstream", &self.inner.upstream)
            .field("stats", &self.stats())
            .finish()
    }
}
