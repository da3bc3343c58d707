//! [`ArenaMemoryResource`]: per-thread arenas over a global arena of superblocks, in RMM's arena
//! role.
//!
//! Each thread allocates from its own arena (one of a fixed set, picked by a per-thread ticket),
//! so threads do not contend. An arena carves superblocks it takes from the global arena, a
//! [`PoolMemoryResource`] over the upstream, with the pool's coalescing, stream-tagged index.
//! A superblock that empties goes back to the global arena (one spare is kept per arena, so a
//! thread freeing and allocating its last block does not bounce). Requests above a quarter of a
//! superblock go to the global arena directly.

use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::coalescing::core::{allocate_from, free_into, PoolCore, Reach, GRAIN};
use super::stream_order::default_order;
use super::{
    check_request, MemoryResource, PoolMemoryResource, PoolOptions, PoolStats, Properties,
    StreamOrder,
};
use crate::error::{Error, Result};
use crate::stream::StreamRef;

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

fn lock(arena: &Arena) -> MutexGuard<'_, ArenaCore> {
    // Core updates cannot panic midway, so a poisoned lock still guards a consistent core.
    arena.core.lock().unwrap_or_else(PoisonError::into_inner)
}

impl<R: MemoryResource> ArenaMemoryResource<R> {
    /// Arenas over `upstream`.
    pub fn new(upstream: R, options: ArenaOptions) -> Result<Self> {
        let superblock = match options.superblock_size {
            0 => 32 << 20,
            n => super::align_up(n, GRAIN).ok_or(Error::SizeOverflow {
                bytes: n,
                align: GRAIN,
            })?,
        };
        let arenas = match options.arenas {
            0 => 2 * std::thread::available_parallelism().map_or(4, |n| n.get()),
            n => super::limits::count(NAME, "arenas", n, ArenaOptions::MAX_ARENAS)?,
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
            let c = lock(a);
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
            lock(a)
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
        self.inner.arenas.iter().any(|a| lock(a).index.owns(addr))
    }

    /// Returns an empty superblock to the global arena.
    fn give_back(&self, core: &mut ArenaCore, base: usize, stream: StreamRef<'_>) -> Result<()> {
        if !core.index.remove_chunk(base) {
            return Ok(());
        }
        let ptr = NonNull::new(base as *mut u8).expect("superblocks are non-null");
        // SAFETY: the superblock came from the global arena with this size and alignment and
        // has just left this arena's index; its last use was ordered on `stream`.
        unsafe {
            self.inner
                .global
                .deallocate(stream, ptr, self.inner.superblock, GRAIN)
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
        let mut core = lock(arena);
        let order = &*self.inner.order;
        let index = &mut core.index;
        if let Some(p) = allocate_from(index, order, stream, bytes, align, Reach::Events, None)? {
            return Ok(p);
        }
        // A new superblock before a device-wide synchronisation: the synchronisation stalls
        // the host until the device drains, on every stream (and fails while another thread
        // captures a graph). Replaying a PyTorch trace (torch_gpt_small), synchronising first
        // took 32 synchronisations; the global arena's free memory usually serves instead.
        let sb = self.inner.superblock;
        let base = match self.inner.global.allocate(stream, sb, GRAIN) {
            Ok(base) => base,
            Err(e) if e.is_out_of_memory() => {
                let reach = Reach::Synchronize;
                return allocate_from(index, order, stream, bytes, align, reach, None)?.ok_or(e);
            }
            Err(e) => return Err(e),
        };
        core.index
            .add_chunk(base.as_ptr() as usize, sb, Some(stream.id()));
        core.index
            .take(stream.id(), bytes, align)
            .ok_or_else(|| Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: "a fresh superblock did not fit the request".to_owned(),
            })
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
        let mut first_err = None;
        for i in (0..n).map(|k| (mine + k) % n) {
            let mut core = lock(&self.inner.arenas[i]);
            // The own arena needs no ownership probe: the free itself looks the block up.
            if i != mine && !core.index.owns(addr) {
                continue;
            }
            let freed = free_into(
                &mut core.index,
                &*self.inner.order,
                NAME,
                stream,
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
                    return self.give_back(&mut core, empty.base, stream);
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
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        for a in self.arenas.iter() {
            let core = lock(a);
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
