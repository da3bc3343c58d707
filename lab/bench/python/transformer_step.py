#!/usr/bin/env python3
"""Training-step time and device memory of a small transformer (python/tests/gpu/transformer.py)
with PyTorch's native caching allocator and with carve, each configuration in a fresh process
(peaks are per process), with the same seeds and shapes.

Device memory is what carve's resource holds from the driver at its peak plus what PyTorch
holds outside carve (segments of PyTorch's own pools, which it keeps until ``empty_cache``).
The driver's view, the growth of used device memory from start to exit, is printed beside it
as a check: it also counts the kernels PyTorch loads, the same in every configuration.

    python3 lab/bench/python/transformer_step.py [--steps 200] [--configs native,carve-use-expandable]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# The shared model, from the repository (lab/bench/python) or the staged .gpu-python/bench/python.
for tests in (os.path.join(ROOT, "python", "tests", "gpu"), os.path.join(ROOT, "..", "python", "tests", "gpu")):
    sys.path.insert(0, tests)

MiB = 1 << 20
NAMES = {
    "native": "PyTorch caching allocator (native)",
    "native-mempool": "PyTorch MemPool, no carve, backward on the calling thread (control)",
    "carve-use-expandable": "carve.torch.use(ExpandableResource)",
    "carve-use-one-range": "carve.torch.use(ExpandableResource(small_limit=any size)): one range of 2 MiB pages",
    "carve-use": "carve.torch.use(PoolResource(CudaResource))",
    "carve-pool-one-range": "carve.torch.pool(ExpandableResource(small_limit=any size)): one range of 2 MiB pages",
    "carve-pool-expandable": "carve.torch.pool(ExpandableResource)",
    "carve-pool": "carve.torch.pool(PoolResource(CudaResource))",
    "carve-cuda": "carve.torch.pool(CudaResource)",
    "carve-async": "carve.torch.pool(AsyncResource)",
}
CONFIGS = list(NAMES)


def held_by_carve(config, base, counted):
    """Peak bytes carve's resource took from the driver: the expandable pool's mapped pages,
    else the peak of the counting adaptor under the pool or over the driver resource."""
    if config.endswith("expandable") or config.endswith("one-range"):
        return int(base.stats()["peak_physical"])
    return int(counted.stats()["peak_bytes"])


def outside_carve(torch, pool):
    """Bytes of PyTorch's own segments (not carve's); PyTorch keeps them until empty_cache,
    so at exit this is their peak."""
    try:
        segs = torch.cuda.memory_snapshot()
    except RuntimeError:  # a pluggable global allocator keeps no snapshot
        return 0
    carve_id = tuple(pool.id) if pool is not None else None
    return sum(s["total_size"] for s in segs if tuple(s.get("segment_pool_id", (0, 0))) != carve_id)


def expandable(carve, opts):
    mib = lambda v: None if v is None else v * MiB
    return carve.ExpandableResource(
        0, small_limit=mib(opts.small_limit), large_chunk=mib(opts.large_chunk), headroom=opts.headroom
    )


def logical_peak(torch, config, counted):
    """The most bytes PyTorch had in tensors (and workspaces) at once."""
    if config.startswith("carve-use"):
        return int(counted.stats()["peak_bytes"])
    return torch.cuda.max_memory_allocated()


def child(config, steps, warmup, opts):
    import carve

    free0, _ = carve.mem_get_info(0)  # creates the context PyTorch will share
    import carve.torch
    import torch
    from transformer import SHAPES, batches, make_model, make_optimizer, step

    ctx = None
    base = counted = pool = carve_pool = None
    if config == "native-mempool":
        # Control: PyTorch's own MemPool, no carve, entered as carve.torch.pool enters its
        # pool (backward on the calling thread); what routing through a pool does by itself.
        ctx = contextlib.ExitStack()
        pool = torch.cuda.MemPool()
        ctx.enter_context(torch.cuda.use_mem_pool(pool))
        ctx.enter_context(torch.autograd.set_multithreading_enabled(False))
    elif config == "carve-use":
        counted = carve.StatisticsAdaptor(carve.CudaResource(0))
        base = carve.PoolResource(counted)
        carve.torch.use(base)
    elif config in ("carve-use-expandable", "carve-use-one-range"):
        base = expandable(carve, opts)
        if config == "carve-use-one-range":
            base = carve.ExpandableResource(0, small_limit=1 << 50, headroom=opts.headroom)
        counted = carve.StatisticsAdaptor(base)  # its peak is the logical peak
        carve.torch.use(counted)
    elif config == "carve-pool":
        counted = carve.StatisticsAdaptor(carve.CudaResource(0))  # what the pool takes
        base = carve.PoolResource(counted)
    elif config == "carve-pool-expandable":
        base = expandable(carve, opts)
    elif config == "carve-pool-one-range":
        base = carve.ExpandableResource(0, small_limit=1 << 50, headroom=opts.headroom)
    elif config != "native":
        base = carve.CudaResource(0) if config == "carve-cuda" else carve.AsyncResource(0)
        counted = carve.StatisticsAdaptor(base)
    if config.startswith("carve-pool") or config in ("carve-cuda", "carve-async"):
        ctx = contextlib.ExitStack()
        target = counted if config in ("carve-cuda", "carve-async") else base
        pool = ctx.enter_context(carve.torch.pool(target))
        carve_pool = pool
    model = make_model(seed=0)
    opt = make_optimizer(model)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(warmup + steps)]
    times = []
    for i, tokens in enumerate(batches(shapes, seed=1)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(model, opt, tokens)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    final_loss = float(loss.item())
    torch.cuda.synchronize()
    free1, _ = carve.mem_get_info(0)
    out = {
        "config": config,
        "median_ms": statistics.median(times),
        "loss": final_loss,
        "driver_growth": free0 - free1,
        "outside": outside_carve(torch, carve_pool),
        "logical": logical_peak(torch, config, counted),
        "carve": held_by_carve(config, base, counted) if base is not None else 0,
    }
    if ctx:
        ctx.close()
    out["device"] = out["carve"] + out["outside"]
    print("RESULT " + json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per config")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, from: " + ", ".join(CONFIGS))
    ap.add_argument("--large-chunk", type=int, help="the expandable pool's large page, MiB (default: carve's)")
    ap.add_argument("--headroom", type=float, help="the expandable pool's headroom (default: carve's)")
    ap.add_argument("--small-limit", type=int, help="the expandable pool's small-range limit, MiB (default: carve's)")
    ap.add_argument("--child", choices=CONFIGS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup, args)
        return
    configs = args.configs.split(",")
    if "native" not in configs:
        configs.insert(0, "native")
    results = {c: [] for c in configs}
    for _ in range(args.rounds):
        for c in configs:
            cmd = [sys.executable, __file__, "--child", c, "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            for flag, value in (("--large-chunk", args.large_chunk), ("--headroom", args.headroom),
                                ("--small-limit", args.small_limit)):
                if value is not None:
                    cmd += [flag, str(value)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.exit(f"{c} failed:\n{proc.stdout}\n{proc.stderr}")
            results[c].append(json.loads(line[0][7:]))
    med = lambda c, k: statistics.median(r[k] for r in results[c])
    peak = lambda c, k: max(r[k] for r in results[c])
    native_ms, native_dev = med("native", "median_ms"), peak("native", "device")
    native_drv = peak("native", "driver_growth")
    print(f"### transformer training step ({args.steps} steps after {args.warmup} warm-up, "
          f"median over {args.rounds} alternating processes)\n")
    print("| allocator | step (ms) | vs native | device memory (MiB) | vs native | of which carve | logical peak (MiB) | driver growth (MiB) | vs native | final loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for c in configs:
        ms, dev, drv = med(c, "median_ms"), peak(c, "device"), peak(c, "driver_growth")
        print(f"| {NAMES[c]} | {ms:.3f} | {ms / native_ms:.3f}× | {dev / MiB:,.1f} | "
              f"{dev / native_dev:.3f}× | {peak(c, 'carve') / MiB:,.1f} | {peak(c, 'logical') / MiB:,.1f} | {drv / MiB:,.1f} | "
              f"{drv / native_drv:.3f}× | {results[c][0]['loss']:.6f} |")


if __name__ == "__main__":
    main()
