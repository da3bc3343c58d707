//! Placement that weighs more than size. A [`Placer`] prices an address range (for a virtual
//! range: the pages a block there would have to map); when the best fit costs something, the
//! blocks that fit are weighed (up to [`SEARCH_LIMIT`]) at their cheapest spot, and the cheapest
//! wins, the smaller block on a tie. A search is rare (the best fit is usually free) and far
//! cheaper than what it saves (driver calls of tens of microseconds).

use std::ptr::NonNull;

use super::PoolCore;
use crate::resource::engine::coalescing::node::{fresh_bin, sealed_bin, ANY, GRAIN};
use crate::resource::memory_resource::align_up;
use crate::stream::StreamId;

/// At most this many free blocks are weighed per search.
pub(crate) const SEARCH_LIMIT: usize = 512;

/// Prices where a block goes.
pub(crate) trait Placer {
    /// What a block over `[start, end)` costs (0: nothing beyond the bookkeeping).
    fn cost(&self, start: usize, end: usize) -> usize;

    /// The cheapest start for a block of `size` bytes at `align` (a GRAIN multiple) in the free
    /// range `[lo, hi)`, which holds one at `align_up(lo, align)`, and its cost; on a tie, the
    /// lowest start.
    fn cheapest(&self, lo: usize, hi: usize, size: usize, align: usize) -> (usize, usize);

    /// Whether any spot could be cheaper than another now.
    fn worth_searching(&self) -> bool {
        true
    }
}

impl PoolCore {
    /// [`take`](Self::take), except that when the best fit costs something under `placer`, the
    /// block goes to the cheapest spot among the blocks `stream` may take without waiting.
    pub fn take_placed(
        &mut self,
        stream: StreamId,
        bytes: usize,
        align: usize,
        placer: &dyn Placer,
    ) -> Option<NonNull<u8>> {
        let (size, search) = super::footprint(bytes, align)?;
        let t = self.tag(stream);
        let bins = [fresh_bin(t), sealed_bin(t), ANY];
        let node = self.fit(&bins, search / GRAIN)?;
        let n = self.nodes[node as usize];
        let start = align_up(n.addr, align)?;
        let cost = placer.cost(start, start + size);
        if cost == 0 || !placer.worth_searching() {
            return Some(self.carve_at(node, start, size, bytes));
        }
        let mut best = (cost, n.size, node, start);
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        for &b in &bins {
            let left = SEARCH_LIMIT.saturating_sub(candidates.len());
            self.bins[b as usize].fitting(&mut self.nodes, search / GRAIN, left, &mut candidates);
        }
        for &c in &candidates {
            let n = self.nodes[c as usize];
            if best.0 == 0 && n.size >= best.1 {
                continue; // Only a smaller free spot could win.
            }
            let (at, cost) = placer.cheapest(n.addr, n.addr + n.size, size, align);
            if (cost, n.size) < (best.0, best.1) {
                best = (cost, n.size, c, at);
            }
        }
        self.candidates = candidates;
        Some(self.carve_at(best.2, best.3, size, bytes))
    }

    /// [`take`](Self::take), or [`take_placed`](Self::take_placed) with `placer` when one is
    /// given.
    pub(super) fn take_with(
        &mut self,
        stream: StreamId,
        bytes: usize,
        align: usize,
        placer: Option<&dyn Placer>,
    ) -> Option<NonNull<u8>> {
        match placer {
            None => self.take(stream, bytes, align),
            Some(p) => self.take_placed(stream, bytes, align, p),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stream::StreamRef;

    /// Prices each 4 KiB unit 0 or 1 by a fixed pattern; spots priced one by one.
    struct Pattern(Vec<bool>, usize);

    impl Pattern {
        fn unit(&self, addr: usize) -> usize {
            usize::from(self.0[(addr - self.1) / 4096])
        }
    }

    impl Placer for Pattern {
        fn cost(&self, start: usize, end: usize) -> usize {
            (start / 4096..=(end - 1) / 4096)
                .map(|u| self.unit(u * 4096))
                .sum()
        }
        fn cheapest(&self, lo: usize, hi: usize, size: usize, align: usize) -> (usize, usize) {
            let mut s = align_up(lo, align).unwrap();
            let mut best = (s, self.cost(s, s + size));
            while s + size <= hi {
                let c = self.cost(s, s + size);
                if c < best.1 {
                    best = (s, c);
                }
                s += align;
            }
            best
        }
    }

    /// Random requests on two streams over a priced chunk: each block lands at the cheapest
    /// spot of the blocks its stream may take (the best fit when that costs nothing), and the
    /// index stays whole.
    #[test]
    fn blocks_land_at_the_cheapest_spot_they_may_take() {
        use rand::rngs::SmallRng;
        use rand::{RngExt, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(9);
        let base = 1 << 30;
        for _ in 0..200 {
            let units = 64;
            let pattern = Pattern((0..units).map(|_| rng.random_bool(0.3)).collect(), base);
            let mut c = PoolCore::default();
            c.add_chunk(base, units * 4096, None);
            let mut live: Vec<(usize, usize, StreamRef<'static>)> = vec![];
            for _ in 0..80 {
                let s = StreamRef::simulated(rng.random_range(1..3));
                if rng.random_bool(0.6) {
                    let bytes = GRAIN * rng.random_range(1..40);
                    let align = GRAIN << rng.random_range(0..3);
                    // Brute force over the blocks `s` may take: the cheapest spot's cost.
                    let (size, search) = super::super::footprint(bytes, align).unwrap();
                    let t = c.tag(s.id());
                    let mut fits = vec![];
                    for b in [fresh_bin(t), sealed_bin(t), ANY] {
                        fits.extend(c.bins[b as usize].nodes(&mut c.nodes));
                    }
                    let cheapest = fits
                        .iter()
                        .map(|&n| c.nodes[n as usize])
                        .filter(|n| n.size >= search)
                        .map(|n| pattern.cheapest(n.addr, n.addr + n.size, size, align).1)
                        .min();
                    let got = c.take_placed(s.id(), bytes, align, &pattern);
                    assert_eq!(got.is_some(), cheapest.is_some());
                    if let Some(p) = got {
                        let a = p.as_ptr() as usize;
                        assert_eq!(a % align, 0);
                        assert_eq!(Some(pattern.cost(a, a + size)), cheapest);
                        assert!(live.iter().all(|&(b, n, _)| a + bytes <= b || b + n <= a));
                        live.push((a, bytes, s));
                    }
                } else if !live.is_empty() {
                    let (p, bytes, s) = live.swap_remove(rng.random_range(0..live.len()));
                    c.free("t", s.id(), p, bytes).unwrap();
                }
                c.check_invariants().unwrap();
            }
        }
    }
}
