#!/usr/bin/env python3
"""DDP training of the small transformer (python/tests/gpu/transformer.py) on 2 GPUs, one process
per GPU, with each rank's memory under PyTorch's native allocator or under carve
(``carve.torch.pool`` over a PoolResource, an ExpandableResource, or an ExpandableResource made
for NCCL and registered with it). Same seeds, same steps; deterministic kernels, so the losses
of every allocator must match to the last printed digit.

Every collective runs on carve memory under carve: the parameters, and the gradient buckets DDP
all-reduces (``gradient_as_bucket_view=True``, so each gradient is a view of its bucket), are
allocated inside the pool, and an explicit all_gather and broadcast run on tensors allocated
there; each is checked against the pool's segments (carve's allocations) before training.

Device memory per rank is as in transformer_step.py: what carve's resource took from the driver
at its peak plus PyTorch's segments outside carve.

    torchrun --nproc-per-node=2 lab/bench/python/ddp_train.py --allocator carve-expandable
    python3 lab/bench/python/ddp_train.py            # every allocator, each under torchrun
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
for tests in (os.path.join(ROOT, "python", "tests", "gpu"), os.path.join(ROOT, "..", "python", "tests", "gpu")):
    sys.path.insert(0, tests)
sys.path.insert(0, HERE)

MiB = 1 << 20
ALLOCATORS = ["native", "carve-pool", "carve-expandable", "carve-nccl"]
NAMES = {
    "native": "PyTorch caching allocator (native)",
    "carve-pool": "carve.torch.pool(PoolResource(CudaResource))",
    "carve-expandable": "carve.torch.pool(ExpandableResource)",
    "carve-nccl": "carve.torch.pool(nccl_resource()), registered with NCCL",
}


def emit(line):
    """Prints one line for the launcher to parse. Both ranks share torchrun's stdout pipe, and
    print() makes two writes (the text, then the newline) when Python runs unbuffered: one
    write() of at most PIPE_BUF bytes reaches the pipe whole."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), (line + "\n").encode())


def deterministic(torch):
    """Kernels that give the same bits on every run, whatever the addresses."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cudnn.benchmark = False


def carve_ranges(torch, pool):
    """(start, end) of every segment of `pool` (carve's allocations)."""
    pid = tuple(pool.id)
    return [
        (s["address"], s["address"] + s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if tuple(s.get("segment_pool_id", (0, 0))) == pid
    ]


def on_carve(ranges, t):
    p = t.data_ptr()
    return any(a <= p and p + t.numel() * t.element_size() <= b for a, b in ranges)


def carve_peak(base, counted):
    """Peak bytes carve's resource took from the driver: the counting adaptor's peak under the
    pool, else the expandable pool's peak of mapped pages."""
    if base is None:
        return 0
    if counted is not None:
        return int(counted.stats()["peak_bytes"])
    return int(base.stats()["peak_physical"])


def worker(args):
    import torch
    import torch.distributed as dist

    import carve
    import carve.torch
    from transformer import SHAPES, batches, make_model, make_optimizer, step
    from transformer_step import outside_carve

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    deterministic(torch)
    dist.init_process_group("nccl", device_id=dev)
    alloc = args.allocator
    base = counted = pool = None
    stack = contextlib.ExitStack()
    if alloc == "carve-pool":
        counted = carve.StatisticsAdaptor(carve.CudaResource(local))
        base = carve.PoolResource(counted)
    elif alloc == "carve-expandable":
        base = carve.ExpandableResource(local)
    elif alloc == "carve-nccl":
        base = carve.torch.nccl_resource(local)
    if base is not None:
        pool = stack.enter_context(carve.torch.pool(base))
    with stack:
        model = make_model(seed=0, device=dev)
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local], gradient_as_bucket_view=True
        )
        opt = make_optimizer(ddp)
        n = 1 << 18
        x = torch.full((n,), float(rank + 1), device=dev)
        gathered = torch.empty(world * n, device=dev)
        b = torch.arange(n, dtype=torch.float32, device=dev) if rank == 0 else torch.zeros(n, device=dev)
        registered = None
        if alloc == "carve-nccl":
            backend = dist.group.WORLD._get_backend(dev)
            if not hasattr(backend, "register_mem_pool"):
                sys.exit(f"this torch {torch.__version__} has no ProcessGroupNCCL.register_mem_pool")
            backend.register_mem_pool(pool)
            registered = backend
        dist.all_gather_into_tensor(gathered, x)
        dist.broadcast(b, src=0)
        want = torch.cat([torch.full((n,), float(r + 1), device=dev) for r in range(world)])
        assert torch.equal(gathered, want), "all_gather"
        assert torch.equal(b, torch.arange(n, dtype=torch.float32, device=dev)), "broadcast"
        shapes = [SHAPES[i % len(SHAPES)] for i in range(args.warmup + args.steps)]
        times, checked = [], False
        for i, tokens in enumerate(batches(shapes, seed=1 + rank, device=dev)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = step(ddp, opt, tokens)
            end.record()
            end.synchronize()
            if i >= args.warmup:
                times.append(start.elapsed_time(end))
            emit(f"LOSS rank={rank} step={i} loss={loss.item():.6f}")
            if pool is not None and not checked:
                # DDP all-reduced these buckets in the step just run.
                ranges = carve_ranges(torch, pool)
                bufs = {"x": x, "gathered": gathered, "broadcast": b}
                for name, p in ddp.module.named_parameters():
                    bufs["param " + name] = p
                    bufs["grad bucket of " + name] = p.grad
                off = [k for k, t in bufs.items() if not on_carve(ranges, t)]
                assert not off, f"not on carve memory: {off}"
                stats = base.stats()
                assert stats["bytes_in_use"] > 0, stats
                emit(f"CHECKED rank={rank}: {len(bufs)} collective tensors on carve's "
                     f"{len(ranges)} segments; carve bytes in use {stats['bytes_in_use']}")
                checked = True
        torch.cuda.synchronize()
        if registered is not None:
            registered.deregister_mem_pool(pool)
        out = {
            "allocator": alloc,
            "rank": rank,
            "median_ms": statistics.median(times),
            "outside": outside_carve(torch, pool),
            "carve": carve_peak(base, counted),
        }
        out["device"] = out["carve"] + out["outside"]
        emit("RESULT " + json.dumps(out))
        del ddp, model, opt, x, gathered, b
    dist.destroy_process_group()


def run(allocator, steps, warmup):
    """Runs the workers of one allocator under torchrun; returns (losses by (rank, step), results)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.abspath(__file__), "--allocator", allocator, "--steps", str(steps),
           "--warmup", str(warmup)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{allocator} failed:\n{proc.stdout}\n{proc.stderr}")
    losses, results = {}, []
    for line in proc.stdout.splitlines():
        if line.startswith("LOSS "):
            f = dict(kv.split("=") for kv in line[5:].split())
            losses[(int(f["rank"]), int(f["step"]))] = f["loss"]
        elif line.startswith("RESULT "):
            results.append(json.loads(line[7:]))
        elif line.startswith("CHECKED "):
            print(line)
    return losses, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--allocator", choices=ALLOCATORS, help="run as a torchrun worker")
    ap.add_argument("--allocators", default=",".join(ALLOCATORS))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    args = ap.parse_args()
    if args.allocator:
        worker(args)
        return
    runs = {a: run(a, args.steps, args.warmup) for a in args.allocators.split(",")}
    native_losses, native = runs["native"]
    print(f"\n### DDP on 2 GPUs: {args.steps} steps after {args.warmup} warm-up\n")
    print("| allocator | rank | step (ms) | vs native | device memory (MiB) | vs native | losses equal native |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for a, (losses, results) in runs.items():
        same = losses == native_losses
        ok &= same
        for r in sorted(results, key=lambda r: r["rank"]):
            nr = next(x for x in native if x["rank"] == r["rank"])
            print(f"| {NAMES[a]} | {r['rank']} | {r['median_ms']:.3f} | {r['median_ms'] / nr['median_ms']:.3f}× | "
                  f"{r['device'] / MiB:,.1f} | {r['device'] / nr['device']:.3f}× | {'yes' if same else 'NO'} |")
    last = max(s for _, s in native_losses)
    print("\nfinal losses (native): " + ", ".join(f"rank {r}: {native_losses[(r, last)]}" for r in (0, 1)))
    if not ok:
        sys.exit("losses differ from native")


if __name__ == "__main__":
    main()
