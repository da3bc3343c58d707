//! [`Placer`] for the page table against brute force.

use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use super::*;
use crate::resource::engine::coalescing::Placer;

const GRAIN: usize = 256;

/// The pages of `[start, end)` not mapped, counted page by page.
fn counted(p: &Pages, start: usize, end: usize) -> usize {
    p.span(start, end)
        .filter(|&i| p.pages.get(i).is_none_or(|p| p.handle.is_none()))
        .count()
}

/// Every aligned start in `[lo, hi)` priced one by one: the cheapest cost.
fn brute_force(p: &Pages, lo: usize, hi: usize, size: usize, align: usize) -> usize {
    let mut s = lo.next_multiple_of(align);
    let mut best = usize::MAX;
    while s + size <= hi {
        best = best.min(counted(p, s, s + size));
        s += align;
    }
    best
}

#[test]
fn the_cheapest_spot_is_the_cheapest_of_all() {
    let mut rng = SmallRng::seed_from_u64(3);
    for _ in 0..3000 {
        let page = GRAIN << rng.random_range(0..4);
        let base = 1 << 30;
        let mut p = Pages::new(base, page, 1 << 20);
        // A table of some mapped pages (the rest, and all past its end, unmapped).
        let len = rng.random_range(0..24);
        p.pages = (0..len)
            .map(|_| Page {
                handle: rng.random_bool(0.5).then_some(1),
                refs: 0,
                free_at: NOT_FREE,
            })
            .collect();
        p.stale.set(true);
        let align = GRAIN << rng.random_range(0..5);
        let size = GRAIN * rng.random_range(1..(6 * page / GRAIN));
        let lo = base + GRAIN * rng.random_range(0..(20 * page / GRAIN));
        // A free block that holds the block at `align_up(lo, align)`, as the core guarantees.
        let hi = lo + size + align - GRAIN + GRAIN * rng.random_range(0..(10 * page / GRAIN));
        let (at, cost) = p.cheapest(lo, hi, size, align);
        assert!(
            at >= lo && at + size <= hi && at % align == 0,
            "{at:#x} {lo:#x}..{hi:#x}"
        );
        assert_eq!(cost, counted(&p, at, at + size), "the cost it claims");
        assert_eq!(p.cost(at, at + size), cost);
        let best = brute_force(&p, lo, hi, size, align);
        assert_eq!(
            cost, best,
            "page {page} align {align} size {size} lo {lo:#x} hi {hi:#x} table {len}"
        );
    }
}
