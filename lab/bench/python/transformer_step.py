#!/usr/bin/env python3
"""Training-step time and peak reserved memory of a small transformer (tests/gpu/transformer.py)
with PyTorch's native caching allocator and with carve under carve.torch.pool. Each
configuration runs in a fresh process (peaks are per process); the same seeds and shapes.

    python3 bench/python/transformer_step.py [--steps 200]
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "python", "tests", "gpu"))

CONFIGS = ["native", "native-mempool", "carve-pool", "carve-cuda", "carve-async", "carve-use"]
MiB = 1 << 20


def child(config, steps, warmup):
    import torch

    import carve
    import carve.torch
    from transformer import SHAPES, batches, make_model, make_optimizer, step

    res = None
    ctx = None
    upstream = None
    if config == "native-mempool":
        # Control: PyTorch's own MemPool, no carve, entered as carve.torch.pool enters its
        # pool (backward on the calling thread); what routing through a pool costs.
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.cuda.use_mem_pool(torch.cuda.MemPool()))
        ctx.enter_context(torch.autograd.set_multithreading_enabled(False))
    elif config == "carve-use":
        # carve as PyTorch's only allocator; PyTorch's reserved counters stay empty, so the
        # pool's upstream is counted instead.
        upstream = carve.StatisticsAdaptor(carve.CudaResource(0))
        carve.torch.use(carve.PoolResource(upstream), device=0)
    elif config != "native":
        base = {
            "carve-pool": lambda: carve.PoolResource(carve.CudaResource(0)),
            "carve-cuda": lambda: carve.CudaResource(0),
            "carve-async": lambda: carve.AsyncResource(0),
        }[config]()
        res = carve.StatisticsAdaptor(base)
        ctx = carve.torch.pool(res)
    if ctx:
        ctx.__enter__()
    model = make_model(seed=0)
    opt = make_optimizer(model)
    shapes = [SHAPES[i % len(SHAPES)] for i in range(warmup + steps)]
    times = []
    for i, tokens in enumerate(batches(shapes, seed=1)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, opt, tokens)
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    if ctx:
        ctx.__exit__(None, None, None)
    out = {
        "config": config,
        "median_ms": statistics.median(times),
        "mean_ms": statistics.fmean(times),
    }
    if upstream is None:  # a pluggable global allocator has no PyTorch device stats
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
    if upstream is not None:
        out["peak_reserved"] = upstream.stats()["peak_bytes"]
        out["carve_peak"] = upstream.stats()["peak_bytes"]
    if res is not None:
        s = res.stats()
        out["carve_peak"] = s["peak_bytes"]
        if config == "carve-pool":
            out["carve_pool_size"] = res.upstream.stats()["pool_size"]
    print("RESULT " + json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per config")
    ap.add_argument("--child", choices=CONFIGS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.steps, args.warmup)
        return
    results = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for c in CONFIGS:
            cmd = [sys.executable, __file__, "--child", c, "--steps", str(args.steps),
                   "--warmup", str(args.warmup)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
            if proc.returncode != 0 or not line:
                sys.exit(f"{c} failed:\n{proc.stdout}\n{proc.stderr}")
            results[c].append(json.loads(line[0][7:]))
    native = statistics.median(r["median_ms"] for r in results["native"])
    native_peak = max(r["peak_reserved"] for r in results["native"])
    print(f"### transformer training step ({args.steps} steps after {args.warmup} warm-up, "
          f"median over {args.rounds} alternating processes)\n")
    print("| allocator | step (ms, median) | vs native | peak reserved (MiB) | vs native | carve peak (MiB) |")
    print("| --- | --- | --- | --- | --- | --- |")
    names = {
        "native": "PyTorch caching allocator (native)",
        "carve-pool": "carve.torch.pool(carve PoolResource(CudaResource))",
        "carve-cuda": "carve.torch.pool(carve CudaResource)",
        "carve-async": "carve.torch.pool(carve AsyncResource)",
        "native-mempool": "PyTorch MemPool, no carve, backward on the calling thread (control)",
        "carve-use": "carve.torch.use(carve PoolResource(CudaResource)) (reserved: the pool's upstream)",
    }
    for c in CONFIGS:
        ms = statistics.median(r["median_ms"] for r in results[c])
        peak = max(r["peak_reserved"] for r in results[c])
        carve_peak = max((r.get("carve_peak", 0) for r in results[c]), default=0)
        cp = f"{carve_peak / MiB:,.1f}" if c != "native" else "–"
        print(f"| {names[c]} | {ms:.3f} | {ms / native - 1:+.1%} | {peak / MiB:,.1f} | "
              f"{peak / native_peak - 1:+.1%} | {cp} |")
    pool = [r.get("carve_pool_size") for r in results["carve-pool"]]
    print(f"\ncarve pool size at exit (carve-pool): {max(pool) / MiB:,.1f} MiB")


if __name__ == "__main__":
    main()
