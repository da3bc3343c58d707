//! The floor under the mixed-size rows: the class groups' atomics on bare arrays
//! (`kernels/src/test_floor.rs`), timed like the heap rows.

use carve::DeviceVec;
use carve_kernels::general::{FLOOR_HW_SLOTS, FLOOR_WORDS_LOG2};
use carve_kernels::size_class::NUM_CLASSES;

use super::timing::{time_alloc_free, Ctx};
use crate::bench::table::Table;

const SEED: u32 = 1;

/// The floor's rates at one N, size range and shard count (G requests/s).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Rates {
    /// Allocation with one `fetch_add` per class group.
    pub add: f64,
    /// Allocation with a `fetch_add` and an Acquire `fetch_or` per class group.
    pub add_or: f64,
    /// Free with a Release `fetch_and` and a `fetch_sub` per class group.
    pub and_sub: f64,
    /// Free with the `fetch_and` alone.
    pub and: f64,
    /// Free with one `fetch_add` per warp (a cache).
    pub cache: f64,
}

impl Rates {
    /// The better of each rate of `self` and `other`.
    fn max(self, o: Rates) -> Rates {
        Rates {
            add: self.add.max(o.add),
            add_or: self.add_or.max(o.add_or),
            and_sub: self.and_sub.max(o.and_sub),
            and: self.and.max(o.and),
            cache: self.cache.max(o.cache),
        }
    }
}

/// Shards per class (log2) over which [`bound`] takes the best: the floor table's range.
const BOUND_SHARDS_LOG2: [u32; 4] = [8, 10, 12, 14];

/// The floor that bounds the mixed-size row of 2^`log_n` threads over 16 B to `max`: each rate
/// at its best over 256 to 16384 shards per class, so that it bounds a heap of any of them.
pub(super) fn bound(c: &Ctx, log_n: u32, max: u64) -> carve::Result<Rates> {
    let mut best = Rates::default();
    for shards_log2 in BOUND_SHARDS_LOG2 {
        best = best.max(measure(c, log_n, max, shards_log2)?);
    }
    Ok(best)
}

/// The cached free's rings: a line of count per hardware warp slot, and 2^RING_LOG2 entries
/// each.
const RING_LOG2: u32 = 10;

/// The floor kernels' rates for 2^`log_n` threads over 16 B to `max`, with 2^`shards_log2`
/// shards per class.
fn measure(c: &Ctx, log_n: u32, max: u64, shards_log2: u32) -> carve::Result<Rates> {
    let hw_slots = DeviceVec::<u32>::zeroed(FLOOR_HW_SLOTS * 32, &c.stream, c.mr.clone())?;
    let ring = DeviceVec::<u64>::zeroed(FLOOR_HW_SLOTS << RING_LOG2, &c.stream, c.mr.clone())?;
    let n = 1u64 << log_n;
    let slots = (NUM_CLASSES + 1) << shards_log2;
    let counts = DeviceVec::<u32>::zeroed(slots, &c.stream, c.mr.clone())?;
    let words = DeviceVec::<u64>::zeroed(slots << FLOOR_WORDS_LOG2, &c.stream, c.mr.clone())?;
    let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
    let k = &c.kernels();
    let (cp, wp, op) = (counts.as_ptr(), words.as_ptr(), out.as_ptr());
    // SAFETY: `counts` and `words` hold a shard's entries for every class index a request
    // maps to (NUM_CLASSES + 1 with the no-class key), `out` n u64s; all outlive the row.
    let alloc = |claim| {
        move || {
            // SAFETY: as above.
            unsafe { k.floor_malloc(n, cp, wp, op, n, max, SEED, shards_log2, claim) }
        }
    };
    // SAFETY: as above.
    let free = |count| {
        move || {
            // SAFETY: as above.
            unsafe { k.floor_free(n, cp, wp, op, n, count) }
        }
    };
    let (one, _) = time_alloc_free(c, alloc(0), free(1))?;
    let (two, freed) = time_alloc_free(c, alloc(1), free(1))?;
    let (_, and_only) = time_alloc_free(c, alloc(1), free(0))?;
    let (sp, rp) = (hw_slots.as_ptr(), ring.as_ptr());
    // SAFETY: `hw_slots` and `ring` are sized for every hardware warp slot, as the kernel asks.
    let cache_free = || unsafe { k.floor_cache_free(n, sp, rp, op, n, RING_LOG2) };
    let (_, cached) = time_alloc_free(c, alloc(1), cache_free)?;
    let g = |ms: f64| n as f64 / (ms * 1e6);
    Ok(Rates {
        add: g(one),
        add_or: g(two),
        and_sub: g(freed),
        and: g(and_only),
        cache: g(cached),
    })
}

/// Rows for 2^`log_n` threads over 16 B to `max`, with 2^`shards_log2` shards per class.
pub(super) fn table(c: &Ctx, quick: bool) -> carve::Result<Table> {
    let mut table = Table::new(
        "device_alloc, the floor under the mixed sizes: each class group's atomics alone, on \
         bare arrays (G requests/s; median of 5)",
        &[
            "N",
            "sizes",
            "shards per class",
            "fetch_add per group",
            "fetch_add + fetch_or per group",
            "fetch_and + fetch_sub per group",
            "fetch_and per group",
            "fetch_add per warp (cache)",
        ],
    );
    let grid: &[(u32, u64, u32)] = if quick {
        &[(20, 4096, 8)]
    } else {
        &[
            (22, 4096, 6),
            (22, 4096, 8),
            (22, 4096, 10),
            (22, 4096, 12),
            (22, 4096, 14),
            (20, 65536, 8),
        ]
    };
    for &(log_n, max, shards_log2) in grid {
        let r = measure(c, log_n, max, shards_log2)?;
        let f = |v: f64| format!("{v:.1}");
        table.row(vec![
            format!("2^{log_n}"),
            format!("16 B–{} KiB", max >> 10),
            format!("{}", 1u32 << shards_log2),
            f(r.add),
            f(r.add_or),
            f(r.and_sub),
            f(r.and),
            f(r.cache),
        ]);
    }
    table.note(
        "Per warp, the lanes of one size class form a group (match.any); its leader makes the \
         atomics that carve_malloc's and carve_free's mixed paths make per group, on a count per \
         shard and 64 bitmap words per shard, with no heap header, handle, retry or exhaustion: \
         a bound on any design that reserves and claims once per class group. The last column \
         frees with the fetch_and alone: a bound on any free that makes one atomic per class \
         group. The cache column makes one fetch_add per warp, on a count of its hardware warp \
         slot, and a store per lane: a bound on frees that defer their work to a cache. With \
         64 words per shard, 4096 and more shards per class no longer fit the L2 (the heap's \
         bitmaps are dense). Sizes as in the mixed-size table.",
    );
    Ok(table)
}
