"""CUDA graph capture into a carve.torch.graph_pool: the tensors the capture creates come from
a carve GraphSafeResource, the capture makes no driver allocation (its upstream pool already
holds the memory), and replays compute the right values."""

import gc

import pytest

import carve

from .conftest import need

torch = need("torch")
import carve.torch  # noqa: E402

MiB = 1 << 20


def step(x, w):
    """A few ops, each creating a new tensor."""
    h = torch.relu(x @ w)
    return torch.tanh(h * 0.5 + x).sum(dim=1)


def test_a_captured_graph_allocates_from_carve_and_replays_correctly():
    cuda = carve.StatisticsAdaptor(carve.CudaResource(0))
    upstream = carve.PoolResource(cuda, initial_size=64 * MiB)
    pool = carve.torch.graph_pool(upstream)
    res = carve.torch._graph_safe[-1][1]
    assert isinstance(res, carve.GraphSafeResource) and res.upstream is upstream

    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(128, 256, device="cuda", generator=gen)
    w = torch.randn(256, 256, device="cuda", generator=gen)
    # Warm up on a side stream, as PyTorch asks before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(x, w)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    driver_allocs = cuda.stats()["total_count"]
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        y = step(x, w)
    torch.cuda.synchronize()
    assert cuda.stats()["total_count"] == driver_allocs, "no driver allocation during capture"

    s = res.stats()
    assert s["graph_pools"] == 1 and s["blocks"] >= 1 and s["bytes_in_use"] > 0, s
    # PyTorch's segments of the pool are the graph pool's blocks.
    segments = pool.snapshot()
    held = sum(seg["total_size"] for seg in segments)
    assert segments and held == s["bytes_in_use"], (held, s)
    starts = [(seg["address"], seg["address"] + seg["total_size"]) for seg in segments]
    assert any(a <= y.data_ptr() < b for a, b in starts), "the output lives in carve's memory"

    for i in range(4):
        x.copy_(torch.randn(128, 256, device="cuda", generator=gen))
        g.replay()
        torch.cuda.synchronize()
        assert torch.allclose(y, step(x, w), rtol=1e-4, atol=1e-4), f"replay {i}"
    assert res.stats()["graph_pools"] == 1, "replays allocate nothing"

    del g, y, pool
    gc.collect()


def test_the_default_graph_pool_wraps_the_current_resource():
    pool = carve.torch.graph_pool()
    wrapped = len(carve.torch._graph_safe)
    again = carve.torch.graph_pool()
    assert len(carve.torch._graph_safe) == wrapped, "one graph-safe resource per upstream"
    assert carve.torch._graph_safe[-1][0].kind in ("cuda", "current")
    x = torch.ones(64, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        y = x * 3 + 1
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 4.0))
    del g, y, pool, again
    gc.collect()


def test_graph_pool_refuses_host_resources():
    with pytest.raises(ValueError, match="device resource"):
        carve.torch.graph_pool(carve.HostResource())
