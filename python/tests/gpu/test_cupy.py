"""CuPy workloads through carve.cupy.set_allocator."""

import gc

import pytest

import carve

from .conftest import need

cupy = need("cupy")
import carve.cupy  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def restore_cupy_allocator():
    yield
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


def test_array_workloads_allocate_from_the_resource(restore_cupy_allocator):
    res = carve.StatisticsAdaptor(carve.PoolResource(carve.CudaResource(0), 64 * MiB))
    carve.cupy.set_allocator(res)
    a = cupy.arange(1 << 20, dtype=cupy.float32)
    b = (a * 2).reshape(1024, 1024)
    c = b @ b.T
    total = float(cupy.asnumpy(b.sum()))
    assert total == pytest.approx(float(2 * sum(range(1 << 20))), rel=1e-6)
    assert c.shape == (1024, 1024)
    s = res.stats()
    assert s["current_count"] >= 3 and s["current_bytes"] >= 3 * 4 * MiB
    for size in [1, 17, 4096, 3 * MiB + 5, 0]:
        x = cupy.empty(size, dtype=cupy.uint8)
        x.fill(1)
        assert int(x.sum()) == size
    del a, b, c, x
    gc.collect()
    cupy.cuda.Device(0).synchronize()
    assert res.stats()["current_count"] == 0


def test_exhaustion_raises_cupy_out_of_memory(restore_cupy_allocator):
    carve.cupy.set_allocator(carve.LimitingAdaptor(carve.CudaResource(0), 4 * MiB))
    keep = cupy.empty(2 * MiB, dtype=cupy.uint8)
    with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as e:
        cupy.empty(8 * MiB, dtype=cupy.uint8)
    assert isinstance(e.value.__cause__, carve.OutOfMemoryError)
    assert "out of memory" in str(e.value.__cause__)
    ok = cupy.ones(MiB, dtype=cupy.uint8)
    assert int(ok.sum()) == MiB
    del keep, ok


def test_current_resource_allocator(restore_cupy_allocator):
    pool = carve.StatisticsAdaptor(carve.PoolResource(carve.CudaResource(0)))
    prev = carve.set_current_resource(0, pool)
    try:
        carve.cupy.set_allocator()  # follows the current resource
        a = cupy.zeros(MiB, dtype=cupy.uint8)
        assert pool.stats()["current_bytes"] >= MiB
        del a
    finally:
        carve.set_current_resource(0, prev)
