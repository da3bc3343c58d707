#!/usr/bin/env python3
"""All-reduce bus bandwidth over 2 GPUs, 1 MiB to 1 GiB, side by side in one run, on buffers from:
PyTorch's native allocator; carve's expandable pool made for NCCL (carve.torch.nccl_mem_pool),
not registered and registered with NCCL (ProcessGroupNCCL.register_mem_pool); carve's whole-chunk
virtual memory with 1 GiB chunks (each buffer one driver allocation), registered; and
ncclMemAlloc (the NCCL backend's mem_allocator), registered, where this torch exposes it.

Bus bandwidth as nccl-tests defines it for all-reduce: bytes * 2 * (n - 1) / n / time. Whatever
this torch lacks is printed, with the nearest path that works instead.

    torchrun --standalone --nproc-per-node=2 lab/bench/python/nccl_allreduce.py [--iters 20]
"""

import argparse
import os
import sys
import time

MiB = 1 << 20
SIZES = [MiB << (2 * k) for k in range(6)]  # 1, 4, 16, 64, 256, 1024 MiB


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import carve
    import carve.torch

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    backend = dist.group.WORLD._get_backend(dev)
    notes = []

    def say(msg):
        if rank == 0:
            print(msg, flush=True)
            notes.append(msg)

    can_register = hasattr(backend, "register_mem_pool")
    if not can_register:
        say(f"torch {torch.__version__}: ProcessGroupNCCL has no register_mem_pool; "
            "'registered' rows run unregistered")
    n = SIZES[-1] // 4
    configs, pools = {}, []

    def in_pool(name, pool, register):
        with torch.cuda.use_mem_pool(pool):
            t = torch.zeros(n, dtype=torch.float32, device=dev)
        if register and can_register:
            try:
                backend.register_mem_pool(pool)
                pools.append(pool)
            except Exception as e:  # reported, and the row runs unregistered
                say(f"{name}: register_mem_pool failed ({type(e).__name__}: {e}); runs unregistered")
        configs[name] = t

    configs["PyTorch native"] = torch.zeros(n, dtype=torch.float32, device=dev)
    in_pool("carve expandable, not registered", carve.torch.nccl_mem_pool(local), False)
    in_pool("carve expandable, registered", carve.torch.nccl_mem_pool(local), True)
    one_gib = carve.torch.nccl_resource(local, expandable=False, chunk_size=SIZES[-1])
    in_pool("carve virtual (1 GiB chunks), registered", carve.torch.mem_pool(one_gib), True)
    allocator = getattr(backend, "mem_allocator", None)
    if allocator is None:
        say(f"torch {torch.__version__}: the NCCL backend has no mem_allocator (ncclMemAlloc); "
            "no ncclMemAlloc row")
    else:
        try:
            in_pool("ncclMemAlloc, registered", torch.cuda.MemPool(allocator), True)
        except Exception as e:
            say(f"ncclMemAlloc pool failed ({type(e).__name__}: {e}); no ncclMemAlloc row")

    factor = 2 * (world - 1) / world
    table = {}
    for name, buf in configs.items():
        for size in SIZES:
            t = buf[: size // 4]
            for _ in range(args.warmup):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                dist.all_reduce(t)
            torch.cuda.synchronize()
            secs = (time.perf_counter() - start) / args.iters
            table[(name, size)] = size * factor / secs / 1e9
    if rank == 0:
        names = list(configs)
        print(f"\n### all-reduce bus bandwidth (GB/s), {world} GPUs, float32 sum, "
              f"{args.iters} iterations after {args.warmup}; torch {torch.__version__}, "
              f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}\n")
        print("| size | " + " | ".join(names) + " |")
        print("| --- |" + " --- |" * len(names))
        for size in SIZES:
            label = f"{size // MiB} MiB" if size < 1 << 30 else f"{size >> 30} GiB"
            print(f"| {label} | " + " | ".join(f"{table[(c, size)]:.1f}" for c in names) + " |")
        for msg in notes:
            print(f"\nnote: {msg}")
    for pool in pools:
        backend.deregister_mem_pool(pool)
    del configs
    dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" not in os.environ:
        sys.exit("run under torchrun: torchrun --standalone --nproc-per-node=2 " + __file__)
    main()
