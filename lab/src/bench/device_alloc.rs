//! In-kernel allocation: N threads each make one request, one kernel timed with events, median
//! of several runs after a warm-up. Peers in the same run: the empty kernel (launch floor), one
//! `atomicAdd` per thread (the single-counter bump limit), CUDA's in-kernel malloc/free
//! (time-bounded), carve's bump arena and carve's slab. A second table: mixed sizes through
//! `carve_malloc` / `carve_free` (the general heap) against CUDA's malloc on the same sizes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use carve::cudarc::driver::{result, sys};
use carve::resource::{CudaBackingOptions, VirtualMemoryResource, VirtualOptions};
use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, Event, SharedResource, Stream};

use super::table::Table;
use crate::heap::HeapKernels;

mod args;
mod floor;

pub use args::{DeviceAllocArgs, Only, SlabHeap};

const RUNS: usize = 5;
/// Largest heap the benchmark reserves.
const MAX_HEAP: u64 = 40 << 30;
/// Largest general heap the mixed-size table reserves (every class the same bytes).
const MAX_GENERAL_HEAP: u64 = 64 << 30;
/// How long CUDA's in-kernel malloc may run before it is reported as not finishing.
const MALLOC_LIMIT: Duration = Duration::from_secs(10);

/// Median milliseconds of `RUNS` timed runs of `body` (after one untimed), each between events;
/// `between` runs untimed after each.
fn time(
    dev: &Device,
    stream: &Stream,
    mut body: impl FnMut() -> carve::Result<()>,
    mut between: impl FnMut() -> carve::Result<()>,
) -> carve::Result<f64> {
    let (start, end) = (Event::new(dev, true)?, Event::new(dev, true)?);
    body()?;
    between()?;
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        start.record(stream.as_ref())?;
        body()?;
        end.record(stream.as_ref())?;
        end.synchronize()?;
        ms.push(start.elapsed_ms(&end)? as f64);
        between()?;
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[RUNS / 2])
}

/// Median milliseconds of `alloc` (each run after a `free`) and then of `free` (each run after
/// an `alloc`, which starts it from a full set of blocks). The last run leaves the blocks
/// allocated.
fn time_alloc_free<A, F>(c: &Ctx, alloc: A, free: F) -> carve::Result<(f64, f64)>
where
    A: FnMut() -> carve::Result<()> + Copy,
    F: FnMut() -> carve::Result<()> + Copy,
{
    let alloc_ms = time(&c.dev, &c.stream, alloc, free)?;
    let mut alloc = alloc;
    alloc()?;
    Ok((alloc_ms, time(&c.dev, &c.stream, free, alloc)?))
}

fn rate(n: u64, ms: f64) -> String {
    format!("{:.1}", n as f64 / (ms * 1e6))
}

struct Ctx {
    dev: Device,
    stream: Stream,
    mr: SharedResource,
    args: DeviceAllocArgs,
}

impl Ctx {
    fn kernels(&self) -> HeapKernels<'_> {
        HeapKernels::new(&self.stream)
    }
}

/// Slab alloc and free rates (G/s) with the heap at `cap` blocks; `relaxed` runs the ablation
/// kernels (bitmap atomics without Acquire/Release).
fn slab(
    c: &Ctx,
    n: u64,
    bs: u64,
    cap: u64,
    out: &DeviceVec<u64>,
    relaxed: bool,
) -> carve::Result<(f64, f64)> {
    // Each slab heap in a virtual range of its own (cuMemAddressReserve, cuMemCreate,
    // cuMemMap), as a growable heap lives. In cuMemAlloc's memory (`--slab-heap cuda`), a heap
    // made after a large allocation was freed (a row's 24 GiB bump arena at 2^24 × 1 KiB, even a
    // 1.5 GiB one) frees about 4 % slower on an H100, whatever its block size; one in its own
    // range does not (measured 2026-11-25).
    let mr: SharedResource = match c.args.slab_heap {
        SlabHeap::Cuda => c.mr.clone(),
        SlabHeap::Virtual => Arc::new(VirtualMemoryResource::on_device(
            &c.dev,
            CudaBackingOptions::default(),
            VirtualOptions::new(),
        )?),
    };
    let heap = DeviceHeap::slab(mr, &c.stream, cap, bs)?;
    let k = c.kernels();
    let h = heap.device_ptr();
    // SAFETY: `out` holds n u64s; the heap lives until the end.
    let alloc = || unsafe {
        if relaxed {
            k.slab_alloc_relaxed(n, h, out.as_ptr(), n)
        } else {
            k.slab_alloc(n, h, out.as_ptr(), n)
        }
    };
    // SAFETY: as above.
    let free = || unsafe {
        if relaxed {
            k.slab_free_relaxed(n, h, out.as_ptr(), n)
        } else {
            k.slab_free(n, h, out.as_ptr(), n)
        }
    };
    // The blocks left allocated go with the heap.
    let (alloc, free) = time_alloc_free(c, alloc, free)?;
    let s = heap.stats()?;
    if s.failed_allocs > 0 || s.double_frees > 0 {
        return Err(carve::Error::InvalidArgument(format!(
            "slab bench: {} failed allocations, {} double frees at {n} × {bs} B",
            s.failed_allocs, s.double_frees
        )));
    }
    Ok((n as f64 / (alloc * 1e6), n as f64 / (free * 1e6)))
}

/// CUDA's in-kernel malloc then free, or why not.
fn cuda_malloc(c: &Ctx, n: u64, bs: u64, out: &DeviceVec<u64>) -> carve::Result<(String, String)> {
    let k = c.kernels();
    // SAFETY: out holds n u64s; the malloc heap limit was set before the first launch.
    timed_malloc_free(c, n, out, || unsafe {
        k.cuda_malloc(n, out.as_ptr(), n, bs)
    })
}

/// Times `malloc` (a launch of CUDA's in-kernel malloc into `out`) and then CUDA's free of what
/// it wrote, bounded to `MALLOC_LIMIT`: rates in M/s, with the nulls counted.
fn timed_malloc_free(
    c: &Ctx,
    n: u64,
    out: &DeviceVec<u64>,
    malloc: impl FnOnce() -> carve::Result<()>,
) -> carve::Result<(String, String)> {
    let k = c.kernels();
    let (start, mid, end) = (
        Event::new(&c.dev, true)?,
        Event::new(&c.dev, true)?,
        Event::new(&c.dev, true)?,
    );
    start.record(c.stream.as_ref())?;
    malloc()?;
    mid.record(c.stream.as_ref())?;
    // SAFETY: frees what the launch above allocated (nulls are ignored by free).
    unsafe { k.cuda_free(n, out.as_ptr(), n) }?;
    end.record(c.stream.as_ref())?;
    let t = Instant::now();
    while !end.is_complete()? {
        if t.elapsed() > MALLOC_LIMIT {
            let msg = format!("did not finish in {} s", MALLOC_LIMIT.as_secs());
            // Nothing can stop a running kernel: wait, so later rows are not skewed.
            end.synchronize()?;
            return Ok((msg.clone(), msg));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let nulls = out.to_vec()?.iter().filter(|&&p| p == 0).count();
    let note = if nulls > 0 {
        format!(" ({nulls} null)")
    } else {
        String::new()
    };
    let a = start.elapsed_ms(&mid)? as f64;
    let f = mid.elapsed_ms(&end)? as f64;
    Ok((
        format!("{:.2} M/s{note}", n as f64 / (a * 1e3)),
        format!("{:.2} M/s", n as f64 / (f * 1e3)),
    ))
}

/// `given`, or `default` when it is empty (the flag was not passed).
fn or_default<T: Clone>(given: &[T], default: Vec<T>) -> Vec<T> {
    if given.is_empty() {
        default
    } else {
        given.to_vec()
    }
}

/// The device-alloc tables that `args` asks for (all four by default).
pub fn run(quick: bool, args: &DeviceAllocArgs) -> carve::Result<Vec<Table>> {
    let mut table = Table::new(
        "device_alloc: N threads, one request each (G allocs/s unless noted; median of 5)",
        &[
            "N",
            "block B",
            "empty kernel ms",
            "atomicAdd/thread",
            "bump",
            "bump (block)",
            "slab alloc (1.5×)",
            "slab free (1.5×)",
            "slab alloc (50 % fill)",
            "slab alloc (90 % fill)",
            "CUDA malloc",
            "CUDA free",
        ],
    );
    let Some(dev) = super::device_or_note(&mut table) else {
        return Ok(vec![table]);
    };
    dev.bind()?;
    let malloc_heap = 1usize << 30;
    // Set on the bound context before any launch that uses device malloc.
    result::ctx::set_limit(sys::CUlimit::CU_LIMIT_MALLOC_HEAP_SIZE, malloc_heap)
        .map_err(|e| carve::Error::InvalidArgument(format!("cuCtxSetLimit: {e:?}")))?;
    let c = Ctx {
        stream: dev.new_stream()?,
        mr: Arc::new(CudaMemoryResource::new(&dev)),
        dev,
        args: args.clone(),
    };
    match args.only {
        Some(Only::Class) => return Ok(vec![per_class(&c, quick)?]),
        Some(Only::Floor) => return Ok(vec![floor::table(&c, quick)?]),
        Some(Only::Mixed) => return Ok(vec![mixed_sizes(&c, quick)?]),
        Some(Only::Slab) | None => {}
    }
    let props = c.dev.properties()?;
    table.note(format!(
        "device: {}, {} SMs. Slab heaps hold 1.5 N blocks (or N / 0.9 for the 90 % column), \
         each in a virtual range of its own (--slab-heap cuda: cuMemAlloc); \
         bump arenas N × block × 1.5 bytes, reset between runs. Slab and CUDA malloc kernels \
         store each pointer (8 B/thread); atomicAdd and bump kernels keep theirs in a register. \
         CUDA malloc runs only at N = 2^20 (heap limit {} MiB) and is bounded to {} s.",
        props.name,
        props.multiprocessors,
        malloc_heap >> 20,
        MALLOC_LIMIT.as_secs()
    ));
    let ns = or_default(
        &args.log_threads,
        if quick {
            vec![20, 22]
        } else {
            vec![20, 22, 24, 26]
        },
    );
    let sizes = or_default(
        &args.block,
        if quick {
            vec![16, 1024]
        } else {
            vec![16, 64, 256, 1024, 4096]
        },
    );
    // Only the slab's alloc and free columns, for a focused run.
    let slab_only = args.only == Some(Only::Slab);
    let counter = DeviceVec::<u64>::zeroed(2, &c.stream, c.mr.clone())?;
    for &log_n in &ns {
        let n = 1u64 << log_n;
        let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
        let k = c.kernels();
        // The floor of the kernels below: the same grid (n threads), doing nothing.
        // SAFETY: no arguments.
        let empty = time(&c.dev, &c.stream, || unsafe { k.empty(n) }, || Ok(()))?;
        for &bs in &sizes {
            let mut row = vec![format!("2^{log_n}"), bs.to_string(), format!("{empty:.3}")];
            if n * bs * 3 / 2 > MAX_HEAP {
                row.extend(std::iter::repeat_n("(heap > 40 GiB)".to_string(), 9));
                table.row(row);
                continue;
            }
            if slab_only {
                let (a, f) = slab(&c, n, bs, n + n / 2, &out, false)?;
                row.extend(["–", "–", "–"].map(String::from));
                row.extend([format!("{a:.1}"), format!("{f:.1}")]);
                row.extend(["–", "–", "–", "–"].map(String::from));
                table.row(row);
                continue;
            }
            let (ctr, sink) = (counter.as_ptr(), counter.as_ptr() + 8);
            // SAFETY: ctr and sink are u64s in device memory.
            let add = time(
                &c.dev,
                &c.stream,
                // SAFETY: the buffers and heap outlive the launch; see the caller.
                || unsafe { k.atomic_add(n, ctr, n, bs, sink) },
                || Ok(()),
            )?;
            row.push(rate(n, add));
            let arena = DeviceHeap::bump(c.mr.clone(), &c.stream, n * bs * 3 / 2)?;
            let h = arena.device_ptr();
            // SAFETY: the arena outlives the launch; sink is a u64.
            let bump = || unsafe { k.bump_alloc_sink(n, h, n, bs, 16, sink) };
            row.push(bump_rate(&c, n, &arena, bump)?);
            arena.reset()?;
            // The block-cooperative entry point: one reservation per block of 256 threads.
            // SAFETY: as above.
            let block = || unsafe { k.bump_alloc_block_sink(n, h, n, bs, 16, sink) };
            row.push(bump_rate(&c, n, &arena, block)?);
            drop(arena);
            let (a, f) = slab(&c, n, bs, n + n / 2, &out, false)?;
            row.push(format!("{a:.1}"));
            row.push(format!("{f:.1}"));
            if bs == 16 && log_n >= 22 {
                let (ra, rf) = slab(&c, n, bs, n + n / 2, &out, true)?;
                table.note(format!(
                    "ablation, 2^{log_n} × 16 B at 1.5×: with relaxed bitmap atomics (no \
                     Acquire/Release; not a correct heap) slab alloc {ra:.1} and free {rf:.1} \
                     G/s, against {a:.1} and {f:.1} ordered."
                ));
            }
            let (a50, _) = slab(&c, n, bs, 2 * n, &out, false)?;
            row.push(format!("{a50:.1}"));
            let (a90, _) = slab(&c, n, bs, (n * 10).div_ceil(9), &out, false)?;
            row.push(format!("{a90:.1}"));
            if log_n == 20 && (bs == 16 || bs == 1024) {
                let (m, f) = cuda_malloc(&c, n, bs, &out)?;
                row.push(m);
                row.push(f);
            } else {
                row.push("–".into());
                row.push("–".into());
            }
            table.row(row);
        }
    }
    if slab_only {
        table.note("--only slab: slab alloc and free only.");
        return Ok(vec![table]);
    }
    let mixed = mixed_sizes(&c, quick)?;
    let floor = floor::table(&c, quick)?;
    let classes = per_class(&c, quick)?;
    Ok(vec![table, mixed, floor, classes])
}

/// The rate of `alloc`, a launch of `n` requests into `arena` timed with `time` (the arena reset
/// after each run), with the failed allocations of every launch.
fn bump_rate(
    c: &Ctx,
    n: u64,
    arena: &DeviceHeap,
    alloc: impl FnMut() -> carve::Result<()>,
) -> carve::Result<String> {
    // A reset restarts the statistics too, so each launch's failures are read before it.
    let failed = std::cell::Cell::new(0);
    let ms = time(&c.dev, &c.stream, alloc, || {
        failed.set(failed.get() + arena.stats()?.failed_allocs);
        arena.reset()
    })?;
    Ok(with_failures(rate(n, ms), failed.get()))
}

/// `rate`, with the failed requests when there were any.
fn with_failures(rate: String, failed: u64) -> String {
    if failed == 0 {
        rate
    } else {
        format!("{rate} ({failed} failed)")
    }
}

/// Hashed request sizes over 16 B to `max` (seed 1), through the general heap and CUDA's malloc.
///
/// The heap is growable (`DeviceHeap::growable`): each class starts with one 2 MiB chunk, and
/// before the timed runs the host grows every class to its share of the requests (computed
/// here with the kernels' own hash) plus a quarter, with `ensure_free_class`. That growth is
/// timed too: the "growth" column.
fn mixed_sizes(c: &Ctx, quick: bool) -> carve::Result<Table> {
    use carve::heap::{GrowOptions, HeapKind};
    use carve_kernels::general::bench_request_size;
    use carve_kernels::size_class::{class_of, class_size, NUM_CLASSES};
    let mut table = Table::new(
        "device_alloc, mixed sizes: thread i asks for 16 B + hash(i) % (max − 15) bytes \
         (G requests/s unless noted; median of 5)",
        &[
            "N",
            "sizes",
            "heap (GiB)",
            "growth",
            "carve_malloc",
            "carve_free",
            "failed",
            "CUDA malloc",
            "CUDA free",
        ],
    );
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
    const SEED: u32 = 1;
    for &(log_n, max) in &grid {
        let n = 1u64 << log_n;
        let mut blocks = vec![0u64; NUM_CLASSES];
        for i in 0..n {
            if let Some(class) = class_of(bench_request_size(i, SEED, max) as u32) {
                blocks[class as usize] += 1;
            }
        }
        let bytes: Vec<u64> = (0..NUM_CLASSES)
            .map(|k| blocks[k] * class_size(k as u32) as u64 * 5 / 4)
            .collect();
        let total: u64 = bytes.iter().sum();
        let mut row = vec![
            format!("2^{log_n}"),
            format!("16 B–{} KiB", max >> 10),
            format!("{:.1}", total as f64 / (1u64 << 30) as f64),
        ];
        // Metadata and chunk rounding on top of the blocks.
        let limit = (total + total / 8 + (NUM_CLASSES as u64 + 1) * (4 << 20)) as usize;
        if limit as u64 > MAX_GENERAL_HEAP {
            row.extend(std::iter::repeat_n("(heap > 64 GiB)".to_string(), 6));
            table.row(row);
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
        row.push(format!("{:.1} ms", growth.as_secs_f64() * 1e3));
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
        row.push(rate(n, alloc_ms));
        row.push(rate(n, free_ms));
        // Every timed and untimed allocation launch counts its failures.
        row.push(s.failed_allocs.to_string());
        drop(heap);
        if log_n <= 16 || (log_n == 20 && max == 4096 && !quick) {
            let (m, f) = cuda_malloc_mixed(c, n, max, SEED, &out)?;
            row.push(m);
            row.push(f);
        } else {
            row.push("–".into());
            row.push("–".into());
        }
        table.row(row);
    }
    table.note(
        "carve: a growable general heap (DeviceHeap::growable), every class grown before the \
         timed runs to its share of the requests plus a quarter (the growth column: \
         ensure_free_class for all classes, cuMemCreate + cuMemMap + cuMemSetAccess and \
         formatting); timed like the slab columns above (alloc after a free, free after an \
         alloc); failed counts every launch. CUDA malloc: the same sizes under the 1 GiB malloc \
         heap limit, bounded to 10 s; its nulls are reported.",
    );
    Ok(table)
}

/// One size at a time through `carve_malloc` (every thread asks the class size, so the warp
/// takes its class's straight-line path), against the slab of that block size in the same run:
/// what the general heap's class lookup and header cost a single class.
fn per_class(c: &Ctx, quick: bool) -> carve::Result<Table> {
    use carve_kernels::size_class::{class_of, class_size};
    let mut table = Table::new(
        "device_alloc, one class at a time: carve_malloc / carve_free of one size against \
         carve_slab_alloc / carve_slab_free of that block size (G requests/s; median of 5)",
        &[
            "N",
            "bytes",
            "carve_malloc",
            "carve_free",
            "slab alloc",
            "slab free",
            "malloc / slab alloc",
            "free / slab free",
        ],
    );
    let sizes = or_default(
        &c.args.class_bytes,
        if quick {
            vec![16, 4096]
        } else {
            vec![16, 64, 256, 1024, 4096, 16384, 65536]
        },
    );
    // The largest N (log2), for the rows to meet the slab table's 2^24.
    let max_log_n = c.args.class_log_threads.unwrap_or(22);
    for bytes in sizes {
        // A class's own size, so that both heaps hand out blocks of exactly `bytes`.
        let class = u32::try_from(bytes).ok().and_then(class_of);
        if class.is_none_or(|k| class_size(k) as u64 != bytes) {
            return Err(carve::Error::InvalidArgument(format!(
                "--class-bytes: {bytes} is not the size of a class \
                 (16, 32, 48, 64, 80, 96, 112, 128, 160, ... 65536)"
            )));
        }
        // Every one of the 44 classes gets the bytes this size needs (equal strides), so N
        // shrinks with the size to keep the heap under 44 GiB.
        let log_n = (29 - bytes.next_power_of_two().trailing_zeros()).min(max_log_n);
        let n = 1u64 << log_n;
        let per_class = (n * bytes * 2).next_power_of_two();
        let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
        let heap = DeviceHeap::general(c.mr.clone(), &c.stream, per_class)?;
        let (k, h, o) = (c.kernels(), heap.device_ptr(), out.as_ptr());
        // SAFETY: `out` holds n u64s; the heap lives until the end of the row; each free takes
        // back exactly what the allocation before it wrote.
        let alloc = || unsafe { k.general_malloc_one_bench(n, h, o, n, bytes) };
        // SAFETY: as above.
        let free = || unsafe { k.general_free_bench(n, h, o, n) };
        let (alloc_ms, free_ms) = time_alloc_free(c, alloc, free)?;
        free()?;
        let s = heap.stats()?;
        if s.failed_allocs > 0 || s.double_frees > 0 || s.foreign_frees > 0 || s.in_use > 0 {
            return Err(carve::Error::InvalidArgument(format!(
                "per-class bench at {bytes} B: {s:?}"
            )));
        }
        drop(heap);
        let (m, f) = (n as f64 / (alloc_ms * 1e6), n as f64 / (free_ms * 1e6));
        let (sa, sf) = slab(c, n, bytes, n + n / 2, &out, false)?;
        table.row(vec![
            format!("2^{log_n}"),
            bytes.to_string(),
            format!("{m:.1}"),
            format!("{f:.1}"),
            format!("{sa:.1}"),
            format!("{sf:.1}"),
            format!("{:.2}×", m / sa),
            format!("{:.2}×", f / sf),
        ]);
    }
    table.note(
        "carve_malloc: a general heap (DeviceHeap::general) whose every class holds twice the \
         row's bytes; slab: a slab heap of 1.5 N blocks of that size, as in the first table.",
    );
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
