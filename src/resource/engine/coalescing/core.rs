//! The coalescing block index shared by the pool, the arena's per-thread arenas and the virtual-memory resource.
//!
//! Plain host bookkeeping over address ranges (it never touches the memory). Blocks are nodes
//! in one array, linked to their neighbours in the chunk, so a free coalesces in O(1); free
//! blocks are filed in TLSF indexes ([`super::tlsf`]), so a fit is found in O(1); live blocks
//! are found by address in a hash map. Nothing allocates per operation once the arrays have
//! grown.
//!
//! **Streams.** A free block belongs to one of:
//! - the stream it was freed on, *fresh* (freed since that stream's last mark) or *sealed*
//!   (covered by a mark: an event recorded on the stream while it was in use, at most once per
//!   [`MARK_EVERY`] frees and only while some stream runs short, never on every free);
//! - nobody (*any*): its last use is known complete, so every stream may take it.
//!
//! A stream takes its own blocks and *any* blocks freely; another stream's sealed blocks after
//! one wait on that stream's last mark; and everything else only after a device-wide
//! synchronisation, which turns every free block into an *any* block. So the pool never names a
//! stream to the driver outside a call on that stream: streams may be destroyed while blocks
//! freed on them sit in the pool.
//!
//! **Marking every free** (opt-in, [`PoolCore::marking_every_free`]). While another stream has
//! allocated from the pool lately ([`SHARED_WINDOW`]), every free marks its stream, and each
//! allocation asks the driver, without blocking, whether other streams' last marks are done;
//! once one is, that stream's sealed blocks become *any* blocks and merge with their
//! neighbours. Streams then reuse each other's memory as soon as the device is past it, with
//! neither a wait nor a synchronisation, at the cost of an event record per free (RMM's
//! choice). On five PyTorch training traces it lowered the expandable pool's peak from
//! 1.02–1.10× to 1.005–1.044× of the logical peak, and made later passes 2–4× slower on an H100,
//! where an event record takes 120–670 ns; so it stays opt-in.

mod blocks;
mod invariants;
mod ordered;
mod placed;
mod streams;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;
use std::ptr::NonNull;

use super::live::LiveIndex;
use super::node::{fresh_bin, sealed_bin, Node, Tag, ANY, GRAIN, LIVE};
use super::tlsf::{Tlsf, NIL};
use crate::error::{Error, Result};
use crate::resource::engine::stream_order::MARK_EVERY;
use crate::resource::memory_resource::align_up;
use crate::stream::StreamId;

pub(crate) use ordered::{allocate_from, free_into, OnStream, Reach};
pub(crate) use placed::Placer;

/// With [`PoolCore::marking_every_free`], a free is marked while another stream has allocated
/// from the pool within this many allocations.
pub(crate) const SHARED_WINDOW: u64 = 4096;

/// Allocations to let pass before asking again whether a stream's mark is done, after the
/// driver said it was not.
const QUERY_EVERY: u64 = 64;

/// A chunk that a free left wholly free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EmptyChunk {
    pub base: usize,
    pub size: usize,
}

/// What a free did beyond freeing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Freed {
    /// The block's chunk, if it is now wholly free.
    pub empty: Option<EmptyChunk>,
    /// The stream is due a mark (then call [`PoolCore::seal`]): [`MARK_EVERY`] frees since its
    /// last and some stream ran short of its own blocks since, or at every free while streams
    /// share a pool that [marks every free](PoolCore::marking_every_free).
    pub mark_due: bool,
}

#[derive(Debug)]
pub(crate) struct PoolCore {
    nodes: Vec<Node>,
    spare: Vec<u32>,
    bins: Vec<Tlsf>,
    tags: Vec<Tag>,
    last_tag: usize,
    live: LiveIndex,
    /// Chunk base -> (size, the node at the base, which is never merged away).
    chunks: BTreeMap<usize, (usize, u32)>,
    /// Bumped whenever a stream runs short of its own blocks: marks are worth their driver
    /// call only while some stream may want another's blocks.
    demand: u64,
    pool_size: usize,
    in_use: usize,
    /// Mark every free while streams share the pool (see the module's "Marking every free").
    mark_every_free: bool,
    /// Allocations through [`allocate_from`] while marking every free, the clock of
    /// [`Tag::query_at`] and [`Tag::last_alloc`].
    allocs: u64,
    /// Some stream may have [`Tag::unconfirmed`] sealed blocks.
    unconfirmed: bool,
    /// The candidates of a placed search ([`PoolCore::take_placed`]), kept to save an
    /// allocation per search.
    candidates: Vec<u32>,
}

impl Default for PoolCore {
    fn default() -> Self {
        PoolCore {
            nodes: Vec::new(),
            spare: Vec::new(),
            bins: vec![Tlsf::default()],
            tags: Vec::new(),
            last_tag: 0,
            live: LiveIndex::default(),
            chunks: BTreeMap::new(),
            demand: 0,
            pool_size: 0,
            in_use: 0,
            mark_every_free: false,
            allocs: 0,
            unconfirmed: false,
            candidates: Vec::new(),
        }
    }
}

impl PoolCore {
    /// An empty index that marks every free while streams share it, if `on` (see the module's
    /// "Marking every free").
    pub fn marking_every_free(on: bool) -> Self {
        PoolCore {
            mark_every_free: on,
            ..Self::default()
        }
    }
}

/// Block size and search size for a checked request (`align >= GRAIN`).
pub(crate) fn footprint(bytes: usize, align: usize) -> Option<(usize, usize)> {
    let size = align_up(bytes, GRAIN)?;
    let search = size.checked_add(align - GRAIN)?;
    Some((size, search))
}

impl PoolCore {
    pub fn pool_size(&self) -> usize {
        self.pool_size
    }
    pub fn in_use(&self) -> usize {
        self.in_use
    }
    pub fn live_count(&self) -> usize {
        self.live.len()
    }
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }
    pub fn largest_free(&mut self) -> usize {
        let nodes = &mut self.nodes;
        self.bins
            .iter()
            .map(|b| b.largest(nodes))
            .max()
            .unwrap_or(0)
            * GRAIN
    }
    /// The requested size of live block `ptr`, if it is one.
    pub fn live_size(&self, ptr: usize) -> Option<usize> {
        self.live
            .get(&self.nodes, ptr)
            .map(|n| self.nodes[n as usize].requested())
    }

    /// True when `ptr` is a live block of this core.
    pub fn owns(&self, ptr: usize) -> bool {
        self.live.get(&self.nodes, ptr).is_some()
    }

    /// Adds an upstream chunk (GRAIN-aligned base and size): fresh on `stream`, or free to any
    /// stream with `None` (its allocation is known complete).
    pub fn add_chunk(&mut self, base: usize, size: usize, stream: Option<StreamId>) {
        debug_assert!(base % GRAIN == 0 && size % GRAIN == 0 && size > 0);
        let n = self.new_node(base, size, (NIL, NIL));
        self.chunks.insert(base, (size, n));
        self.pool_size += size;
        let bin = match stream {
            Some(s) => fresh_bin(self.tag(s)),
            None => ANY,
        };
        self.file(n, bin);
    }

    /// Grows the chunk at `base` in place by `extra` bytes (a GRAIN multiple) at its end, for a
    /// chunk whose next addresses are the caller's (a reserved virtual range). The new range
    /// joins the chunk's last block if that is free (in its bin), else it becomes a block any
    /// stream may take, since nothing ever used it. False if no chunk starts at `base`.
    /// (A walk of the chunk: call it rarely, growing in large steps.)
    pub fn extend_chunk(&mut self, base: usize, extra: usize) -> bool {
        debug_assert!(extra % GRAIN == 0 && extra > 0);
        let Some(&(size, head)) = self.chunks.get(&base) else {
            return false;
        };
        let mut last = head;
        while self.nodes[last as usize].phys.1 != NIL {
            last = self.nodes[last as usize].phys.1;
        }
        let bin = self.nodes[last as usize].bin;
        if bin == LIVE {
            let tail = self.split_after(last, base + size, extra);
            self.file(tail, ANY);
        } else {
            self.unfile(last);
            self.nodes[last as usize].size += extra;
            self.file(last, bin);
        }
        self.chunks.insert(base, (size + extra, head));
        self.pool_size += extra;
        true
    }

    /// Removes a wholly free chunk; false if it is not one.
    pub fn remove_chunk(&mut self, base: usize) -> bool {
        if !self.is_empty_chunk(base) {
            return false;
        }
        let (size, head) = self.chunks.remove(&base).expect("checked above");
        self.unfile(head);
        self.release_node(head);
        self.pool_size -= size;
        true
    }

    /// True when the chunk at `base` is one free block.
    pub fn is_empty_chunk(&self, base: usize) -> bool {
        self.chunks.get(&base).is_some_and(|&(size, head)| {
            let n = &self.nodes[head as usize];
            n.bin != LIVE && n.size == size
        })
    }

    /// Chunks with no live block, each as one free block.
    pub fn empty_chunks(&self) -> Vec<(usize, usize)> {
        self.chunks
            .iter()
            .filter(|(&base, _)| self.is_empty_chunk(base))
            .map(|(&b, &(s, _))| (b, s))
            .collect()
    }

    /// Every live block as `(start, end)` (a walk of every chunk: for checks, not hot paths).
    pub fn live_ranges(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::with_capacity(self.live.len());
        for &(_, head) in self.chunks.values() {
            let mut at = head;
            while at != NIL {
                let n = &self.nodes[at as usize];
                if n.bin == LIVE {
                    out.push((n.addr, n.addr + n.size));
                }
                at = n.phys.1;
            }
        }
        out
    }

    /// Every chunk, for returning them all to the upstream.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.chunks.iter().map(|(&b, &(s, _))| (b, s))
    }

    /// Best fit among the blocks `stream` may take without waiting (its own and *any*).
    pub fn take(&mut self, stream: StreamId, bytes: usize, align: usize) -> Option<NonNull<u8>> {
        let (size, search) = footprint(bytes, align)?;
        let t = self.tag(stream);
        let node = self.fit(&[fresh_bin(t), sealed_bin(t), ANY], search / GRAIN)?;
        Some(self.carve(node, size, align, bytes))
    }

    /// Frees a live block on `stream`.
    #[inline(always)]
    pub fn free(
        &mut self,
        name: &'static str,
        stream: StreamId,
        ptr: usize,
        bytes: usize,
    ) -> Result<Freed> {
        let Some(n) = self.live.remove(&self.nodes, ptr) else {
            return Err(self.classify(name, ptr));
        };
        let node = self.nodes[n as usize];
        if node.requested() != bytes {
            self.live.insert(&self.nodes, ptr, n);
            return Err(Error::SizeMismatch {
                resource: name,
                ptr,
                allocated: node.requested(),
                freed: bytes,
            });
        }
        self.in_use -= node.size;
        let t = self.tag(stream);
        let n = self.coalesce_into(n, fresh_bin(t));
        let demand = self.demand;
        let now = self.allocs;
        let shared = self.mark_every_free
            && self.tags.iter().any(|o| {
                o.stream != stream && o.last_alloc != 0 && now - o.last_alloc < SHARED_WINDOW
            });
        let tag = &mut self.tags[t];
        tag.frees_since_mark += 1;
        let mut mark_due = shared;
        if tag.frees_since_mark >= MARK_EVERY {
            // Mark only if some stream ran short since the last mark; else start counting again.
            mark_due |= tag.demand_seen != demand;
            tag.frees_since_mark = 0;
        }
        let node = &self.nodes[n as usize];
        Ok(Freed {
            empty: (node.phys == (NIL, NIL)).then_some(EmptyChunk {
                base: node.addr,
                size: node.size,
            }),
            mark_due,
        })
    }
}
