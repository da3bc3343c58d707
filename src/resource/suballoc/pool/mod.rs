//! [`PoolMemoryResource`]: a coalescing, stream-ordered suballocator in RMM's pool role, that
//! scales with threads.
//!
//! Unlike RMM's pool, free blocks are indexed in O(1) size classes and coalesce through
//! neighbour links (so it does not collapse with many live blocks), a free records no event
//! (a stream is marked once per [`MARK_EVERY`](crate::resource::MARK_EVERY) frees), and
//! [`release`](PoolMemoryResource::release) returns empty chunks.
//!
//! **Shards.** Streams are spread over *shards* (round-robin on first use, see [`shards`]),
//! each a `PoolCore` (the coalescing engine) behind its own lock, so threads on different streams never share
//! a lock. Shards carve *slabs* they take from the *global* core, which holds the upstream
//! chunks; its lock is taken only when a shard needs a slab (a shard doubles each time, up to
//! steps of 512 MiB, so that is rare; the pool grows by what the shard takes, not by its own size, which with many shards
//! would compound). A block freed on a stream of another shard goes back to the shard that
//! carved it, tagged with the freeing stream and sealed by an event recorded at once, so the
//! owning shard's streams take it after one `cuStreamWaitEvent`.
//!
//! **Synchronisation.** The whole device is synchronised in two cases only. A shard that is at
//! least half free yet cannot serve a request while other streams hold free memory in it
//! merges after one synchronisation, before it grows. And as a last resort before reporting
//! out-of-memory (and in [`release`](PoolMemoryResource::release) and on drop), every shard's
//! free memory goes back to the global core.
//!
//! **Bounded memory.** A shard grows only when less than half of it is free (or the merge left
//! no block that fits), and then at most doubles, so it holds at most four times its own live
//! peak plus its smallest slab (256 KiB), whichever streams free its blocks; unless
//! fragmentation leaves no free run that fits a request. Shards keep their slabs until the
//! upstream runs out or [`release`](PoolMemoryResource::release), so the pool holds at most four
//! times the sum of its shards' live peaks, plus a slab per shard
//! (`tests/bounded_memory.rs`).
//!
//! **Failures.** A chunk whose upstream free fails stays in the pool, usable, and is tried again
//! by the next `release` and on drop. If the device cannot be synchronised on drop, the chunks
//! leak (queued work may still use them) and the error is recorded
//! ([`crate::take_deferred_error`]). A [`StreamOrder`] call that fails or panics leaves the
//! pool consistent: blocks are carved only after the ordering call that makes them safe has
//! returned, and a free takes effect before its stream is marked, so a free that unwinds has
//! freed its block.
//!
//! **Stream lifetime.** The pool names a stream to the driver only inside a call on that
//! stream (see the coalescing engine, `resource::coalescing`), so streams may be destroyed while blocks freed on them sit in the
//! pool. (A new stream that the driver gives a destroyed one's handle is taken for it.)

mod shards;
mod upkeep;

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use self::shards::ShardMap;
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::engine::coalescing::{
    allocate_from, footprint, free_into, OnStream, PoolCore, Reach, GRAIN,
};
use crate::resource::engine::stream_order::default_order;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{align_up, check_request, MemoryResource, Properties};
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

/// The smallest slab a shard takes from the global core.
const MIN_SLAB: usize = 256 << 10;

/// A shard doubles up to slabs of this size, then grows by it (or by the request). Doubling
/// without bound reserved 1.52-1.74x the logical peak replaying PyTorch traces (each last
/// doubling mostly unused); capped here, 1.10-1.11x, for one to four more upstream calls
/// (`carve replay tests/data/{synthetic_transformer,torch_gpt_small}.csv --simulate-capacity
/// 80`).
const MAX_DOUBLING: usize = 512 << 20;

const NAME: &str = "PoolMemoryResource";

/// How a pool is sized and ordered.
#[derive(Clone, Default)]
pub struct PoolOptions {
    /// Bytes reserved from the upstream at construction (0: none until the first request).
    pub initial_size: usize,
    /// Upper bound on the pool's total size; `None` for no bound.
    pub maximum_size: Option<usize>,
    /// How streams are ordered; `None` picks events on the upstream's device for
    /// device-accessible upstreams and nothing for host memory.
    pub order: Option<Arc<dyn StreamOrder>>,
    /// Shards (independent free lists, each behind its own lock) that streams are spread over;
    /// 0: twice the available parallelism, at least 8; at most [`Self::MAX_SHARDS`].
    pub shards: usize,
}

impl PoolOptions {
    /// The most shards a pool takes (`shards` above this is [`Error::InvalidArgument`]).
    pub const MAX_SHARDS: usize = 4096;

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
    /// Spreads streams over `n` shards (1: one lock for all streams).
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = n;
        self
    }
}

impl fmt::Debug for PoolOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolOptions")
            .field("initial_size", &self.initial_size)
            .field("maximum_size", &self.maximum_size)
            .field("order", &self.order)
            .field("shards", &self.shards)
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
    /// Slabs that shards hold from the global core.
    pub slabs: usize,
}

/// A coalescing pool over any upstream `R`. Cheap to clone (clones share the pool).
pub struct PoolMemoryResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

/// What the global core gave a shard.
enum Slab {
    /// A slab: base and size.
    Got(usize, usize),
    /// None: the upstream is exhausted, so every shard's free memory was merged (after a
    /// device-wide synchronisation) and the request did not fit in the global core; it may
    /// still fit in some shard's free memory.
    Gathered(Error),
}

/// One shard's free lists, on its own cache lines.
#[repr(align(128))]
struct Shard {
    core: Mutex<PoolCore>,
}

struct Inner<R: MemoryResource> {
    upstream: R,
    maximum: Option<usize>,
    order: Arc<dyn StreamOrder>,
    /// Upstream chunks; each shard's slabs are live blocks here. Locked only to hand out slabs
    /// (and to take them back when gathering). Lock order: global before shards; no thread
    /// waits for the global lock while holding a shard's, and only `gather` holds several
    /// shards (all of them, in index order).
    global: Mutex<PoolCore>,
    shards: Box<[Shard]>,
    map: ShardMap,
}

impl<R: MemoryResource> Clone for PoolMemoryResource<R> {
    fn clone(&self) -> Self {
        PoolMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

fn non_null(addr: usize) -> NonNull<u8> {
    NonNull::new(addr as *mut u8).expect("chunk and slab bases are non-null")
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
        let shards = match options.shards {
            0 => (2 * std::thread::available_parallelism().map_or(4, |n| n.get())).max(8),
            n => crate::resource::suballoc::limits::count(
                NAME,
                "shards",
                n,
                PoolOptions::MAX_SHARDS,
            )?,
        };
        let pool = PoolMemoryResource {
            inner: Arc::new(Inner {
                upstream,
                maximum: options.maximum_size,
                order,
                global: Mutex::new(PoolCore::default()),
                shards: (0..shards)
                    .map(|_| Shard {
                        core: Mutex::new(PoolCore::default()),
                    })
                    .collect(),
                map: ShardMap::new(shards),
            }),
        };
        if initial > 0 {
            let base = pool
                .inner
                .upstream
                .allocate(StreamRef::DEFAULT, initial, GRAIN)?;
            let mut global = lock(&pool.inner.global);
            global.add_chunk(base.as_ptr() as usize, initial, Some(StreamId::DEFAULT));
            // Once the allocation is known complete, every stream may take the chunk. (On
            // failure, dropping the pool returns it.)
            pool.inner.order.synchronize_all()?;
            global.merge_all();
        }
        Ok(pool)
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// A slab of at least `needed` bytes for `stream`'s shard (holding `held` bytes). The shard
    /// doubles (up to [`MAX_DOUBLING`]): a slab of `held` bytes from free global
    /// memory, else from growth; failing both (the upstream or the maximum is exhausted), the
    /// smallest slab that serves the request, then everything the shards hold free, after a
    /// device-wide synchronisation.
    fn slab_for(
        &self,
        global: &mut PoolCore,
        stream: StreamRef<'_>,
        held: usize,
        bytes: usize,
        needed: usize,
    ) -> Result<Slab> {
        let desired =
            align_up(needed.max(held.min(MAX_DOUBLING)).max(MIN_SLAB), GRAIN).unwrap_or(needed);
        let take = |global: &mut PoolCore, sizes: &[usize]| -> Result<Option<Slab>> {
            for &want in sizes {
                let got = allocate_from(
                    global,
                    &*self.inner.order,
                    OnStream::new(stream),
                    want,
                    GRAIN,
                    Reach::Events,
                    None,
                )?;
                if let Some(p) = got {
                    return Ok(Some(Slab::Got(p.as_ptr() as usize, want)));
                }
            }
            Ok(None)
        };
        if let Some(slab) = take(global, &[desired])? {
            return Ok(slab);
        }
        match self.grow(global, stream, bytes, needed, desired) {
            Ok(()) => {}
            Err(e) if e.is_out_of_memory() => {
                if let Some(slab) = take(global, &[needed])? {
                    return Ok(slab);
                }
                self.gather(global)?;
                return Ok(take(global, &[needed])?.unwrap_or(Slab::Gathered(e)));
            }
            Err(e) => return Err(e),
        }
        take(global, &[desired, needed])?.ok_or_else(|| Error::OutOfMemory {
            bytes,
            resource: NAME,
            detail: "a fresh chunk did not fit the request".to_owned(),
        })
    }

    /// Grows the global core by at least `needed` bytes: tries `desired` (the shard's own
    /// doubling, not the whole pool's: with many shards that would compound), bounded by the
    /// maximum, halving on upstream failure.
    fn grow(
        &self,
        core: &mut PoolCore,
        stream: StreamRef<'_>,
        bytes: usize,
        needed: usize,
        desired: usize,
    ) -> Result<()> {
        let current = core.pool_size();
        let room = self
            .inner
            .maximum
            .map_or(usize::MAX, |m| m.saturating_sub(current));
        let oom = |why: String| Error::OutOfMemory {
            bytes,
            resource: NAME,
            detail: format!(
                "{why}; pool holds {current} bytes (maximum {})",
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
        let mut attempt = (desired.min(room) & !(GRAIN - 1)).max(needed);
        loop {
            match self.inner.upstream.allocate(stream, attempt, GRAIN) {
                Ok(p) => {
                    core.add_chunk(p.as_ptr() as usize, attempt, Some(stream.id()));
                    // Mark now so other streams can take the rest with one wait; a failed mark
                    // only keeps it private to `stream` for a while.
                    if self.inner.order.mark(stream).is_ok() {
                        core.seal(stream.id());
                    }
                    return Ok(());
                }
                Err(e) if e.is_out_of_memory() && attempt > needed => {
                    attempt = ((attempt / 2) & !(GRAIN - 1)).max(needed);
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

    /// Frees into shard `i`; `Ok(false)` when the block is not one of its live blocks.
    #[inline]
    fn free_in_shard(
        &self,
        i: usize,
        on: OnStream<'_>,
        addr: usize,
        bytes: usize,
        foreign: bool,
    ) -> Result<bool> {
        let mut core = lock(&self.inner.shards[i].core);
        // A block freed on a stream of another shard is sealed at once: the shard's own
        // streams reach it with one event wait.
        // An empty slab stays with the shard: giving slabs back on a free makes a shard that
        // is short of contiguous room take and return small slabs over and over. Slabs go back
        // only when the upstream is exhausted (`gather`) and in `release`.
        let order = &*self.inner.order;
        match free_into(&mut core, order, NAME, on, addr, bytes, foreign) {
            Ok(_) => Ok(true),
            Err(Error::UnknownPointer { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

// SAFETY: blocks are carved from upstream chunks that the upstream guarantees disjoint and live:
// the global core tiles each chunk exactly and hands each slab to one shard, whose core tiles
// the slab exactly (both checked by `check_invariants`); each range is handed out once, aligned
// to the request, and a free block reaches another stream only after ordering it.
unsafe impl<R: MemoryResource> MemoryResource for PoolMemoryResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, GRAIN)?;
        let (_, needed) = footprint(bytes, align).ok_or(Error::SizeOverflow { bytes, align })?;
        // Taken once: a default stream's id asks the driver for the current context.
        let on = OnStream::new(stream);
        let id = on.id;
        let shard = &self.inner.shards[self.inner.map.shard_of(id)];
        let order = &*self.inner.order;
        loop {
            let held = {
                let mut core = lock(&shard.core);
                if let Some(p) =
                    allocate_from(&mut core, order, on, bytes, align, Reach::Events, None)?
                {
                    return Ok(p);
                }
                // At least half the shard is free, yet nothing fits, and other streams hold
                // free memory (blocks freed on one stream merge only with that stream's, and
                // reach others only through an event or a synchronisation), possibly all of
                // it.
                // Merging it all after one synchronisation costs less than growing: a soak
                // whose threads free each other's blocks otherwise doubled the shard without
                // end (a hundred times its live bytes). The shard's lock is held throughout, so
                // no free slips in between the synchronisation and the merge.
                let free = core.pool_size() - core.in_use();
                if free >= needed && free >= core.pool_size() / 2 && core.others_hold_free(id) {
                    order.synchronize_all()?;
                    core.merge_all();
                    if let Some(p) = core.take(id, bytes, align) {
                        return Ok(p);
                    }
                }
                core.pool_size()
            };
            // No shard lock is held while the global one is taken.
            let mut global = lock(&self.inner.global);
            match self.slab_for(&mut global, stream, held, bytes, needed)? {
                Slab::Got(base, size) => {
                    // The shard locks before the global lock goes, so `check_invariants` never
                    // sees the slab handed out but held by no shard.
                    let mut core = lock(&shard.core);
                    drop(global);
                    core.add_chunk(base, size, Some(id));
                    if let Some(p) = core.take(id, bytes, align) {
                        return Ok(p);
                    }
                    // Another thread on this stream took the slab first: start over.
                }
                // Every free block is now free to any stream, wherever it lies: take one from
                // whichever shard holds it (the block stays that shard's), else out of memory.
                Slab::Gathered(e) => {
                    drop(global);
                    for other in self.inner.shards.iter() {
                        let mut core = lock(&other.core);
                        let got =
                            allocate_from(&mut core, order, on, bytes, align, Reach::Events, None)?;
                        if let Some(p) = got {
                            return Ok(p);
                        }
                    }
                    return Err(e);
                }
            }
        }
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        let on = OnStream::new(stream);
        let id = on.id;
        let mine = self.inner.map.shard_of(id);
        if self.free_in_shard(mine, on, addr, bytes, false)? {
            return Ok(());
        }
        // Allocated on a stream of another shard.
        let n = self.inner.shards.len();
        for i in (1..n).map(|k| (mine + k) % n) {
            if self.free_in_shard(i, on, addr, bytes, true)? {
                return Ok(());
            }
        }
        Err(Error::UnknownPointer {
            resource: NAME,
            ptr: addr,
        })
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: s.bytes_in_use,
            bytes_reserved: Some(s.pool_size),
            peak_bytes: None,
            live_blocks: Some(s.live_blocks),
            detail: vec![
                (c"pool_size", n(s.pool_size)),
                (c"bytes_in_use", n(s.bytes_in_use)),
                (c"free_bytes", n(s.free_bytes)),
                (c"largest_free_block", n(s.largest_free_block)),
                (c"fragmentation", s.fragmentation),
                (c"live_blocks", n(s.live_blocks)),
                (c"chunks", n(s.chunks)),
            ],
        }))
    }
    fn release_unused(&self) -> crate::error::Result<usize> {
        self.release()
    }
}

impl<R: MemoryResource> fmt::Debug for PoolMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("upstream", &self.inner.upstream)
            .field("shards", &self.inner.shards.len())
            .field("stats", &self.stats())
            .finish()
    }
}
