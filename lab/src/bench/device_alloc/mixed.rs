//! The mixed-size table: hashed request sizes through the general heap, beside the floor of its
//! atomics, Gallatin when built, and CUDA's malloc.

use std::time::Instant;

use carve::heap::{GrowOptions, HeapKind};
use carve::{DeviceHeap, DeviceVec};
use carve_kernels::general::bench_request_size;
use carve_kernels::size_class::{class_of, class_size, NUM_CLASSES};

use super::floor;
use super::gallatin::{self, Harness, Request, Sizes};
use super::layout::{mixed_table, MixedMeasured, MixedRow};
use super::timing::{per_s, time_alloc_free, timed_malloc_free, Ctx, RUNS};
use crate::bench::table::Table;

/// Largest general heap the mixed-size table reserves (every class the same bytes).
const MAX_GENERAL_HEAP: u64 = 64 << 30;
const SEED: u32 = 1;

/// Hashed request sizes over 16 B to `max` (seed 1), through the general heap and CUDA's malloc,
/// each row beside the floor that bounds it ([`floor::bound`]) and, with `gallatin`, Gallatin
/// on the same requests (16 B–4 KiB only: its configuration's largest slice).
///
/// The heap is growable (`DeviceHeap::growable`): each class starts with one 2 MiB chunk, and
/// before the timed runs the host grows every class to its share of the requests (computed
/// here with the kernels' own hash) plus a quarter, with `ensure_free_class`. That growth is
/// timed too: the "growth" column.
pub(super) fn table(c: &Ctx, quick: bool, gallatin: Option<&Harness>) -> carve::Result<Table> {
    // --mixed-log-threads 22,20: only those N (log2), over both size ranges.
    let ns = &c.args.mixed_log_threads;
    let grid: Vec<(u32, u64)> = if !ns.is_empty() {
        [4096, 65536]
            .iter()
            .flat_map(|&m| ns.iter().map(move |&n| (n, m)))
            .collect()
    } else if quick {
        vec![(16, 4096)]
    } else {
        vec![(16, 4096), (20, 4096), (22, 4096), (16, 65536), (20, 65536)]
    };
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for &(log_n, max) in &grid {
        let n = 1u64 << log_n;
        let mut blocks = vec![0u64; NUM_CLASSES];
        let mut gallatin_demand = 0u64;
        for i in 0..n {
            let bytes = bench_request_size(i, SEED, max);
            gallatin_demand += gallatin::granted(bytes);
            if let Some(class) = class_of(bytes as u32) {
                blocks[class as usize] += 1;
            }
        }
        let bytes: Vec<u64> = (0..NUM_CLASSES)
            .map(|k| blocks[k] * class_size(k as u32) as u64 * 5 / 4)
            .collect();
        let total: u64 = bytes.iter().sum();
        let mut row = MixedRow {
            log_n,
            max,
            heap_gib: total as f64 / (1u64 << 30) as f64,
            m: None,
        };
        // Metadata and chunk rounding on top of the blocks.
        let limit = (total + total / 8 + (NUM_CLASSES as u64 + 1) * (4 << 20)) as usize;
        if limit as u64 > MAX_GENERAL_HEAP {
            rows.push(row);
            continue;
        }
        let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
        let kind = HeapKind::General {
            bytes_per_class: 2 << 20,
        };
        let mut heap = DeviceHeap::growable(kind, &c.stream, GrowOptions::new(limit, 1))?;
        let started = Instant::now();
        for (k, &b) in bytes.iter().enumerate() {
            if b > 0 {
                heap.ensure_free_class(k, b)?;
            }
        }
        let growth = started.elapsed();
        let (k, h, o) = (c.kernels(), heap.device_ptr(), out.as_ptr());
        // SAFETY: `out` holds n u64s; the heap lives until the end of the row; each free takes
        // back exactly what the allocation before it wrote.
        let alloc = || unsafe { k.general_malloc_bench(n, h, o, n, max, SEED) };
        // SAFETY: as above.
        let free = || unsafe { k.general_free_bench(n, h, o, n) };
        let (alloc_ms, free_ms) = time_alloc_free(c, alloc, free)?;
        free()?;
        let s = heap.stats()?;
        if s.double_frees > 0 || s.foreign_frees > 0 || s.in_use > 0 {
            return Err(carve::Error::InvalidArgument(format!(
                "mixed-size bench: {} double and {} foreign frees, {} blocks left at 2^{log_n}",
                s.double_frees, s.foreign_frees, s.in_use
            )));
        }
        drop(heap);
        let mut m = MixedMeasured {
            growth_ms: growth.as_secs_f64() * 1e3,
            malloc: per_s(n, alloc_ms),
            free: per_s(n, free_ms),
            // Every timed and untimed allocation launch counts its failures.
            failed: s.failed_allocs,
            ..Default::default()
        };
        if log_n <= 16 || (log_n == 20 && max == 4096 && !quick) {
            m.cuda = Some(cuda_malloc_mixed(c, n, max, SEED, &out)?);
        }
        drop(out);
        m.floor = Some(floor::bound(c, log_n, max)?);
        if let Some(g) = gallatin.filter(|_| max <= gallatin::LARGEST_SLICE) {
            let req = Request {
                n,
                sizes: Sizes::Mixed { max, seed: SEED },
                heap_bytes: gallatin::heap_bytes(gallatin_demand, c.args.gallatin_heap_gib),
                runs: RUNS,
            };
            let what = format!("2^{log_n} × 16 B–{} KiB", max >> 10);
            m.gallatin = g.row(&req, &what, &mut notes);
        }
        row.m = Some(m);
        rows.push(row);
    }
    let mut table = mixed_table(&rows, gallatin.is_some());
    table.note(
        "carve: a growable general heap (DeviceHeap::growable), every class grown before the \
         timed runs to its share of the requests plus a quarter (the growth column: \
         ensure_free_class for all classes, cuMemCreate + cuMemMap + cuMemSetAccess and \
         formatting); timed like the slab columns above (alloc after a free, free after an \
         alloc); failed counts every launch. CUDA malloc: the same sizes under the 1 GiB malloc \
         heap limit, bounded to 10 s; its nulls are reported.",
    );
    table.note(
        "Floors: the floor table's kernels on the row's N and sizes (each class group's \
         atomics on bare arrays), each at its best over 256 to 16384 shards per class, so that \
         it bounds a heap of any of them: carve_malloc makes a fetch_add and a fetch_or per \
         class group, carve_free a fetch_and and a fetch_sub; a free with one atomic per group \
         can reach the last floor at most.",
    );
    if gallatin.is_some() {
        table.note(
            "Gallatin: the same requests (16 B–4 KiB rows only), timed alike; its heap is twice \
             the bytes it hands out (requests rounded up to a power of two) plus 1 GiB, unless \
             --gallatin-heap-gib sets it; failed counts its null pointers over every launch.",
        );
    }
    for n in notes {
        table.note(n);
    }
    Ok(table)
}

/// CUDA's in-kernel malloc then free on the mixed sizes, or why not.
fn cuda_malloc_mixed(
    c: &Ctx,
    n: u64,
    max: u64,
    seed: u32,
    out: &DeviceVec<u64>,
) -> carve::Result<(String, String)> {
    let k = c.kernels();
    // SAFETY: out holds n u64s; the malloc heap limit was set before the first launch.
    timed_malloc_free(c, n, out, || unsafe {
        k.cuda_malloc_mixed(n, out.as_ptr(), n, max, seed)
    })
}
