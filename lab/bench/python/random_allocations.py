#!/usr/bin/env python3
"""RMM's random_allocations workload from Python, through each framework's allocator and
through carve, side by side in one process (see bench/random_allocations.rs for the workload).

2×N steps; each allocates (sizes uniform in 1..=max) with 73 % probability while fewer than N
allocations were made and live bytes stay under the cap, and otherwise frees a random live
allocation. The operation sequence is generated once (fixed seed) and replayed for every row,
so rows differ only in the allocator. A control row replays it with no allocator at all: the
cost of the Python loop itself. Reports ns per step, median of --passes passes after a warm-up.

    python3 bench/python/random_allocations.py [--n 10000] [--passes 3]
"""

import argparse
import gc
import random
import statistics
import sys
import time

import carve

MiB = 1 << 20
SEED = 0x5EED


def make_ops(n, max_bytes, cap, seed=SEED):
    """[(size, index)]: size > 0 allocates (appended to the live list); size 0 frees live[index]
    (swap-remove)."""
    rng = random.Random(seed)
    ops, live, made, live_bytes = [], [], 0, 0
    for _ in range(2 * n):
        size = rng.randint(1, max_bytes)
        if rng.random() < 0.73 and made < n and live_bytes + size <= cap:
            ops.append((size, 0))
            live.append(size)
            made += 1
            live_bytes += size
        elif live:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            live_bytes -= live.pop()
            ops.append((0, i))
    return ops


def replay_objects(ops, alloc):
    """Allocators that return owning objects (freed when dropped): CuPy, torch tensors."""
    live = []
    t0 = time.perf_counter_ns()
    for size, i in ops:
        if size:
            live.append(alloc(size))
        else:
            live[i] = live[-1]
            live.pop()
    t1 = time.perf_counter_ns()
    live.clear()
    return t1 - t0


def replay_raw(ops, alloc, free):
    """Allocators with explicit free(ptr, size)."""
    live = []
    t0 = time.perf_counter_ns()
    for size, i in ops:
        if size:
            live.append((alloc(size), size))
        else:
            p, s = live[i]
            live[i] = live[-1]
            live.pop()
            free(p, s)
    t1 = time.perf_counter_ns()
    for p, s in live:
        free(p, s)
    return t1 - t0


def control(ops):
    live = []
    t0 = time.perf_counter_ns()
    for size, i in ops:
        if size:
            live.append(size)
        else:
            live[i] = live[-1]
            live.pop()
    return time.perf_counter_ns() - t0


def rows(cap):
    """(name, run(ops) -> ns, sync) for every allocator available here."""
    out = [("Python loop only (control)", control, None)]
    try:
        import cupy

        from carve import cupy as ccupy

        sync = cupy.cuda.Device(0).synchronize
        pool = cupy.cuda.MemoryPool()
        out.append(("CuPy MemoryPool.malloc", lambda ops: replay_objects(ops, pool.malloc), sync))
        res = carve.PoolResource(carve.CudaResource(0), cap)
        guarded = ccupy.allocator(res)
        out.append(("CuPy CFunctionAllocator → carve pool (guarded, what set_allocator installs)",
                    lambda ops: replay_objects(ops, guarded), sync))
        raw = guarded.cfunction_allocator.malloc
        out.append(("CuPy CFunctionAllocator → carve pool (unguarded)",
                    lambda ops: replay_objects(ops, raw), sync))
        async_pool = cupy.cuda.MemoryAsyncPool()
        out.append(("CuPy MemoryAsyncPool.malloc (driver pool)",
                    lambda ops: replay_objects(ops, async_pool.malloc), sync))
    except ImportError as e:
        print(f"(CuPy rows skipped: {e})", file=sys.stderr)
    try:
        import torch

        sync = torch.cuda.synchronize
        stream = torch.cuda.current_stream().cuda_stream
        alloc = lambda size: torch.cuda.caching_allocator_alloc(size, 0, stream)  # noqa: E731
        free = lambda p, size: torch.cuda.caching_allocator_delete(p)  # noqa: E731
        out.append(("torch.cuda.caching_allocator_alloc/delete (native caching allocator)",
                    lambda ops: replay_raw(ops, alloc, free), sync))
        empty = lambda size: torch.empty(size, dtype=torch.uint8, device="cuda")  # noqa: E731
        out.append(("torch.empty (native caching allocator)", lambda ops: replay_objects(ops, empty), sync))
        from carve import torch as ctorch

        mp = ctorch.mem_pool(carve.PoolResource(carve.CudaResource(0), cap))

        def in_pool(ops):
            with torch.cuda.use_mem_pool(mp):
                return replay_objects(ops, empty)

        out.append(("torch.empty in carve.torch.mem_pool(carve pool)", in_pool, sync))
    except ImportError as e:
        print(f"(torch rows skipped: {e})", file=sys.stderr)
    res = carve.PoolResource(carve.CudaResource(0), cap)
    out.append(("carve PoolResource.allocate/deallocate (Python wrapper)",
                lambda ops: replay_raw(ops, res.allocate, res.deallocate), None))
    r = res._r
    out.append(("carve _carve.Resource.allocate/deallocate (extension, no wrapper)",
                lambda ops: replay_raw(ops, r.allocate, r.deallocate), None))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1000, 10000, 100000])
    ap.add_argument("--max", type=int, nargs="+", default=[1 * MiB, 64 << 10], help="max bytes")
    ap.add_argument("--cap", type=int, default=4096 * MiB, help="live-bytes cap")
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    if not carve.is_available():
        sys.exit("no CUDA device: this benchmark needs a GPU")
    variants = [(n, m) for m in args.max for n in args.n]
    opss = {v: make_ops(v[0], v[1], args.cap) for v in variants}
    header = [f"N={n:.0e}, {m // 1024} KiB".replace("+0", "") for n, m in variants]
    print("### random_allocations from Python: ns per step (median of "
          f"{args.passes} passes after a warm-up pass)\n")
    print("| allocator | " + " | ".join(header) + " |")
    print("| --- |" + " --- |" * len(variants))
    for name, run, sync in rows(args.cap):
        cells = []
        for v in variants:
            ops = opss[v]
            gc.collect()
            gc.disable()
            try:
                run(ops)  # warm-up
                if sync:
                    sync()
                times = []
                for _ in range(args.passes):
                    times.append(run(ops))
                    if sync:
                        sync()
            finally:
                gc.enable()
            cells.append(f"{statistics.median(times) / len(ops):,.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    import platform

    print(f"\nPython {platform.python_version()}; live-bytes cap {args.cap // MiB} MiB; seed {SEED:#x}")


if __name__ == "__main__":
    main()
