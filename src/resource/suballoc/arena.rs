//! [`ArenaMemoryResource`]: per-thread arenas over a global arena of superblocks, in RMM's arena
//! role.
//!
//! Each thread allocates from its own arena (one of a fixed set, picked by a per-thread ticket),
//! so threads do not contend. An arena carves superblocks it takes from the global arena, a
//! [`PoolMemoryResource`] over the upstream, with the pool's coalescing, stream-tagged index.
//! A superblock that empties goes back to the global arena (one spare is kept per arena, so a
//! thread freeing and allocating its last block does not bounce). Requests above a quarter of a
//! superblock go to the global arena directly.
//!
//! **Bounded memory.** Before an arena takes a new superblock, if at least half of it is free and
//! other streams hold free memory in it, it merges all its free memory after one device-wide
//! synchronisation and tries again. So an arena holds at most twice its live peak plus two
//! superblocks (the one it fills and a spare), and the global arena, a pool, at most four times
//! what it hands out (see [`PoolMemoryResource`]'s bound). Together, for small blocks and whichever
//! streams or threads free them: held ≤ 8 × live peak + (8 × arenas + 2 × shards) × superblock,
//! unless fragmentation leaves no free run that fits a request (`tests/bounded_memory.rs`).
//!
//! **Failures.** The arena asks the global arena (and so the upstream) for superblocks without
//! its lock held, so an upstream that calls back into the arena (a failure callback that frees)
//! does not deadlock. A superblock the global arena refuses to take back stays in the arena.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::engine::coalescing::{
    allocate_from, footprint, free_into, OnStream, PoolCore, Reach, GRAIN,
};
use crate::resource::engine::stream_order::default_order;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{check_request, MemoryResource, Properties};
use crate::resource::suballoc::pool::{PoolMemoryResource, PoolOptions, PoolStats};
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

const NAME: &str = "ArenaMemoryResource";

/// How an arena resource is shaped.
#[derive(Clone, Debug, Default)]
pub struct ArenaOptions {
    /// Superblock size (0: 32 MiB). Rounded up to 256 bytes. Larger superblocks mean fewer
    /// trips to the global arena, whose lock all threads share, at the cost of up to two
    /// superblocks (one in use, one spare) held per active arena.
    pub superblock_size: usize,
    /// Number of per-thread arenas (0: twice the available parallelism; at most
    /// [`Self::MAX_ARENAS`]).
    pub arenas: usize,
    /// Options of the global arena (sizes, ordering).
    pub global: PoolOptions,
}

impl ArenaOptions {
    /// The most per-thread arenas (`arenas` above this is [`Error::InvalidArgument`]).
    pub const MAX_ARENAS: usize = 4096;
}

/// A snapshot of an arena resource.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ArenaStats {
    /// The global arena: superblocks handed to arenas and large blocks count as in use.
    pub global: PoolStats,
    /// Superblocks held by per-thread arenas.
    pub superblocks: usize,
    /// Bytes in live blocks, from arenas and the global arena's large blocks alike.
    pub bytes_in_use: usize,
}

/// Per-thread arenas over any upstream `R`. Cheap to clone.
pub struct ArenaMemoryResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

impl<R: MemoryResource> Clone for ArenaMemoryResource<R> {
    fn clone(&self) -> Self {
        ArenaMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

#[repr(align(128))]
struct Arena {
    core: Mutex<ArenaCore>,
}

#[derive(Default)]
struct ArenaCore {
    index: PoolCore,
    /// An empty superblock kept back from the global arena.
    spare: Option<usize>,
}

struct Inner<R: MemoryResource> {
    global: PoolMemoryResource<R>,
    order: Arc<dyn StreamOrder>,
    superblock: usize,
    arenas: Box<[Arena]>,
}

/// A small number per thread, handed out in order, so concurrent threads land on distinct
/// arenas. It is a process-wide ticket that no loom model exercises, so it is a plain std
/// atomic (loom's cannot be statics).
fn thread_ticket() -> usize {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static TICKET: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    TICKET.with(|t| *t)
}

impl<R: MemoryResource> ArenaMemoryResource<R> {
    /// Arenas over `upstream`.
    pub fn new(upstream: R, options: ArenaOptions) -> Result<Self> {
        let superblock = match options.superblock_size {
            0 => 32 << 20,
            n => {
                crate::resource::memory_resource::align_up(n, GRAIN).ok_or(Error::SizeOverflow {
                    bytes: n,
                    align: GRAIN,
                })?
            }
        };
        let arenas = match options.arenas {
            0 => 2 * std::thread::available_parallelism().map_or(4, |n| n.get()),
            n => crate::resource::suballoc::limits::count(
                NAME,
                "arenas",
                n,
                ArenaOptions::MAX_ARENAS,
            )?,
        };
        let mut global_opts = options.global;
        let order = match &global_opts.order {
            Some(o) => o.clone(),
            None => default_order(&upstream)?,
        };
        global_opts.order = Some(order.clone());
        Ok(ArenaMemoryResource {
            inner: Arc::new(Inner {
                global: PoolMemoryResource::new(upstream, global_opts)?,
                order,
                superblock,
                arenas: (0..arenas)
                    .map(|_| Arena {
                        core: Mutex::new(ArenaCore::default()),
                    })
                    .collect(),
            }),
        })
    }

    /// The global arena.
    pub fn global(&self) -> &PoolMemoryResource<R> {
        &self.inner.global
    }

    fn is_large(&self, bytes: usize) -> bool {
        bytes > self.inner.superblock / 4
    }

    fn my_arena(&self) -> usize {
        thread_ticket() % self.inner.arenas.len()
    }

    /// Use now, and the global arena's state.
    pub fn stats(&self) -> ArenaStats {
        let mut superblocks = 0;
        let mut small = 0;
        for a in self.inner.arenas.iter() {
            let c = lock(&a.core);
            superblocks += c.index.chunk_count();
            small += c.index.in_use();
        }
        let global = self.inner.global.stats();
        let large = global
            .bytes_in_use
            .saturating_sub(superblocks * self.inner.superblock);
        ArenaStats {
            global,
            superblocks,
            bytes_in_use: small + large,
        }
    }

    /// Checks every arena's index and the global arena's.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        for (i, a) in self.inner.arenas.iter().enumerate() {
            lock(&a.core)
                .index
                .check_invariants()
                .map_err(|e| format!("arena {i}: {e}"))?;
        }
        self.inner
            .global
            .check_invariants()
            .map_err(|e| format!("global arena: {e}"))
    }

    /// True when some arena holds a live block at `addr` (a block it carved).
    fn carved_by_an_arena(&self, addr: usize) -> bool {
        self.inner
            .arenas
            .iter()
            .any(|a| lock(&a.core).index.owns(addr))
    }

    /// Returns empty superblocks to the global arena, then every wholly free upstream chunk of
    /// the global arena to the upstream ([`PoolMemoryResource::release`]), after waiting for
    /// all work on the device. Returns the bytes released upstream. A superblock or chunk whose
    /// free fails stays in the books (and is tried again by the next `release` or on drop), as
    /// do the superblocks not yet given back when a give-back unwinds.
    pub fn release(&self) -> Result<usize> {
        let mut first = Ok(());
        {
            // Every arena is locked across the synchronisation, so no free slips in between it
            // and the merge.
            let mut cores: Vec<_> = self.inner.arenas.iter().map(|a| lock(&a.core)).collect();
            self.inner.order.synchronize_all()?;
            let mut empty = Vec::new();
            for (i, core) in cores.iter_mut().enumerate() {
                core.index.merge_all();
                for (base, _) in core.index.empty_chunks() {
                    core.index.remove_chunk(base);
                    empty.push((i, base));
                }
                core.spare = None;
            }
            drop(cores);
            let mut returning = Returning {
                inner: &self.inner,
                left: empty.into_iter(),
            };
            for (i, base) in returning.left.by_ref() {
                // All work is done: any stream may take it, so no stream tags it.
                let r = self.give_back(&self.inner.arenas[i], base, None, StreamRef::DEFAULT);
                if first.is_ok() {
                    first = r;
                }
            }
        }
        let released = self.inner.global.release();
        first.and(released)
    }

    /// Returns superblock `base`, already out of `arena`'s index, to the global arena, without
    /// the arena's lock held. Its free blocks were `tag`'s (`None`: free to any stream), and
    /// `stream`, in use by the caller, orders its last use. If the global arena refuses it, it
    /// goes back into the index as it was.
    fn give_back(
        &self,
        arena: &Arena,
        base: usize,
        tag: Option<StreamId>,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let ptr = NonNull::new(base as *mut u8).expect("superblocks are non-null");
        let sb = self.inner.superblock;
        // SAFETY: the superblock came from the global arena with this size and alignment and
        // has left this arena's index, so nothing else hands it out or returns it; its last use
        // was ordered on `stream`.
        let r = unsafe { self.inner.global.deallocate(stream, ptr, sb, GRAIN) };
        if r.is_err() {
            lock(&arena.core).index.add_chunk(base, sb, tag);
        }
        r
    }
}

/// The empty superblocks [`ArenaMemoryResource::release`] took out of their arenas and has not
/// given back yet. If a give-back unwinds (the global arena's free took effect, then an
/// ordering call panicked), dropping this puts the rest back into their arenas, free to any
/// stream, where the next `release` finds them: none is lost.
struct Returning<'a, R: MemoryResource> {
    inner: &'a Inner<R>,
    left: std::vec::IntoIter<(usize, usize)>,
}

impl<R: MemoryResource> Drop for Returning<'_, R> {
    fn drop(&mut self) {
        for (i, base) in self.left.by_ref() {
            lock(&self.inner.arenas[i].core)
                .index
                .add_chunk(base, self.inner.superblock, None);
        }
    }
}

// SAFETY: small blocks are carved by a `PoolCore` from superblocks the global pool handed out
// (disjoint, live until given back, and given back only when empty); large blocks come from the
// global pool itself. Frees reach the arena that owns the block.
unsafe impl<R: MemoryResource> MemoryResource for ArenaMemoryResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, GRAIN)?;
        if self.is_large(bytes) || align > GRAIN {
            return self.inner.global.allocate(stream, bytes, align);
        }
        let arena = &self.inner.arenas[self.my_arena()];
        let order = &*self.inner.order;
        // Taken once, outside the lock: a default stream's id asks the driver.
        let on = OnStream::new(stream);
        let id = on.id;
        let (_, needed) = footprint(bytes, align).ok_or(Error::SizeOverflow { bytes, align })?;
        {
            let mut core = lock(&arena.core);
            let index = &mut core.index;
            if let Some(p) = allocate_from(index, order, on, bytes, align, Reach::Events, None)? {
                return Ok(p);
            }
            // At least half the arena is free, yet nothing fits, and other streams hold free
            // memory (blocks freed on one stream merge only with that stream's, and reach
            // others only through an event or a synchronisation). Merging it after one
            // synchronisation bounds what the arena holds (see the type's docs); growing
            // instead held twenty times the live bytes when threads freed each other's blocks.
            // The lock is held from the synchronisation to the merge, so no free slips in
            // between.
            let free = index.pool_size() - index.in_use();
            if free >= needed && free >= index.pool_size() / 2 && index.others_hold_free(id) {
                order.synchronize_all()?;
                index.merge_all();
                if let Some(p) = index.take(id, bytes, align) {
                    return Ok(p);
                }
            }
        }
        // A new superblock, asked for without the arena's lock: the upstream may call back
        // into this arena (a failure callback that frees). A superblock before a device-wide
        // synchronisation that the arena's own free memory could not make useful: the
        // synchronisation stalls the host until the device drains, on every stream (and fails
        // while another thread captures a graph). Replaying a PyTorch trace (torch_gpt_small),
        // synchronising first took 32 synchronisations.
        let sb = self.inner.superblock;
        match self.inner.global.allocate(stream, sb, GRAIN) {
            Ok(base) => {
                let mut core = lock(&arena.core);
                core.index.add_chunk(base.as_ptr() as usize, sb, Some(id));
                core.index
                    .take(id, bytes, align)
                    .ok_or_else(|| Error::OutOfMemory {
                        bytes,
                        resource: NAME,
                        detail: "a fresh superblock did not fit the request".to_owned(),
                    })
            }
            Err(e) if e.is_out_of_memory() => {
                let mut core = lock(&arena.core);
                let reach = Reach::Synchronize;
                Ok(
                    allocate_from(&mut core.index, order, on, bytes, align, reach, None)?
                        .ok_or(e)?,
                )
            }
            Err(e) => Err(e),
        }
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let align = check_request(bytes, align, GRAIN)?;
        let addr = ptr.as_ptr() as usize;
        // Large blocks came from the global arena, which refuses any other size at a block's
        // address, except at a superblock's start with the superblock's size: that may be a
        // small block passing for its superblock (which must stay), so only that size asks the
        // arenas first. Asking every arena on each large free (a lock each) cost more than the
        // rest of the free.
        if (self.is_large(bytes) || align > GRAIN)
            && (bytes != self.inner.superblock || !self.carved_by_an_arena(addr))
        {
            // SAFETY: the caller's contract; a large block came from the global arena (a small
            // block with a wrong size is refused there, unchanged).
            match unsafe { self.inner.global.deallocate(stream, ptr, bytes, align) } {
                Ok(()) => return Ok(()),
                // A small block freed with a large size: its arena says what it holds.
                Err(_) if self.carved_by_an_arena(addr) => {}
                Err(e) => return Err(e),
            }
        }
        let mine = self.my_arena();
        let n = self.inner.arenas.len();
        // Usually the allocating thread frees; otherwise search the other arenas.
        let on = OnStream::new(stream);
        let id = on.id;
        let mut first_err = None;
        for i in (0..n).map(|k| (mine + k) % n) {
            let arena = &self.inner.arenas[i];
            let mut core = lock(&arena.core);
            // The own arena needs no ownership probe: the free itself looks the block up.
            if i != mine && !core.index.owns(addr) {
                continue;
            }
            let freed = free_into(
                &mut core.index,
                &*self.inner.order,
                NAME,
                on,
                addr,
                bytes,
                false,
            );
            match freed {
                Ok(Some(empty)) => {
                    let spare_still_empty = core
                        .spare
                        .is_some_and(|s| s != empty.base && core.index.is_empty_chunk(s));
                    if !spare_still_empty {
                        core.spare = Some(empty.base);
                        return Ok(());
                    }
                    if !core.index.remove_chunk(empty.base) {
                        return Ok(());
                    }
                    drop(core);
                    return self.give_back(arena, empty.base, Some(id), stream);
                }
                Ok(None) => return Ok(()),
                Err(e) if i == mine => first_err = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(first_err.unwrap_or(Error::UnknownPointer {
            resource: NAME,
            ptr: addr,
        }))
    }

    fn properties(&self) -> Properties {
        self.inner.global.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.global.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: s.bytes_in_use,
            bytes_reserved: Some(s.global.pool_size),
            peak_bytes: None,
            live_blocks: None,
            detail: vec![
                (c"bytes_in_use", n(s.bytes_in_use)),
                (c"superblocks", n(s.superblocks)),
                (c"pool_size", n(s.global.pool_size)),
                (c"free_bytes", n(s.global.free_bytes)),
            ],
        }))
    }
    fn release_unused(&self) -> crate::error::Result<usize> {
        self.release()
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        for a in self.arenas.iter() {
            let core = lock(&a.core);
            for (base, _) in core.index.chunks() {
                if let Some(ptr) = NonNull::new(base as *mut u8) {
                    // SAFETY: every superblock came from the global arena with this size; the
                    // last handle is going away.
                    let r = unsafe {
                        self.global
                            .deallocate(StreamRef::DEFAULT, ptr, self.superblock, GRAIN)
                    };
                    crate::deferred::record("ArenaMemoryResource drop: returning a superblock", r);
                }
            }
        }
    }
}

impl<R: MemoryResource> fmt::Debug for ArenaMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("superblock", &self.inner.superblock)
            .field("arenas", &self.inner.arenas.len())
            .field("global", &self.inner.global)
            .finish()
    }
}
