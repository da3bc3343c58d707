//! The index's self-check, run by tests and by the resources' `check_invariants`.

use super::PoolCore;
use crate::resource::engine::coalescing::node::{tag_of_bin, ANY, GRAIN, LIVE, SPARE};
use crate::resource::engine::coalescing::tlsf::NIL;

impl PoolCore {
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
