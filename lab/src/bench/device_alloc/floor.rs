//! The floor under the mixed-size rows: the class groups' atomics on bare arrays
//! (`kernels/src/test_floor.rs`), timed like the heap rows.

use carve::DeviceVec;
use carve_kernels::general::{FLOOR_HW_SLOTS, FLOOR_WORDS_LOG2};
use carve_kernels::size_class::NUM_CLASSES;

use super::{rate, time_alloc_free, Ctx};
use crate::bench::table::Table;

const SEED: u32 = 1;

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
    // The cached free's rings: a line of count per hardware warp slot, and 2^RING_LOG2 entries
    // each.
    const RING_LOG2: u32 = 10;
    let hw_slots = DeviceVec::<u32>::zeroed(FLOOR_HW_SLOTS * 32, &c.stream, c.mr.clone())?;
    let ring = DeviceVec::<u64>::zeroed(FLOOR_HW_SLOTS << RING_LOG2, &c.stream, c.mr.clone())?;
    for &(log_n, max, shards_log2) in grid {
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
        table.row(vec![
            format!("2^{log_n}"),
            format!("16 B–{} KiB", max >> 10),
            format!("{}", 1u32 << shards_log2),
            rate(n, one),
            rate(n, two),
            rate(n, freed),
            rate(n, and_only),
            rate(n, cached),
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
