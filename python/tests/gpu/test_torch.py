"""PyTorch under carve: a small transformer trained inside carve.torch.mem_pool(...), its
memory statistics and out-of-memory behaviour; the global swap (use) runs in a subprocess."""

import gc

import pytest

import carve

from .conftest import need, run_script

torch = need("torch")
import carve.torch  # noqa: E402

from .transformer import SHAPES, make_model, train  # noqa: E402

MiB = 1 << 20


def test_training_in_a_carve_mem_pool_matches_native_and_reports_stats():
    torch.manual_seed(0)
    native = train(make_model(seed=0), SHAPES, seed=1)

    res = carve.StatisticsAdaptor(carve.PoolResource(carve.CudaResource(0), 64 * MiB))
    pool = carve.torch.mem_pool(res)
    with torch.cuda.use_mem_pool(pool):
        losses = train(make_model(seed=0), SHAPES, seed=1)
    torch.cuda.synchronize()
    assert losses == pytest.approx(native, rel=1e-3, abs=1e-4)
    s = res.stats()
    assert s["peak_bytes"] > 0 and s["total_count"] > 0
    # PyTorch's own accounting still works: the pool's segments show in its snapshot.
    segments = pool.snapshot()
    held = sum(seg["total_size"] for seg in segments)
    assert segments and held == s["current_bytes"], (held, s)
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] > 0
    del pool
    gc.collect()


def test_pool_routes_the_backward_pass_to_carve():
    """Under carve.torch.pool, autograd's backward allocates in the carve-backed pool too, so
    PyTorch reserves nothing beside it; with autograd's worker threads kept, backward's tensors
    land in the default pool."""

    def reserved_outside_pool(resource, **kwargs):
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        with carve.torch.pool(resource, **kwargs) as pool:
            train(make_model(seed=0), SHAPES[:2], seed=1)
            torch.cuda.synchronize()
            in_pool = sum(seg["total_size"] for seg in pool.snapshot())
            outside = torch.cuda.memory_reserved() - in_pool - base
            # The model and its gradients go while the pool is still entered (as in
            # test_training_in_a_carve_mem_pool_matches_native_and_reports_stats).
            gc.collect()
        del pool
        gc.collect()
        return outside

    res = carve.StatisticsAdaptor(carve.CudaResource(0))
    assert reserved_outside_pool(res) == 0, "backward allocated outside the pool"
    assert res.stats()["peak_bytes"] > 0
    assert reserved_outside_pool(carve.CudaResource(0), autograd_threads=True) > 0, (
        "autograd's worker threads allocated in the pool"
    )


def test_an_exhausted_resource_is_torch_out_of_memory():
    # Room for PyTorch's own segments (a reduction asks for a 32 MiB one) besides the tensors.
    lim = carve.LimitingAdaptor(carve.CudaResource(0), 128 * MiB)
    pool = carve.torch.mem_pool(lim)
    with torch.cuda.use_mem_pool(pool):
        small = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
        again = torch.ones(4 * MiB, dtype=torch.uint8, device="cuda")
        assert int(again.sum().item()) == 4 * MiB
    del small, again


def test_two_pools_use_two_resources():
    a = carve.StatisticsAdaptor(carve.CudaResource(0))
    b = carve.StatisticsAdaptor(carve.CudaResource(0))
    pa, pb = carve.torch.mem_pool(a), carve.torch.mem_pool(b)
    assert carve.torch.slot_of(a) != carve.torch.slot_of(b)
    with torch.cuda.use_mem_pool(pa):
        x = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with torch.cuda.use_mem_pool(pb):
        y = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    assert a.stats()["current_bytes"] >= 8 * MiB and b.stats()["current_bytes"] >= 8 * MiB
    del x, y


def test_use_swaps_the_global_allocator():
    out = run_script("torch_use.py")
    assert "torch use: ok" in out


def test_use_raises_out_of_memory_with_no_compiler_at_hand():
    # A C++ compiler that cannot be found: carve.torch.use must still turn an exhausted
    # resource into torch.OutOfMemoryError.
    out = run_script("torch_use.py", env={"CXX": "/nonexistent/c++", "CC": "/nonexistent/cc"})
    assert "torch use: ok" in out
    assert "warn" not in out.lower(), out


def test_use_without_a_device_first_thing_in_a_fresh_process():
    out = run_script("torch_use_current_device.py")
    assert "torch use on the current device: ok" in out
