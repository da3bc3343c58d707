//! The coalescing block index shared by the pool and the arena's per-thread arenas.
//!
//! Plain host bookkeeping over address ranges (it never touches the memory): upstream chunks,
//! free blocks indexed by address (to coalesce) and per stream by `(size, address)` (best fit in
//! O(log n)), and live blocks by address (to validate frees). Free blocks carry the stream they
//! were freed on and merge only with neighbours of the same stream and chunk.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::resource::{align_up, DEFAULT_ALIGNMENT};
use crate::stream::StreamRef;

use super::super::StreamOrder;

/// Every block is a multiple of this, at an address aligned to it.
pub(crate) const GRAIN: usize = DEFAULT_ALIGNMENT;

/// Keys are distinct 256-byte-aligned addresses: a multiply-shift hash spreads them well and
/// costs far less than SipHash, which no attacker-chosen key here needs.
#[derive(Clone, Copy, Debug, Default)]
struct AddrHasher(u64);

impl Hasher for AddrHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = ((n as u64) >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

type AddrMap<V> = HashMap<usize, V, BuildHasherDefault<AddrHasher>>;

#[derive(Clone, Copy, Debug)]
struct Free {
    size: usize,
    stream: StreamRef,
}

#[derive(Clone, Copy, Debug)]
struct Live {
    size: usize,
    bytes: usize,
}

/// A chunk that a free left wholly free.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EmptyChunk {
    pub base: usize,
    pub size: usize,
    pub stream: StreamRef,
}

#[derive(Debug, Default)]
pub(crate) struct PoolCore {
    chunks: BTreeMap<usize, usize>,
    free: BTreeMap<usize, Free>,
    by_size: Vec<(StreamRef, BTreeSet<(usize, usize)>)>,
    live: AddrMap<Live>,
    pool_size: usize,
    in_use: usize,
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
    pub fn largest_free(&self) -> usize {
        self.by_size
            .iter()
            .filter_map(|(_, set)| set.last().map(|&(s, _)| s))
            .max()
            .unwrap_or(0)
    }
    /// True when `ptr` is a live block of this core.
    pub fn owns(&self, ptr: usize) -> bool {
        self.live.contains_key(&ptr)
    }

    /// Adds an upstream chunk (GRAIN-aligned base and size), free on `stream`.
    pub fn add_chunk(&mut self, base: usize, size: usize, stream: StreamRef) {
        debug_assert!(base % GRAIN == 0 && size % GRAIN == 0 && size > 0);
        self.chunks.insert(base, size);
        self.pool_size += size;
        self.insert_raw(base, size, stream);
    }

    /// Removes a wholly free chunk; false if it is not one.
    pub fn remove_chunk(&mut self, base: usize) -> bool {
        let Some(&size) = self.chunks.get(&base) else {
            return false;
        };
        match self.free.get(&base) {
            Some(f) if f.size == size => {
                self.remove_free(base);
                self.chunks.remove(&base);
                self.pool_size -= size;
                true
            }
            _ => false,
        }
    }

    /// True when the chunk at `base` is one free block.
    pub fn is_empty_chunk(&self, base: usize) -> bool {
        matches!((self.chunks.get(&base), self.free.get(&base)), (Some(&c), Some(f)) if f.size == c)
    }

    /// Chunks with no live block, each as one free block (coalesced on a single stream).
    pub fn empty_chunks(&self) -> Vec<EmptyChunk> {
        self.chunks
            .iter()
            .filter_map(|(&base, &size)| match self.free.get(&base) {
                Some(f) if f.size == size => Some(EmptyChunk {
                    base,
                    size,
                    stream: f.stream,
                }),
                _ => None,
            })
            .collect()
    }

    /// Every chunk, for returning them all to the upstream.
    pub fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.chunks.iter().map(|(&b, &s)| (b, s))
    }

    /// Best fit among `stream`'s own free blocks.
    pub fn take(&mut self, stream: StreamRef, bytes: usize, align: usize) -> Option<NonNull<u8>> {
        let (size, search) = footprint(bytes, align)?;
        let set = &self.by_size.iter().find(|(s, _)| *s == stream)?.1;
        let &(bsize, addr) = set.range((search, 0)..).next()?;
        let start = align_up(addr, align)?;
        self.remove_free(addr);
        if start > addr {
            self.insert_raw(addr, start - addr, stream);
        }
        let (end, bend) = (start + size, addr + bsize);
        if bend > end {
            self.insert_raw(end, bend - end, stream);
        }
        self.live.insert(start, Live { size, bytes });
        self.in_use += size;
        NonNull::new(start as *mut u8)
    }

    /// The best-fitting free block of another stream, with that stream.
    pub fn other_fit(
        &self,
        stream: StreamRef,
        bytes: usize,
        align: usize,
    ) -> Option<(StreamRef, usize)> {
        let (_, search) = footprint(bytes, align)?;
        self.by_size
            .iter()
            .filter(|(s, _)| *s != stream)
            .filter_map(|(s, set)| {
                set.range((search, 0)..)
                    .next()
                    .map(|&(size, a)| (size, a, *s))
            })
            .min()
            .map(|(_, a, s)| (s, a))
    }

    /// Hands one free block to `to`, coalescing (the caller has ordered `to` after its stream).
    pub fn retag_block(&mut self, addr: usize, to: StreamRef) {
        if let Some(f) = self.free.get(&addr).copied() {
            self.remove_free(addr);
            self.insert_coalesced(addr, f.size, to);
        }
    }

    /// The other streams holding free blocks.
    pub fn other_streams(&self, stream: StreamRef) -> Vec<StreamRef> {
        self.by_size
            .iter()
            .filter(|(s, set)| *s != stream && !set.is_empty())
            .map(|(s, _)| *s)
            .collect()
    }

    /// Hands all of `from`'s free blocks to `to`, coalescing (the caller has ordered `to`
    /// after `from`).
    pub fn retag(&mut self, from: StreamRef, to: StreamRef) {
        let Some(i) = self.by_size.iter().position(|(s, _)| *s == from) else {
            return;
        };
        let (_, set) = self.by_size.swap_remove(i);
        let mut blocks: Vec<(usize, usize)> = set.into_iter().map(|(s, a)| (a, s)).collect();
        blocks.sort_unstable();
        for &(addr, _) in &blocks {
            self.free.remove(&addr);
        }
        for (addr, size) in blocks {
            self.insert_coalesced(addr, size, to);
        }
    }

    /// Frees a live block on `stream`; returns its chunk if that is now wholly free.
    pub fn free(
        &mut self,
        name: &'static str,
        stream: StreamRef,
        ptr: usize,
        bytes: usize,
    ) -> Result<Option<EmptyChunk>> {
        let Some(&live) = self.live.get(&ptr) else {
            return Err(self.classify(name, ptr));
        };
        if live.bytes != bytes {
            return Err(Error::SizeMismatch {
                resource: name,
                ptr,
                allocated: live.bytes,
                freed: bytes,
            });
        }
        self.live.remove(&ptr);
        self.in_use -= live.size;
        let (start, size) = self.insert_coalesced(ptr, live.size, stream);
        match self.chunks.get(&start) {
            Some(&csize) if csize == size => Ok(Some(EmptyChunk {
                base: start,
                size,
                stream,
            })),
            _ => Ok(None),
        }
    }

    /// Why a free of `ptr` is refused: a pointer inside free memory of ours was freed twice.
    fn classify(&self, name: &'static str, ptr: usize) -> Error {
        let in_free = self
            .free
            .range(..=ptr)
            .next_back()
            .is_some_and(|(&a, f)| ptr < a + f.size);
        if in_free {
            Error::DoubleFree {
                resource: name,
                ptr,
            }
        } else {
            Error::UnknownPointer {
                resource: name,
                ptr,
            }
        }
    }

    fn chunk_of(&self, addr: usize) -> (usize, usize) {
        let (&base, &size) = self
            .chunks
            .range(..=addr)
            .next_back()
            .expect("free blocks lie in chunks");
        (base, base + size)
    }

    /// Inserts a free block, merging with same-stream neighbours of its chunk.
    fn insert_coalesced(&mut self, addr: usize, size: usize, stream: StreamRef) -> (usize, usize) {
        let (chunk_start, chunk_end) = self.chunk_of(addr);
        let (mut start, mut size) = (addr, size);
        if start > chunk_start {
            if let Some((&pa, &pf)) = self.free.range(..start).next_back() {
                if pa + pf.size == start && pf.stream == stream {
                    self.remove_free(pa);
                    start = pa;
                    size += pf.size;
                }
            }
        }
        let end = start + size;
        if end < chunk_end {
            if let Some(&nf) = self.free.get(&end) {
                if nf.stream == stream {
                    self.remove_free(end);
                    size += nf.size;
                }
            }
        }
        self.insert_raw(start, size, stream);
        (start, size)
    }

    fn insert_raw(&mut self, addr: usize, size: usize, stream: StreamRef) {
        self.free.insert(addr, Free { size, stream });
        let set = match self.by_size.iter().position(|(s, _)| *s == stream) {
            Some(i) => &mut self.by_size[i].1,
            None => {
                self.by_size.push((stream, BTreeSet::new()));
                &mut self.by_size.last_mut().expect("just pushed").1
            }
        };
        set.insert((size, addr));
    }

    fn remove_free(&mut self, addr: usize) {
        if let Some(f) = self.free.remove(&addr) {
            if let Some(i) = self.by_size.iter().position(|(s, _)| *s == f.stream) {
                self.by_size[i].1.remove(&(f.size, addr));
                if self.by_size[i].1.is_empty() {
                    self.by_size.swap_remove(i);
                }
            }
        }
    }

    /// Checks every internal invariant; the error says which one broke.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let mut blocks: Vec<(usize, usize, Option<StreamRef>)> = self
            .free
            .iter()
            .map(|(&a, f)| (a, f.size, Some(f.stream)))
            .chain(self.live.iter().map(|(&a, l)| (a, l.size, None)))
            .collect();
        blocks.sort_unstable_by_key(|b| b.0);
        let mut it = blocks.iter().peekable();
        let mut total = 0;
        for (&base, &csize) in &self.chunks {
            total += csize;
            let mut at = base;
            let mut prev_stream: Option<StreamRef> = None;
            while at < base + csize {
                let &&(a, s, st) = it
                    .peek()
                    .ok_or(format!("chunk {base:#x} not tiled at {at:#x}"))?;
                if a != at {
                    return Err(format!("gap or overlap at {at:#x}: next block at {a:#x}"));
                }
                if s == 0 || s % GRAIN != 0 || a % GRAIN != 0 {
                    return Err(format!("block {a:#x}+{s} not on the {GRAIN}-byte grain"));
                }
                if st.is_some() && st == prev_stream {
                    return Err(format!("adjacent free blocks at {a:#x} not coalesced"));
                }
                prev_stream = st;
                at += s;
                it.next();
            }
            if at != base + csize {
                return Err(format!("block crosses the end of chunk {base:#x}"));
            }
        }
        if let Some(b) = it.next() {
            return Err(format!("block {:#x} lies outside every chunk", b.0));
        }
        if total != self.pool_size {
            return Err(format!(
                "pool size {} != chunk total {total}",
                self.pool_size
            ));
        }
        let used: usize = self.live.values().map(|l| l.size).sum();
        if used != self.in_use {
            return Err(format!("in_use {} != live total {used}", self.in_use));
        }
        let indexed: usize = self.by_size.iter().map(|(_, s)| s.len()).sum();
        if indexed != self.free.len() {
            return Err(format!(
                "{indexed} indexed free blocks, {} free",
                self.free.len()
            ));
        }
        for (stream, set) in &self.by_size {
            if set.is_empty() {
                return Err(format!("empty size index kept for {stream:?}"));
            }
            for &(size, addr) in set {
                match self.free.get(&addr) {
                    Some(f) if f.size == size && f.stream == *stream => {}
                    _ => return Err(format!("size index entry {addr:#x}+{size} is stale")),
                }
            }
        }
        Ok(())
    }
}

/// Finds a block for a checked request in `core` without growing it: the stream's own blocks
/// first; then the best-fitting block of another stream (one wait); then every stream's free
/// blocks merged (one wait per stream), so fragmentation across streams never forces growth.
/// Taking one block rather than a whole stream's list keeps two streams that trade blocks from
/// moving thousands of blocks back and forth.
pub(crate) fn allocate_from(
    core: &mut PoolCore,
    order: &dyn StreamOrder,
    stream: StreamRef,
    bytes: usize,
    align: usize,
) -> Result<Option<NonNull<u8>>> {
    if let Some(p) = core.take(stream, bytes, align) {
        return Ok(Some(p));
    }
    if let Some((victim, block)) = core.other_fit(stream, bytes, align) {
        order.order_after(stream, victim)?;
        core.retag_block(block, stream);
        if let Some(p) = core.take(stream, bytes, align) {
            return Ok(Some(p));
        }
    }
    let others = core.other_streams(stream);
    if others.is_empty() {
        return Ok(None);
    }
    for s in others {
        order.order_after(stream, s)?;
        core.retag(s, stream);
    }
    Ok(core.take(stream, bytes, align))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::HostOrder;

    const A: StreamRef = StreamRef::simulated(1);
    const B: StreamRef = StreamRef::simulated(2);

    fn core_with(size: usize) -> PoolCore {
        let mut c = PoolCore::default();
        c.add_chunk(1 << 20, size, A);
        c
    }

    #[test]
    fn splits_and_coalesces_back_to_one_block() {
        let mut c = core_with(4096);
        let p: Vec<_> = (0..4).map(|_| c.take(A, 1000, GRAIN).unwrap()).collect();
        assert_eq!(c.in_use(), 4096);
        assert!(c.take(A, 1, GRAIN).is_none());
        for i in [1, 3, 0] {
            c.free("t", A, p[i].as_ptr() as usize, 1000).unwrap();
            c.check_invariants().unwrap();
        }
        let last = c.free("t", A, p[2].as_ptr() as usize, 1000).unwrap();
        assert_eq!(last.map(|e| e.size), Some(4096));
        assert_eq!(c.largest_free(), 4096);
    }

    #[test]
    fn honours_large_alignment_and_keeps_the_padding() {
        let mut c = core_with(16 * GRAIN);
        let small = c.take(A, 1, GRAIN).unwrap();
        let big = c.take(A, 100, 2048).unwrap();
        assert_eq!(big.as_ptr() as usize % 2048, 0);
        c.check_invariants().unwrap();
        c.free("t", A, big.as_ptr() as usize, 100).unwrap();
        c.free("t", A, small.as_ptr() as usize, 1).unwrap();
        assert_eq!(c.largest_free(), 16 * GRAIN);
    }

    #[test]
    fn other_streams_blocks_are_merged_only_through_the_order() {
        let mut c = core_with(2 * GRAIN);
        let x = c.take(A, GRAIN, GRAIN).unwrap();
        let y = c.take(A, GRAIN, GRAIN).unwrap();
        c.free("t", A, x.as_ptr() as usize, GRAIN).unwrap();
        c.free("t", B, y.as_ptr() as usize, GRAIN).unwrap();
        c.check_invariants().unwrap();
        let s = StreamRef::simulated(3);
        assert!(c.take(s, 2 * GRAIN, GRAIN).is_none());
        let p = allocate_from(&mut c, &HostOrder, s, 2 * GRAIN, GRAIN).unwrap();
        assert!(p.is_some());
        c.check_invariants().unwrap();
    }

    #[test]
    fn refuses_foreign_pointers_and_double_frees() {
        let mut c = core_with(4 * GRAIN);
        let p = c.take(A, 10, GRAIN).unwrap().as_ptr() as usize;
        assert!(matches!(
            c.free("t", A, 0x10, 10),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            c.free("t", A, p, 11),
            Err(Error::SizeMismatch { .. })
        ));
        c.free("t", A, p, 10).unwrap();
        assert!(matches!(
            c.free("t", A, p, 10),
            Err(Error::DoubleFree { .. })
        ));
        c.check_invariants().unwrap();
    }
}
