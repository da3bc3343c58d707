//! [`Placer`] for the page table: what a block costs in pages to map.

use super::Pages;
use crate::resource::engine::coalescing::Placer;

/// A block costs the pages it would have to map: so when free memory lies on mapped pages, a
/// block goes there rather than moving chunks to where the best fit lies.
impl Placer for Pages {
    fn worth_searching(&self) -> bool {
        !self.free.is_empty()
    }

    fn cost(&self, start: usize, end: usize) -> usize {
        Self::unmapped_in(&self.mapped_before(), self.span(start, end))
    }

    fn cheapest(&self, lo: usize, hi: usize, size: usize, align: usize) -> (usize, usize) {
        // Alignments are powers of two.
        let down = |a: usize| a & !(align - 1);
        let first = down(lo + align - 1);
        let last = down(hi - size);
        let mapped_before = self.mapped_before();
        let cost = |s: usize| Self::unmapped_in(&mapped_before, self.span(s, s + size));
        let mut best = (first, cost(first));
        if best.1 == 0 || last == first {
            return best;
        }
        let range = self.span(lo, hi);
        let known = self.pages.len().clamp(range.start, range.end);
        // No spot costs less than the pages it must span beyond those the range has mapped.
        let floor = size
            .div_ceil(self.page)
            .saturating_sub(range.len() - Self::unmapped_in(&mapped_before, range));
        // The cost changes only where the block starts or ends on a page boundary; past the
        // table's end a spot costs every page it spans, so one page-aligned spot there will do.
        let mut b = self.base + (((first - self.base) >> self.shift) + 1) * self.page;
        let stop = hi.min(self.base + (known + 1) * self.page + size);
        // At the floor, only a lower start could still win, and spots from past `best.0 + size`
        // on start higher.
        while b <= stop && (best.1 > floor || b <= best.0 + size + align) {
            let at_start = down(b + align - 1);
            let at_end = b.checked_sub(size).map(down);
            for s in [Some(at_start), at_end].into_iter().flatten() {
                if s >= first && s <= last {
                    let c = cost(s);
                    if c < best.1 || (c == best.1 && s < best.0) {
                        best = (s, c);
                    }
                }
            }
            b += self.page;
        }
        best
    }
}
