"""RMM's Python user guide, example by example, with carve's names, on the current device."""

import numpy as np
import pytest

import carve
import carve.statistics as cs

from .conftest import need, run_script


@pytest.fixture(autouse=True)
def _restore_current():
    before = carve.mr.get_current_device_resource()
    yield
    carve.mr.set_current_device_resource(before)


def test_device_buffers():
    buf = carve.DeviceBuffer(size=100)
    assert buf.size == 100
    assert buf.ptr > 0
    a = np.array([1, 2, 3], dtype="float64")
    buf = carve.DeviceBuffer.to_device(a.view("int8"))
    assert buf.size == 24
    assert np.array_equal(np.frombuffer(buf.tobytes()), np.array([1.0, 2.0, 3.0]))
    assert np.array_equal(buf.copy_to_host().view("float64"), a)


def test_to_device_on_a_stream():
    cupy = pytest.importorskip("cupy")
    s = cupy.cuda.Stream(non_blocking=True)
    data = np.arange(1 << 20, dtype=np.float32)
    buf = carve.DeviceBuffer.to_device(data, stream=s)
    assert buf.stream == s.ptr
    out = np.empty_like(data)
    buf.copy_to_host(out, stream=s)
    assert np.array_equal(out, data)


def test_managed_memory_resource():
    carve.mr.set_current_device_resource(carve.mr.ManagedMemoryResource())
    buf = carve.DeviceBuffer.to_device(b"managed")
    assert buf.resource.kind == "managed" and buf.tobytes() == b"managed"


@pytest.mark.parametrize("upstream", ["cuda", "managed"])
def test_pool_memory_resource(upstream):
    up = carve.mr.CudaMemoryResource() if upstream == "cuda" else carve.mr.ManagedMemoryResource()
    pool = carve.mr.PoolMemoryResource(up, initial_pool_size=2**30, maximum_pool_size=2**32)
    carve.mr.set_current_device_resource(pool)
    assert carve.mr.get_current_device_resource() is pool
    buf = carve.DeviceBuffer(size=1 << 20)
    assert buf.resource is pool
    del buf


def test_other_resources():
    cuda = carve.mr.CudaMemoryResource()
    for r in (
        carve.mr.FixedSizeMemoryResource(cuda, block_size=1 << 20),
        carve.mr.BinningMemoryResource(cuda, 10, 20),
        carve.mr.CudaAsyncMemoryResource(initial_pool_size="64MiB"),
    ):
        carve.mr.set_current_device_resource(r)
        assert carve.DeviceBuffer.to_device(b"x" * 1000).tobytes() == b"x" * 1000


def test_reinitialize_with_a_logged_pool(tmp_path):
    hooked = []
    carve.register_reinitialize_hook(hooked.append, "ran")
    try:
        carve.reinitialize(
            pool_allocator=True,
            initial_pool_size=2**26,
            maximum_pool_size=2**30,
            devices=0,
            logging=True,
            log_file_name=tmp_path / "carve_log.csv",
        )
    finally:
        carve.unregister_reinitialize_hook(hooked.append)
    assert hooked == ["ran"]
    mr = carve.mr.get_current_device_resource()
    assert isinstance(mr, carve.LoggingAdaptor)
    buf = carve.DeviceBuffer(size=4096)
    del buf
    log = (tmp_path / "carve_log.dev0.csv").read_text().splitlines()
    assert log[0].startswith("Thread,Time,Action,Pointer,Size,Stream"), log[0]
    assert any(",allocate," in line and ",4096," in line for line in log), log
    assert any(",free," in line and ",4096," in line for line in log), log
    carve.reinitialize(managed_memory=True)
    assert carve.DeviceBuffer.to_device(b"m").resource.kind == "managed"
    carve.reinitialize()


def test_statistics_and_profiler():
    with cs.statistics():
        buf = carve.DeviceBuffer(size=1000)
        assert cs.get_statistics().peak_bytes == 1000
        records = cs.ProfilerRecords()

        @cs.profiler(records=records)
        def twice():
            return [carve.DeviceBuffer(size=4096) for _ in range(2)]

        twice()
        (rec,) = records.records.values()
        assert rec.memory_peak == 8192
        assert "twice" in records.report()
        del buf


def test_cupy_allocator():
    cupy = need("cupy")
    from carve.allocators.cupy import carve_cupy_allocator

    stats = carve.StatisticsAdaptor(carve.mr.CudaMemoryResource())
    carve.mr.set_current_device_resource(stats)
    cupy.cuda.set_allocator(carve_cupy_allocator)
    try:
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        assert float(a.sum()) == float(np.arange(1 << 20, dtype=np.float32).sum())
        assert stats.stats()["current_bytes"] >= 4 << 20
        del a
    finally:
        cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@pytest.mark.parametrize("how", ["env", "set_memory_manager"])
def test_numba_manager(how):
    need("numba")
    env = {"NUMBA_CUDA_MEMORY_MANAGER": "carve.allocators.numba"} if how == "env" else {}
    run_script("rmm_guide_frameworks.py", "numba", how, env=env)


def test_torch_allocator():
    need("torch")
    run_script("rmm_guide_frameworks.py", "torch")
