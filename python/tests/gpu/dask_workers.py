"""One Dask worker per GPU on carve pools (carve.dask): each worker sums a CuPy array (and a
PyTorch tensor, when torch is installed) allocated from its carve pool. Prints one JSON line per
worker (its GPU, sums, hooked libraries, statistics and log), then "OK".

    python python/tests/gpu/dask_workers.py [--workers 2] [--n 67108864]

Workers come from dask-cuda's LocalCUDACluster when it is installed, else from a SpecCluster of
Nannies, each with its own CUDA_VISIBLE_DEVICES (what LocalCUDACluster does).
"""

import argparse
import dataclasses
import json
import os
import tempfile

import distributed

import carve
import carve.dask


def start_cluster(n):
    try:
        from dask_cuda import LocalCUDACluster
    except ImportError:
        pass
    else:
        return LocalCUDACluster(n_workers=n, threads_per_worker=1, dashboard_address=":0"), (
            "dask_cuda.LocalCUDACluster"
        )
    workers = {
        i: {
            "cls": distributed.Nanny,
            "options": {"nthreads": 1, "env": {"CUDA_VISIBLE_DEVICES": str(i)}},
        }
        for i in range(n)
    }
    scheduler = {"cls": distributed.Scheduler, "options": {"dashboard_address": ":0"}}
    return distributed.SpecCluster(workers=workers, scheduler=scheduler), "SpecCluster of Nannies"


def import_torch():
    """Run on each worker before the plugin: a worker that has imported torch gets it hooked."""
    import torch  # noqa: F401


def reduce_on_carve(n):
    """A task: sums arange(n) in float64 (exact below 2**53) on carve memory; reports the bytes
    the worker's carve statistics counted for each library."""
    import cupy

    worker = distributed.get_worker()
    plugin = worker.plugins["carve"]
    resource = carve.dask.worker_resource()
    assert carve.get_current_resource(plugin.device) is resource
    out = {"device": plugin.device, "hooked": plugin.hooked}
    before = carve.dask.worker_statistics().total_bytes
    x = cupy.arange(n, dtype=cupy.float64)
    out["cupy_sum"] = float(x.sum())
    out["cupy_bytes"] = carve.dask.worker_statistics().total_bytes - before
    del x
    if "torch" in plugin.hooked:
        import torch

        before = carve.dask.worker_statistics().total_bytes
        t = torch.arange(n, dtype=torch.float64, device="cuda")
        out["torch_sum"] = float(t.sum())
        out["torch_bytes"] = carve.dask.worker_statistics().total_bytes - before
        del t
    props = cupy.cuda.runtime.getDeviceProperties(0)
    out["gpu"] = "{:04x}:{:02x}:{:02x}".format(
        props["pciDomainID"], props["pciBusID"], props["pciDeviceID"]
    )
    out["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--n", type=int, default=1 << 26)
    args = ap.parse_args()
    n = args.n
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    logs = tempfile.mkdtemp(prefix="carve-dask-logs-")
    cluster, how = start_cluster(args.workers)
    print(f"cluster: {how}, {args.workers} workers; torch {'hooked' if have_torch else 'absent'}")
    with cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(args.workers)
        if have_torch:
            client.run(import_torch)
        carve.dask.setup(
            client,
            pool_size="1GiB",
            maximum_pool_size="4GiB",
            statistics=True,
            log_directory=logs,
        )
        addrs = sorted(client.scheduler_info()["workers"])
        futures = [client.submit(reduce_on_carve, n, workers=[a], pure=False) for a in addrs]
        results = dict(zip(addrs, client.gather(futures)))
        stats = carve.dask.cluster_statistics(client)
        log_files = client.run(lambda dask_worker: dask_worker.plugins["carve"].log_file)
    expected = float(n * (n - 1) // 2)
    for a in addrs:
        r = results[a]
        r["statistics"] = dataclasses.asdict(stats[a])
        r["log_lines"] = sum(1 for _ in open(log_files[a]))
        print(json.dumps({"worker": a, **r}))
        assert r["cupy_sum"] == expected, (r["cupy_sum"], expected)
        assert r["cupy_bytes"] >= 8 * n, r
        assert "cupy" in r["hooked"], r
        if have_torch:
            assert r["hooked"] == ["cupy", "torch"], r
            assert r["torch_sum"] == expected and r["torch_bytes"] >= 8 * n, r
        assert r["statistics"]["peak_bytes"] >= 8 * n, r
        assert r["statistics"]["current_bytes"] < 8 * n, r
        assert r["log_lines"] > 2, r
    gpus = {results[a]["gpu"] for a in addrs}
    assert len(gpus) == len(addrs), f"workers share GPUs: {gpus}"
    assert len(set(log_files.values())) == len(addrs), log_files
    print("OK")


if __name__ == "__main__":
    main()
