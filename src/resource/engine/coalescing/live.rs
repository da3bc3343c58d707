//! Live blocks by address. The table holds only node indices (4 bytes each) and compares
//! against the nodes' own addresses, a quarter of the bytes of a map from address to index, so
//! a core with tens of thousands of live blocks keeps more of its bookkeeping in cache (which
//! is what limits arenas on many threads at once).

use hashbrown::HashTable;

/// A node's address, as the index needs it.
pub(crate) trait NodeAddr {
    fn addr_of(&self, node: u32) -> usize;
}

#[derive(Debug, Default)]
pub(crate) struct LiveIndex {
    table: HashTable<u32>,
}

/// Addresses are distinct multiples of 256: a folded 128-bit multiply mixes them into both the
/// low bits (the bucket) and the high bits (the control byte).
#[inline]
fn hash(addr: usize) -> u64 {
    let p = ((addr >> 8) as u128).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (p as u64) ^ ((p >> 64) as u64)
}

impl LiveIndex {
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// Files `node`, which is at `addr` and not filed yet.
    pub fn insert(&mut self, nodes: &impl NodeAddr, addr: usize, node: u32) {
        debug_assert_eq!(nodes.addr_of(node), addr);
        self.table
            .insert_unique(hash(addr), node, |&n| hash(nodes.addr_of(n)));
    }

    /// Unfiles and returns the node at `addr`.
    pub fn remove(&mut self, nodes: &impl NodeAddr, addr: usize) -> Option<u32> {
        self.table
            .find_entry(hash(addr), |&n| nodes.addr_of(n) == addr)
            .ok()
            .map(|e| e.remove().0)
    }

    pub fn get(&self, nodes: &impl NodeAddr, addr: usize) -> Option<u32> {
        self.table
            .find(hash(addr), |&n| nodes.addr_of(n) == addr)
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Addrs(Vec<usize>);
    impl NodeAddr for Addrs {
        fn addr_of(&self, n: u32) -> usize {
            self.0[n as usize]
        }
    }

    #[test]
    fn finds_removes_and_survives_growth() {
        let nodes = Addrs((0..5000).map(|i| 0x7f00_0000_0000 + i * 256).collect());
        let mut live = LiveIndex::default();
        for n in (0..5000u32).step_by(2) {
            live.insert(&nodes, nodes.addr_of(n), n);
        }
        assert_eq!(live.len(), 2500);
        for n in 0..5000u32 {
            let want = (n % 2 == 0).then_some(n);
            assert_eq!(live.get(&nodes, nodes.addr_of(n)), want);
        }
        assert_eq!(live.remove(&nodes, nodes.addr_of(2)), Some(2));
        assert_eq!(live.remove(&nodes, nodes.addr_of(2)), None);
        assert_eq!(live.remove(&nodes, nodes.addr_of(3)), None);
        assert_eq!(live.len(), 2499);
    }
}
