"""CuPy's pool methods on a carve pool of device memory."""

import importlib

import pytest

import carve

from .conftest import need

MiB = 1 << 20


def test_set_limit_by_fraction_of_the_device_memory():
    pool = carve.PoolResource(carve.CudaResource(0))
    total = carve.mem_get_info(0)[1]
    pool.set_limit(fraction=0.5)
    assert pool.get_limit() == int(0.5 * total)
    pool.set_limit(fraction=0)
    assert pool.get_limit() == 0
    # A limit far below the device's memory is what stops the pool.
    pool.set_limit(fraction=64 * MiB / total)
    blocks = []
    with pytest.raises(carve.OutOfMemoryError, match="limit"):
        for _ in range(128):
            blocks.append(pool.allocate(MiB))
    assert 32 <= len(blocks) <= 64
    assert pool.total_bytes() <= pool.get_limit()
    assert pool.used_bytes() == len(blocks) * MiB
    for b in blocks:
        pool.deallocate(b, MiB)


def test_free_all_blocks_gives_device_memory_back():
    pool = carve.PoolResource(carve.CudaResource(0))
    blocks = [pool.allocate(64 * MiB) for _ in range(4)]
    assert pool.used_bytes() == 256 * MiB
    for b in blocks:
        pool.deallocate(b, 64 * MiB)
    assert pool.free_bytes() == pool.total_bytes() >= 256 * MiB
    before = carve.mem_get_info(0)[0]
    pool.free_all_blocks()
    assert pool.total_bytes() == 0 and pool.free_bytes() == 0
    assert carve.mem_get_info(0)[0] >= before + 200 * MiB


def test_cupy_allocations_count_in_used_bytes():
    cupy = need("cupy")
    carve_cupy = importlib.import_module("carve.cupy")

    pool = carve.PoolResource(carve.CudaResource(0))
    carve_cupy.set_allocator(pool)
    try:
        a = cupy.zeros(MiB, dtype=cupy.uint8)
        assert pool.used_bytes() >= MiB
        del a
        cupy.cuda.Device(0).synchronize()
        assert pool.used_bytes() == 0
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
