//! Block surgery on the index: finding a fit, carving a live block out of a free one, merging
//! free neighbours, filing blocks in their bins, and recycling nodes.

use std::ptr::NonNull;

use super::PoolCore;
use crate::error::Error;
use crate::resource::engine::coalescing::node::{tag_of_bin, Node, ANY, GRAIN, LIVE, SPARE};
use crate::resource::engine::coalescing::tlsf::NIL;
use crate::resource::memory_resource::align_up;

impl PoolCore {
    /// that fails) a walk of the request's own size class.
    pub(super) fn fit(&mut self, bins: &[u32], units: usize) -> Option<u32> {
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
    pub(super) fn carve(
        &mut self,
        node: u32,
        size: usize,
        align: usize,
        bytes: usize,
    ) -> NonNull<u8> {
        let addr = self.nodes[node as usize].addr;
        let start = align_up(addr, align).expect("the block fits, so this does not overflow");
        self.carve_at(node, start, size, bytes)
    }

    /// Makes a live block of `size` bytes at `start` (a GRAIN multiple) out of free `node`,
    /// which holds `[start, start + size)`; the free bytes either side stay in the node's bin.
    pub(super) fn carve_at(
        &mut self,
        node: u32,
        start: usize,
        size: usize,
        bytes: usize,
    ) -> NonNull<u8> {
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
    pub(super) fn split_after(&mut self, prev: u32, addr: usize, size: usize) -> u32 {
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
    pub(super) fn coalesce_into(&mut self, node: u32, bin: u32) -> u32 {
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
    pub(super) fn absorb_next(&mut self, node: u32) {
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
    pub(super) fn file(&mut self, node: u32, bin: u32) {
        self.nodes[node as usize].bin = bin;
        self.bins[bin as usize].insert(&mut self.nodes, node);
    }

    #[inline]
    pub(super) fn unfile(&mut self, node: u32) {
        let bin = self.nodes[node as usize].bin;
        self.bins[bin as usize].remove(&mut self.nodes, node);
    }

    pub(super) fn new_node(&mut self, addr: usize, size: usize, phys: (u32, u32)) -> u32 {
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

    pub(super) fn release_node(&mut self, node: u32) {
        self.nodes[node as usize].bin = SPARE;
        self.spare.push(node);
    }

    /// Why a free of `ptr` is refused: a pointer inside free memory of ours was freed twice.
    /// (A walk of the chunk: only on this error path.)
    #[cold]
    pub(super) fn classify(&self, name: &'static str, ptr: usize) -> Error {
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
}
