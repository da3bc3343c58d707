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
//! where an event record takes 120–670 ns (BENCHMARKS.md, 2026-11-26, fifteenth session).

use std::collections::BTreeMap;
use std::ptr::NonNull;

use super::live::{LiveIndex, NodeAddr};
use super::tlsf::{FreeLinks, Tlsf, NIL};
use crate::error::{Error, Result};
use crate::resource::{align_up, DEFAULT_ALIGNMENT};
use crate::stream::{StreamId, StreamRef};

use crate::resource::engine::stream_order::MARK_EVERY;

mod placed;
use crate::resource::StreamOrder;
pub(crate) use placed::Placer;

/// Every block is a multiple of this, at an address aligned to it.
pub(crate) const GRAIN: usize = DEFAULT_ALIGNMENT;

/// `Node::bin` of a live block, and of a node on the spare list.
const LIVE: u32 = u32::MAX;
const SPARE: u32 = u32::MAX - 1;
/// The bin of blocks any stream may take.
const ANY: u32 = 0;

#[derive(Clone, Copy, Debug)]
struct Node {
    addr: usize,
    size: usize,
    /// Neighbours in the chunk (NIL at its ends).
    phys: (u32, u32),
    /// Free-list links, while filed.
    link: (u32, u32),
    /// The bin it is filed in, or LIVE / SPARE.
    bin: u32,
    /// While live, `size` minus the requested bytes (under a grain: a live block is the
    /// request rounded up to the grain), so a node takes 40 bytes, not 48.
    slack: u8,
}

#[cfg(target_pointer_width = "64")]
static_assertions::assert_eq_size!(Node, [u64; 5]);

impl Node {
    /// The bytes requested for a live block.
    #[inline]
    fn requested(&self) -> usize {
        self.size - self.slack as usize
    }
}

impl NodeAddr for Vec<Node> {
    #[inline]
    fn addr_of(&self, node: u32) -> usize {
        self[node as usize].addr
    }
}

impl FreeLinks for Vec<Node> {
    #[inline]
    fn units(&self, node: u32) -> usize {
        self[node as usize].size / GRAIN
    }
    #[inline]
    fn link(&mut self, node: u32) -> &mut (u32, u32) {
        &mut self[node as usize].link
    }
}

/// With [`PoolCore::marking_every_free`], a free is marked while another stream has allocated
/// from the pool within this many allocations.
pub(crate) const SHARED_WINDOW: u64 = 4096;

/// Allocations to let pass before asking again whether a stream's mark is done, after the
/// driver said it was not.
const QUERY_EVERY: u64 = 64;

/// A stream's two bins: fresh is `2 * tag + 1`, sealed `2 * tag + 2`.
#[derive(Clone, Copy, Debug)]
struct Tag {
    stream: StreamId,
    frees_since_mark: u32,
    /// `PoolCore::demand` at this stream's last mark.
    demand_seen: u64,
    /// `PoolCore::allocs` at this stream's last allocation (0: none yet).
    last_alloc: u64,
    /// Sealed blocks wait for the driver to confirm this stream's last mark.
    unconfirmed: bool,
    /// `PoolCore::allocs` before which that is not asked again.
    query_at: u64,
}

#[inline]
fn fresh_bin(tag: usize) -> u32 {
    2 * tag as u32 + 1
}
#[inline]
fn sealed_bin(tag: usize) -> u32 {
    2 * tag as u32 + 2
}
#[inline]
fn tag_of_bin(bin: u32) -> Option<usize> {
    (bin != ANY).then(|| (bin as usize - 1) / 2)
}

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

    /// The best fit among other streams' sealed blocks: (that stream, the block).
    pub fn sealed_fit_elsewhere(
        &mut self,
        stream: StreamId,
        bytes: usize,
        align: usize,
    ) -> Option<(StreamId, u32)> {
        let (_, search) = footprint(bytes, align)?;
        let bins: Vec<u32> = (0..self.tags.len())
            .filter(|&t| {
                self.tags[t].stream != stream && !self.bins[sealed_bin(t) as usize].is_empty()
            })
            .map(sealed_bin)
            .collect();
        let node = self.fit(&bins, search / GRAIN)?;
        let t = tag_of_bin(self.nodes[node as usize].bin).expect("a sealed bin");
        Some((self.tags[t].stream, node))
    }

    /// Hands another stream's free block to `stream`, coalescing (the caller has ordered
    /// `stream` after the block's last use).
    pub fn adopt(&mut self, node: u32, stream: StreamId) {
        let t = self.tag(stream);
        self.unfile(node);
        self.coalesce_into(node, fresh_bin(t));
    }

    /// True when streams other than `stream` hold free blocks.
    pub fn others_hold_free(&self, stream: StreamId) -> bool {
        self.tags.iter().enumerate().any(|(t, tag)| {
            tag.stream != stream
                && !(self.bins[fresh_bin(t) as usize].is_empty()
                    && self.bins[sealed_bin(t) as usize].is_empty())
        })
    }

    /// After a device-wide synchronisation: every free block becomes free to any stream, and
    /// neighbours merge.
    pub fn merge_all(&mut self) {
        for bin in 1..self.bins.len() as u32 {
            while let Some(n) = self.bins[bin as usize].find(1) {
                self.unfile(n);
                self.coalesce_into(n, ANY);
            }
        }
        for tag in &mut self.tags {
            tag.frees_since_mark = 0;
            tag.unconfirmed = false;
        }
        self.unconfirmed = false;
    }

    /// After a mark on `stream`: its fresh blocks become sealed.
    pub fn seal(&mut self, stream: StreamId) {
        let t = self.tag(stream);
        let (fresh, sealed) = (fresh_bin(t), sealed_bin(t));
        while let Some(n) = self.bins[fresh as usize].find(1) {
            self.unfile(n);
            self.file(n, sealed);
        }
        let tag = &mut self.tags[t];
        tag.frees_since_mark = 0;
        tag.demand_seen = self.demand;
        if self.mark_every_free && !self.bins[sealed as usize].is_empty() {
            tag.unconfirmed = true;
            self.unconfirmed = true;
        }
    }

    /// Hands to every stream the sealed blocks of each stream but `stream` whose last mark
    /// `done` confirms (a driver query each, at most once per [`QUERY_EVERY`] allocations per
    /// stream while the answer is no). Their neighbours merge.
    fn release_confirmed(&mut self, stream: StreamId, mut done: impl FnMut(StreamId) -> bool) {
        let mut left = false;
        for t in 0..self.tags.len() {
            let tag = self.tags[t];
            if !tag.unconfirmed {
                continue;
            }
            let sealed = sealed_bin(t);
            if self.bins[sealed as usize].is_empty() {
                self.tags[t].unconfirmed = false;
                continue;
            }
            if tag.stream == stream || self.allocs < tag.query_at {
                left = true;
                continue;
            }
            if !done(tag.stream) {
                self.tags[t].query_at = self.allocs + QUERY_EVERY;
                left = true;
                continue;
            }
            while let Some(n) = self.bins[sealed as usize].find(1) {
                self.unfile(n);
                self.coalesce_into(n, ANY);
            }
            self.tags[t].unconfirmed = false;
        }
        self.unconfirmed = left;
    }

    /// Records that a stream found too few blocks of its own (see [`Freed::mark_due`]).
    pub fn note_demand(&mut self) {
        self.demand += 1;
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

    /// The tag of `stream`, made on first use (reusing an idle one once there are many).
    #[inline]
    fn tag(&mut self, stream: StreamId) -> usize {
        if self
            .tags
            .get(self.last_tag)
            .is_some_and(|t| t.stream == stream)
        {
            return self.last_tag;
        }
        let t = match self.tags.iter().position(|t| t.stream == stream) {
            Some(t) => t,
            None => self.new_tag(stream),
        };
        self.last_tag = t;
        t
    }

    #[cold]
    fn new_tag(&mut self, stream: StreamId) -> usize {
        let tag = Tag {
            stream,
            frees_since_mark: 0,
            demand_seen: self.demand,
            last_alloc: 0,
            unconfirmed: false,
            query_at: 0,
        };
        if self.tags.len() >= 16 {
            let idle = (0..self.tags.len()).find(|&t| {
                self.bins[fresh_bin(t) as usize].is_empty()
                    && self.bins[sealed_bin(t) as usize].is_empty()
            });
            if let Some(t) = idle {
                self.tags[t] = tag;
                return t;
            }
        }
        self.tags.push(tag);
        self.bins.push(Tlsf::default());
        self.bins.push(Tlsf::default());
        self.tags.len() - 1
    }

    /// The smallest block of at least `units` grains in `bins`: O(1) per bin, then (only if
    /// that fails) a walk of the request's own size class.
    fn fit(&mut self, bins: &[u32], units: usize) -> Option<u32> {
        let size = |n: u32, nodes: &[Node]| nodes[n as usize].size;
        let mut best: Option<u32> = None;
        for &b in bins {
            if let Some(n) = self.bins[b as usize].find(units) {
                if best.is_none_or(|m| size(n, &self.nodes) < size(m, &self.nodes)) {
                    best = Some(n);
                }
            }
        }
        if best.is_some() {
            return best;
        }
        for &b in bins {
            if let Some(n) = self.bins[b as usize].find_in_class(&mut self.nodes, units) {
                if best.is_none_or(|m| size(n, &self.nodes) < size(m, &self.nodes)) {
                    best = Some(n);
                }
            }
        }
        best
    }

    /// Makes a live block of `size` bytes at `align` out of free `node` (which fits); the
    /// padding and the tail stay free in the node's bin.
    fn carve(&mut self, node: u32, size: usize, align: usize, bytes: usize) -> NonNull<u8> {
        let addr = self.nodes[node as usize].addr;
        let start = align_up(addr, align).expect("the block fits, so this does not overflow");
        self.carve_at(node, start, size, bytes)
    }

    /// Makes a live block of `size` bytes at `start` (a GRAIN multiple) out of free `node`,
    /// which holds `[start, start + size)`; the free bytes either side stay in the node's bin.
    fn carve_at(&mut self, node: u32, start: usize, size: usize, bytes: usize) -> NonNull<u8> {
        let bin = self.nodes[node as usize].bin;
        self.unfile(node);
        let Node {
            addr, size: total, ..
        } = self.nodes[node as usize];
        let end = addr + total;
        debug_assert!(start >= addr && start % GRAIN == 0 && start + size <= end);
        let mut live = node;
        if start > addr {
            self.nodes[node as usize].size = start - addr;
            live = self.split_after(node, start, end - start);
            self.file(node, bin);
        }
        if end > start + size {
            self.nodes[live as usize].size = size;
            let tail = self.split_after(live, start + size, end - start - size);
            self.file(tail, bin);
        }
        let n = &mut self.nodes[live as usize];
        debug_assert!(n.size == size && size - bytes < GRAIN);
        n.bin = LIVE;
        n.slack = (n.size - bytes) as u8;
        self.live.insert(&self.nodes, start, live);
        self.in_use += size;
        NonNull::new(start as *mut u8).expect("chunk addresses are non-null")
    }

    /// A new node `[addr, addr + size)` linked after `prev` in its chunk.
    fn split_after(&mut self, prev: u32, addr: usize, size: usize) -> u32 {
        let next = self.nodes[prev as usize].phys.1;
        let n = self.new_node(addr, size, (prev, next));
        self.nodes[prev as usize].phys.1 = n;
        if next != NIL {
            self.nodes[next as usize].phys.0 = n;
        }
        n
    }

    /// Files unfiled `node` into `bin`, first merging free neighbours `bin` may absorb (its
    /// own stream's and *any* blocks; every free block when `bin` is *any*). Returns the node
    /// now holding the block.
    fn coalesce_into(&mut self, node: u32, bin: u32) -> u32 {
        let own = tag_of_bin(bin);
        let absorbs = |other: u32| {
            other != LIVE
                && other != SPARE
                && (own.is_none() || other == ANY || tag_of_bin(other) == own)
        };
        // Loops: when everything merges into *any*, runs of differently tagged blocks do.
        let mut cur = node;
        loop {
            let prev = self.nodes[cur as usize].phys.0;
            if prev == NIL || !absorbs(self.nodes[prev as usize].bin) {
                break;
            }
            self.unfile(prev);
            self.absorb_next(prev);
            cur = prev;
        }
        loop {
            let next = self.nodes[cur as usize].phys.1;
            if next == NIL || !absorbs(self.nodes[next as usize].bin) {
                break;
            }
            self.unfile(next);
            self.absorb_next(cur);
        }
        self.file(cur, bin);
        cur
    }

    /// Merges `node`'s next neighbour into it (both unfiled).
    fn absorb_next(&mut self, node: u32) {
        let next = self.nodes[node as usize].phys.1;
        let Node {
            size,
            phys: (_, after),
            ..
        } = self.nodes[next as usize];
        let n = &mut self.nodes[node as usize];
        n.size += size;
        n.phys.1 = after;
        if after != NIL {
            self.nodes[after as usize].phys.0 = node;
        }
        self.release_node(next);
    }

    #[inline]
    fn file(&mut self, node: u32, bin: u32) {
        self.nodes[node as usize].bin = bin;
        self.bins[bin as usize].insert(&mut self.nodes, node);
    }

    #[inline]
    fn unfile(&mut self, node: u32) {
        let bin = self.nodes[node as usize].bin;
        self.bins[bin as usize].remove(&mut self.nodes, node);
    }

    fn new_node(&mut self, addr: usize, size: usize, phys: (u32, u32)) -> u32 {
        let node = Node {
            addr,
            size,
            phys,
            link: (NIL, NIL),
            bin: SPARE,
            slack: 0,
        };
        match self.spare.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn release_node(&mut self, node: u32) {
        self.nodes[node as usize].bin = SPARE;
        self.spare.push(node);
    }

    /// Why a free of `ptr` is refused: a pointer inside free memory of ours was freed twice.
    /// (A walk of the chunk: only on this error path.)
    #[cold]
    fn classify(&self, name: &'static str, ptr: usize) -> Error {
        let mut at = match self.chunks.range(..=ptr).next_back() {
            // Only a pointer inside one of our chunks needs the walk.
            Some((&base, &(size, head))) if ptr < base + size => head,
            _ => NIL,
        };
        while at != NIL {
            let n = &self.nodes[at as usize];
            if ptr < n.addr + n.size {
                if ptr >= n.addr && n.bin != LIVE {
                    return Error::DoubleFree {
                        resource: name,
                        ptr,
                    };
                }
                break;
            }
            at = n.phys.1;
        }
        Error::UnknownPointer {
            resource: name,
            ptr,
        }
    }

    /// Checks every internal invariant; the error says which one broke.
    pub fn check_invariants(&mut self) -> std::result::Result<(), String> {
        let mut total = 0;
        let (mut seen, mut free, mut used, mut live) = (0usize, 0usize, 0usize, 0usize);
        let mergeable = |a: u32, b: u32| a == ANY || b == ANY || tag_of_bin(a) == tag_of_bin(b);
        for (&base, &(csize, head)) in &self.chunks {
            total += csize;
            let (mut at, mut prev, mut addr) = (head, NIL, base);
            while at != NIL {
                let n = self
                    .nodes
                    .get(at as usize)
                    .ok_or(format!("node {at} out of range"))?;
                seen += 1;
                if seen > self.nodes.len() {
                    return Err("a chunk's block chain cycles".into());
                }
                if n.addr != addr || n.phys.0 != prev {
                    return Err(format!("gap, overlap or bad link at {addr:#x} (node {at})"));
                }
                if n.size == 0 || n.size % GRAIN != 0 || n.addr % GRAIN != 0 {
                    return Err(format!("block {:#x}+{} not on the grain", n.addr, n.size));
                }
                match n.bin {
                    SPARE => return Err(format!("spare node {at} in chunk {base:#x}")),
                    LIVE => {
                        live += 1;
                        used += n.size;
                        if self.live.get(&self.nodes, n.addr) != Some(at) {
                            return Err(format!("live block {:#x} not in the live map", n.addr));
                        }
                    }
                    b if b as usize >= self.bins.len() => {
                        return Err(format!("node {at} in unknown bin {b}"))
                    }
                    b => {
                        free += 1;
                        let p = if prev == NIL {
                            LIVE
                        } else {
                            self.nodes[prev as usize].bin
                        };
                        if p != LIVE && mergeable(p, b) {
                            return Err(format!(
                                "adjacent free blocks at {:#x} (bins {p}, {b}) not coalesced",
                                n.addr
                            ));
                        }
                    }
                }
                addr += n.size;
                prev = at;
                at = n.phys.1;
            }
            if addr != base + csize {
                return Err(format!(
                    "chunk {base:#x} tiled to {addr:#x}, not {csize} bytes"
                ));
            }
        }
        if seen + self.spare.len() != self.nodes.len() {
            return Err(format!(
                "{seen} nodes in chunks + {} spare != {}",
                self.spare.len(),
                self.nodes.len()
            ));
        }
        if total != self.pool_size {
            return Err(format!(
                "pool size {} != chunk total {total}",
                self.pool_size
            ));
        }
        if used != self.in_use || live != self.live.len() {
            return Err(format!(
                "in_use {} / {} live, but chunks hold {used} / {live}",
                self.in_use,
                self.live.len()
            ));
        }
        if self.bins.len() != 1 + 2 * self.tags.len() {
            return Err("bins and stream tags disagree".into());
        }
        let mut filed = 0;
        for b in 0..self.bins.len() {
            let bin = &self.bins[b];
            bin.check(&mut self.nodes)
                .map_err(|e| format!("bin {b}: {e}"))?;
            for n in bin.nodes(&mut self.nodes) {
                if self.nodes[n as usize].bin != b as u32 {
                    return Err(format!("node {n} filed in bin {b} but tagged otherwise"));
                }
            }
            filed += bin.len();
        }
        if filed != free {
            return Err(format!("{filed} filed free blocks, {free} free in chunks"));
        }
        Ok(())
    }
}

/// How far [`allocate_from`] may go for memory that other streams freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Only blocks reachable with one event wait.
    Events,
    /// Also every free block, after one device-wide synchronisation.
    Synchronize,
}

/// Finds a block for a checked request in `core` without growing it: the stream's own and
/// *any* blocks first; then the best-fitting sealed block of another stream (one wait on that
/// stream's last mark); then, with [`Reach::Synchronize`] and if free memory could serve the
/// request, every free block merged after one device-wide synchronisation, so fragmentation
/// across streams never forces growth. No stream but `stream` is named to `order`'s driver
/// calls. Each block is placed with `placer` when one is given ([`Placer`]), by best fit
/// otherwise.
// `id` comes with `stream`, taken once by the caller: a default stream's id asks the driver.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn allocate_from(
    core: &mut PoolCore,
    order: &dyn StreamOrder,
    stream: StreamRef<'_>,
    id: StreamId,
    bytes: usize,
    align: usize,
    reach: Reach,
    placer: Option<&dyn Placer>,
) -> Result<Option<NonNull<u8>>> {
    if core.mark_every_free {
        core.allocs += 1;
        let t = core.tag(id);
        core.tags[t].last_alloc = core.allocs;
        if core.unconfirmed {
            // A failed query only keeps the blocks sealed: nothing to report.
            core.release_confirmed(id, |s| order.mark_complete(s).unwrap_or(false));
        }
    }
    if let Some(p) = core.take_with(id, bytes, align, placer) {
        return Ok(Some(p));
    }
    // Marks are worth their driver call only while other streams' blocks could help.
    if core.others_hold_free(id) {
        core.note_demand();
    }
    if let Some((victim, node)) = core.sealed_fit_elsewhere(id, bytes, align) {
        order.wait_for_mark(stream, victim)?;
        core.adopt(node, id);
        if let Some(p) = core.take_with(id, bytes, align, placer) {
            return Ok(Some(p));
        }
    }
    let needed = footprint(bytes, align).map_or(usize::MAX, |f| f.1);
    if reach == Reach::Synchronize
        && core.others_hold_free(id)
        && core.pool_size() - core.in_use() >= needed
    {
        order.synchronize_all()?;
        core.merge_all();
        return Ok(core.take_with(id, bytes, align, placer));
    }
    Ok(None)
}

/// Frees a block into `core`, sealing `stream`'s fresh blocks when a mark is due (or at once
/// with `mark_now`, for a block whose core other streams allocate from).
// `id` comes with `stream`, taken once by the caller: a default stream's id asks the driver.
#[allow(clippy::too_many_arguments)]
#[inline]
pub(crate) fn free_into(
    core: &mut PoolCore,
    order: &dyn StreamOrder,
    name: &'static str,
    stream: StreamRef<'_>,
    id: StreamId,
    ptr: usize,
    bytes: usize,
    mark_now: bool,
) -> Result<Option<EmptyChunk>> {
    let freed = core.free(name, id, ptr, bytes)?;
    // A failed mark only keeps the fresh blocks private to `stream` (others reach them after a
    // device-wide synchronisation), and the free itself is done: nothing to report.
    if (freed.mark_due || mark_now) && order.mark(stream).is_ok() {
        core.seal(id);
    }
    Ok(freed.empty)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::{HostOrder, OrderEvent, RecordingOrder};
    use crate::stream::StreamRef;

    const A: StreamRef<'static> = StreamRef::simulated(1);
    const B: StreamRef<'static> = StreamRef::simulated(2);

    fn core_with(size: usize) -> PoolCore {
        let mut c = PoolCore::default();
        c.add_chunk(1 << 20, size, Some(A.id()));
        c
    }

    #[test]
    fn splits_and_coalesces_back_to_one_block() {
        let mut c = core_with(4096);
        let p: Vec<_> = (0..4)
            .map(|_| c.take(A.id(), 1000, GRAIN).unwrap())
            .collect();
        assert_eq!(c.in_use(), 4096);
        assert!(c.take(A.id(), 1, GRAIN).is_none());
        for i in [1, 3, 0] {
            c.free("t", A.id(), p[i].as_ptr() as usize, 1000).unwrap();
            c.check_invariants().unwrap();
        }
        let last = c.free("t", A.id(), p[2].as_ptr() as usize, 1000).unwrap();
        assert_eq!(last.empty.map(|e| e.size), Some(4096));
        assert_eq!(c.largest_free(), 4096);
        assert!(c.remove_chunk(1 << 20));
        c.check_invariants().unwrap();
        assert_eq!(c.pool_size(), 0);
    }

    #[test]
    fn honours_large_alignment_and_keeps_the_padding() {
        let mut c = core_with(16 * GRAIN);
        let small = c.take(A.id(), 1, GRAIN).unwrap();
        let big = c.take(A.id(), 100, 2048).unwrap();
        assert_eq!(big.as_ptr() as usize % 2048, 0);
        c.check_invariants().unwrap();
        c.free("t", A.id(), big.as_ptr() as usize, 100).unwrap();
        c.free("t", A.id(), small.as_ptr() as usize, 1).unwrap();
        assert_eq!(c.largest_free(), 16 * GRAIN);
    }

    #[test]
    fn other_streams_blocks_are_merged_only_through_the_order() {
        let mut c = core_with(2 * GRAIN);
        let x = c.take(A.id(), GRAIN, GRAIN).unwrap();
        let y = c.take(A.id(), GRAIN, GRAIN).unwrap();
        c.free("t", A.id(), x.as_ptr() as usize, GRAIN).unwrap();
        c.free("t", B.id(), y.as_ptr() as usize, GRAIN).unwrap();
        c.check_invariants().unwrap();
        let s = StreamRef::simulated(3);
        assert!(c.take(s.id(), 2 * GRAIN, GRAIN).is_none());
        let order = RecordingOrder::new();
        let p = allocate_from(
            &mut c,
            &order,
            s,
            s.id(),
            2 * GRAIN,
            GRAIN,
            Reach::Synchronize,
            None,
        )
        .unwrap();
        assert!(p.is_some());
        assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
        c.check_invariants().unwrap();
    }

    #[test]
    fn sealed_blocks_cross_streams_with_one_wait_and_fresh_ones_never_do() {
        let mut c = core_with(4 * GRAIN);
        let order = RecordingOrder::new();
        let x = c.take(A.id(), GRAIN, GRAIN).unwrap();
        let _keep = c.take(A.id(), GRAIN, GRAIN).unwrap();
        free_into(
            &mut c,
            &order,
            "t",
            A,
            A.id(),
            x.as_ptr() as usize,
            GRAIN,
            false,
        )
        .unwrap();
        // Fresh on A: B may not wait on A's (older) mark for it.
        assert!(c.sealed_fit_elsewhere(B.id(), GRAIN, GRAIN).is_none());
        order.mark(A).unwrap();
        c.seal(A.id());
        let p = allocate_from(
            &mut c,
            &order,
            B,
            B.id(),
            GRAIN,
            GRAIN,
            Reach::Synchronize,
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            order.events(),
            vec![
                OrderEvent::Mark(A.id()),
                OrderEvent::Wait {
                    waiter: B.id(),
                    signaller: A.id()
                }
            ]
        );
        c.check_invariants().unwrap();
        c.free("t", B.id(), p.as_ptr() as usize, GRAIN).unwrap();
        c.check_invariants().unwrap();
    }

    #[test]
    fn a_stream_is_marked_once_per_mark_every_frees_and_only_under_demand() {
        let mut c = core_with(1 << 20);
        let order = RecordingOrder::new();
        let cycle = |c: &mut PoolCore| {
            for _ in 0..MARK_EVERY {
                let p = c.take(A.id(), 300, GRAIN).unwrap();
                free_into(c, &order, "t", A, A.id(), p.as_ptr() as usize, 300, false).unwrap();
            }
        };
        cycle(&mut c);
        assert_eq!(order.events(), vec![], "no stream wants A's blocks");
        // B runs short (A's blocks are fresh: reaching them takes a synchronisation).
        let p = allocate_from(
            &mut c,
            &order,
            B,
            B.id(),
            300,
            GRAIN,
            Reach::Synchronize,
            None,
        )
        .unwrap()
        .unwrap();
        assert_eq!(order.events(), vec![OrderEvent::SyncAll]);
        cycle(&mut c);
        cycle(&mut c);
        assert_eq!(
            order.events(),
            vec![OrderEvent::SyncAll, OrderEvent::Mark(A.id())],
            "one mark per shortage"
        );
        c.free("t", B.id(), p.as_ptr() as usize, 300).unwrap();
        c.check_invariants().unwrap();
    }

    /// A holds two blocks and B one; B has allocated, so A's frees are marked at once when the
    /// core marks every free.
    fn shared_core(every: bool) -> (PoolCore, [usize; 2]) {
        let mut c = PoolCore::marking_every_free(every);
        c.add_chunk(1 << 20, 2 * GRAIN, Some(A.id()));
        c.add_chunk(1 << 21, GRAIN, Some(B.id()));
        let order = RecordingOrder::new();
        let mut take = |s| {
            let p = allocate_from(&mut c, &order, s, s.id(), GRAIN, GRAIN, Reach::Events, None);
            p.unwrap().unwrap().as_ptr() as usize
        };
        let x = [take(A), take(A)];
        take(B);
        (c, x)
    }

    #[test]
    fn marking_every_free_hands_a_block_over_once_the_device_is_past_it() {
        let (mut c, [x, _]) = shared_core(true);
        let order = RecordingOrder::new();
        free_into(&mut c, &order, "t", A, A.id(), x, GRAIN, false).unwrap();
        assert_eq!(order.events(), vec![OrderEvent::Mark(A.id())]);
        let p =
            allocate_from(&mut c, &order, B, B.id(), GRAIN, GRAIN, Reach::Events, None).unwrap();
        assert_eq!(p.map(|p| p.as_ptr() as usize), Some(x));
        assert_eq!(
            order.events(),
            vec![OrderEvent::Mark(A.id()), OrderEvent::Query(A.id())],
            "no wait, no synchronisation"
        );
        c.check_invariants().unwrap();

        // Off (the default), the same free is not marked and B cannot reach the block.
        let (mut c, [x, _]) = shared_core(false);
        let order = RecordingOrder::new();
        free_into(&mut c, &order, "t", A, A.id(), x, GRAIN, false).unwrap();
        let p =
            allocate_from(&mut c, &order, B, B.id(), GRAIN, GRAIN, Reach::Events, None).unwrap();
        assert!(p.is_none());
        assert_eq!(order.events(), vec![]);
    }

    #[test]
    fn a_mark_the_device_has_not_passed_costs_a_wait_and_is_not_asked_again_at_once() {
        let (mut c, [x, y]) = shared_core(true);
        let order = RecordingOrder::pending();
        let wait = OrderEvent::Wait {
            waiter: B.id(),
            signaller: A.id(),
        };
        for (p, expected) in [
            (
                x,
                vec![OrderEvent::Mark(A.id()), OrderEvent::Query(A.id()), wait],
            ),
            // Within QUERY_EVERY allocations of the answer "not yet": no query.
            (y, vec![OrderEvent::Mark(A.id()), wait]),
        ] {
            let seen = order.events().len();
            free_into(&mut c, &order, "t", A, A.id(), p, GRAIN, false).unwrap();
            let q = allocate_from(&mut c, &order, B, B.id(), GRAIN, GRAIN, Reach::Events, None)
                .unwrap();
            assert_eq!(q.map(|q| q.as_ptr() as usize), Some(p));
            assert_eq!(order.events()[seen..], expected);
            c.check_invariants().unwrap();
        }
    }

    #[test]
    fn refuses_foreign_pointers_and_double_frees() {
        let mut c = core_with(4 * GRAIN);
        let p = c.take(A.id(), 10, GRAIN).unwrap().as_ptr() as usize;
        assert!(matches!(
            c.free("t", A.id(), 0x10, 10),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            c.free("t", A.id(), p, 11),
            Err(Error::SizeMismatch { .. })
        ));
        c.free("t", A.id(), p, 10).unwrap();
        assert!(matches!(
            c.free("t", A.id(), p, 10),
            Err(Error::DoubleFree { .. })
        ));
        c.check_invariants().unwrap();
    }

    /// Random allocations and frees on three streams in one small chunk, through every path
    /// (own blocks, waits, merges): invariants hold after each step and live blocks never
    /// overlap.
    #[test]
    fn random_multi_stream_sequences_keep_every_invariant() {
        use rand::rngs::SmallRng;
        use rand::{RngExt, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..600 {
            let mut c = PoolCore::marking_every_free(round % 2 == 1);
            c.add_chunk(1 << 30, 64 * GRAIN, None);
            let mut live: Vec<(usize, usize, usize)> = vec![];
            for _ in 0..60 {
                let s = StreamRef::simulated(rng.random_range(0..3));
                if rng.random_bool(0.6) {
                    let bytes = rng.random_range(1..8 * GRAIN);
                    let align = GRAIN << rng.random_range(0..3);
                    if let Some(p) = allocate_from(
                        &mut c,
                        &HostOrder,
                        s,
                        s.id(),
                        bytes,
                        align,
                        Reach::Synchronize,
                        None,
                    )
                    .unwrap()
                    {
                        let a = p.as_ptr() as usize;
                        assert_eq!(a % align, 0);
                        let end = a + bytes;
                        assert!(live.iter().all(|&(b, n, _)| end <= b || b + n <= a));
                        live.push((a, bytes, align));
                    }
                } else if !live.is_empty() {
                    let (p, bytes, _) = live.swap_remove(rng.random_range(0..live.len()));
                    free_into(&mut c, &HostOrder, "t", s, s.id(), p, bytes, false).unwrap();
                }
                c.check_invariants().unwrap();
            }
        }
    }
}
