//! The first table's measurements: per N and block size, the launch and atomic floors, the bump
//! arena, the slab (and its relaxed floor), CUDA's malloc and, when built, Gallatin.

use std::sync::Arc;

use carve::resource::{CudaBackingOptions, VirtualMemoryResource, VirtualOptions};
use carve::{DeviceHeap, DeviceVec, SharedResource};

use super::args::SlabHeap;
use super::gallatin::{self, Harness, Request, Sizes};
use super::layout::{rate, with_failures, SlabMeasured, SlabRow};
use super::timing::{per_s, time, time_alloc_free, timed_malloc_free, Ctx, RUNS};

/// Largest heap the benchmark reserves.
const MAX_HEAP: u64 = 40 << 30;

/// Slab alloc and free rates (G/s) with the heap at `cap` blocks; `relaxed` runs the ablation
/// kernels (bitmap atomics without Acquire/Release).
pub(super) fn slab(
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
    Ok((per_s(n, alloc), per_s(n, free)))
}

/// CUDA's in-kernel malloc then free, or why not.
fn cuda_malloc(c: &Ctx, n: u64, bs: u64, out: &DeviceVec<u64>) -> carve::Result<(String, String)> {
    let k = c.kernels();
    // SAFETY: out holds n u64s; the malloc heap limit was set before the first launch.
    timed_malloc_free(c, n, out, || unsafe {
        k.cuda_malloc(n, out.as_ptr(), n, bs)
    })
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
    Ok(with_failures(rate(per_s(n, ms)), failed.get()))
}

/// The first table's rows over `ns` (log2) × `sizes`; `slab_only` measures the slab's alloc
/// and free (and Gallatin's) alone. Why Gallatin gave no figures for a row goes to `notes`.
pub(super) fn rows(
    c: &Ctx,
    ns: &[u32],
    sizes: &[u64],
    slab_only: bool,
    gallatin: Option<&Harness>,
    notes: &mut Vec<String>,
) -> carve::Result<Vec<SlabRow>> {
    let mut rows = Vec::new();
    let counter = DeviceVec::<u64>::zeroed(2, &c.stream, c.mr.clone())?;
    for &log_n in ns {
        let n = 1u64 << log_n;
        let out = DeviceVec::<u64>::zeroed(n as usize, &c.stream, c.mr.clone())?;
        let k = c.kernels();
        // The floor of the kernels below: the same grid (n threads), doing nothing.
        // SAFETY: no arguments.
        let empty_ms = time(&c.dev, &c.stream, || unsafe { k.empty(n) }, || Ok(()))?;
        for &bs in sizes {
            let mut row = SlabRow {
                log_n,
                block: bs,
                empty_ms,
                m: None,
            };
            if n * bs * 3 / 2 > MAX_HEAP {
                rows.push(row);
                continue;
            }
            // The heaps of one row come and go in a fixed order: the bump arena, then the slabs.
            let mut m = SlabMeasured::default();
            if !slab_only {
                let (ctr, sink) = (counter.as_ptr(), counter.as_ptr() + 8);
                let add = time(
                    &c.dev,
                    &c.stream,
                    // SAFETY: ctr and sink are u64s in device memory.
                    || unsafe { k.atomic_add(n, ctr, n, bs, sink) },
                    || Ok(()),
                )?;
                m.atomic_add = Some(rate(per_s(n, add)));
                let arena = DeviceHeap::bump(c.mr.clone(), &c.stream, n * bs * 3 / 2)?;
                let h = arena.device_ptr();
                // SAFETY: the arena outlives the launch; sink is a u64.
                let bump = || unsafe { k.bump_alloc_sink(n, h, n, bs, 16, sink) };
                m.bump = Some(bump_rate(c, n, &arena, bump)?);
                arena.reset()?;
                // The block-cooperative entry point: one reservation per block of 256 threads.
                // SAFETY: as above.
                let block = || unsafe { k.bump_alloc_block_sink(n, h, n, bs, 16, sink) };
                m.bump_block = Some(bump_rate(c, n, &arena, block)?);
            }
            m.slab = slab(c, n, bs, n + n / 2, &out, false)?;
            if !slab_only {
                m.relaxed = Some(slab(c, n, bs, n + n / 2, &out, true)?);
                m.fill50 = Some(slab(c, n, bs, 2 * n, &out, false)?.0);
                m.fill90 = Some(slab(c, n, bs, (n * 10).div_ceil(9), &out, false)?.0);
                if log_n == 20 && (bs == 16 || bs == 1024) {
                    m.cuda = Some(cuda_malloc(c, n, bs, &out)?);
                }
            }
            if let Some(g) = gallatin {
                let req = Request {
                    n,
                    sizes: Sizes::One(bs),
                    heap_bytes: gallatin::heap_bytes(
                        n * gallatin::granted(bs),
                        c.args.gallatin_heap_gib,
                    ),
                    runs: RUNS,
                };
                m.gallatin = g.row(&req, &format!("2^{log_n} × {bs} B"), notes);
            }
            row.m = Some(m);
            rows.push(row);
        }
    }
    Ok(rows)
}
