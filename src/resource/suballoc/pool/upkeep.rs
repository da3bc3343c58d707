//! A pool's upkeep: statistics, invariant checks, returning memory to the upstream (`release`,
//! and on drop) and gathering shards' free memory into the global core.

use std::sync::PoisonError;

use super::{non_null, Inner, PoolMemoryResource, PoolStats, NAME};
use crate::error::Result;
use crate::resource::engine::coalescing::{PoolCore, GRAIN};
use crate::resource::memory_resource::MemoryResource;
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

impl<R: MemoryResource> PoolMemoryResource<R> {
    /// Size, use and fragmentation now.
    pub fn stats(&self) -> PoolStats {
        let mut global = lock(&self.inner.global);
        let (mut in_use, mut live, mut slabs) = (0, 0, 0);
        let mut largest = global.largest_free();
        for shard in self.inner.shards.iter() {
            let mut core = lock(&shard.core);
            in_use += core.in_use();
            live += core.live_count();
            slabs += core.chunk_count();
            largest = largest.max(core.largest_free());
        }
        let pool_size = global.pool_size();
        let free = pool_size - in_use;
        PoolStats {
            pool_size,
            bytes_in_use: in_use,
            free_bytes: free,
            largest_free_block: largest,
            fragmentation: if free == 0 {
                0.0
            } else {
                1.0 - largest as f64 / free as f64
            },
            live_blocks: live,
            chunks: global.chunk_count(),
            slabs,
        }
    }

    /// Returns every upstream chunk with no live block to the upstream, after waiting for all
    /// work on the device (so no stream handle is needed). Returns the bytes released. A chunk
    /// whose upstream free fails stays in the pool, usable, and is tried again by the next
    /// `release` and on drop; the first such error is returned once every chunk was tried.
    pub fn release(&self) -> Result<usize> {
        let mut global = lock(&self.inner.global);
        self.gather(&mut global)?;
        let mut released = 0;
        let mut first = Ok(());
        for (base, size) in global.empty_chunks() {
            // The global lock is held, so nothing takes the chunk while the upstream frees it;
            // it leaves the index only once the upstream has it back.
            // SAFETY: the chunk came from the upstream with this size and GRAIN alignment and
            // is wholly free; all work is done.
            let r = unsafe {
                self.inner
                    .upstream
                    .deallocate(StreamRef::DEFAULT, non_null(base), size, GRAIN)
            };
            match r {
                Ok(()) => {
                    global.remove_chunk(base);
                    released += size;
                }
                Err(e) if first.is_ok() => first = Err(e),
                Err(_) => {}
            }
        }
        first.map(|()| released)
    }

    /// Checks the pool's internal invariants: each core's (tiling, coalescing, indexes,
    /// counters), and that the shards' slabs are exactly the global core's live blocks.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut global = lock(&self.inner.global);
        global
            .check_invariants()
            .map_err(|e| format!("global: {e}"))?;
        let (mut slab_bytes, mut slabs) = (0, 0);
        for (i, shard) in self.inner.shards.iter().enumerate() {
            let mut core = lock(&shard.core);
            core.check_invariants()
                .map_err(|e| format!("shard {i}: {e}"))?;
            for (base, size) in core.chunks() {
                if global.live_size(base) != Some(size) {
                    return Err(format!(
                        "shard {i} holds slab {base:#x}+{size} that the global core did not hand out"
                    ));
                }
                slab_bytes += size;
                slabs += 1;
            }
        }
        if slab_bytes != global.in_use() || slabs != global.live_count() {
            return Err(format!(
                "shards hold {slabs} slabs of {slab_bytes} bytes; the global core has {} live \
                 blocks of {} bytes",
                global.live_count(),
                global.in_use()
            ));
        }
        Ok(())
    }

    /// After a device-wide synchronisation, every shard's wholly free slabs go back to the
    /// global core, and all free memory becomes free to any stream.
    pub(super) fn gather(&self, global: &mut PoolCore) -> Result<()> {
        // Every shard is locked before the synchronisation, so no free can slip in between
        // (its block's work might still be queued) and be merged as free to any stream.
        let mut shards: Vec<_> = self.inner.shards.iter().map(|s| lock(&s.core)).collect();
        self.inner.order.synchronize_all()?;
        for core in shards.iter_mut() {
            core.merge_all();
            for (base, size) in core.empty_chunks() {
                core.remove_chunk(base);
                global.free(NAME, StreamId::DEFAULT, base, size)?;
            }
        }
        global.merge_all();
        Ok(())
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        // Blocks may still be in use by queued work on any stream, and the upstream may reuse
        // the chunks at once: if the device cannot say that work is done, the chunks leak.
        if let Err(e) = self.order.synchronize_all() {
            crate::deferred::record::<()>(
                "PoolMemoryResource drop: waiting for streams (its chunks leak)",
                Err(e),
            );
            return;
        }
        let global = self
            .global
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        for (base, size) in global.chunks() {
            // SAFETY: each chunk came from the upstream with this size and alignment and is
            // returned once, as the last handle to the pool goes away.
            let r = unsafe {
                self.upstream
                    .deallocate(StreamRef::DEFAULT, non_null(base), size, GRAIN)
            };
            crate::deferred::record("PoolMemoryResource drop: returning a chunk", r);
        }
    }
}
