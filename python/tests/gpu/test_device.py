"""carve's resources and buffers on a GPU, from Python."""

import gc

import pytest

import carve

from .conftest import need


def test_current_resource_round_trips_the_same_object():
    before = carve.get_current_resource(0)
    pool = carve.PoolResource(carve.CudaResource(0), 1 << 24)
    prev = carve.set_current_resource(0, pool)
    try:
        assert carve.get_current_resource(0) is pool
        assert prev.kind in ("cuda", "current", before.kind)
        buf = carve.DeviceBuffer(1 << 20)
        assert buf.resource is pool
        assert pool.stats()["bytes_in_use"] >= 1 << 20
        del buf
        gc.collect()
        assert pool.stats()["bytes_in_use"] == 0
    finally:
        carve.set_current_resource(0, prev)


@pytest.mark.parametrize(
    "make, dl_type",
    [
        (lambda: carve.CudaResource(0), 2),
        (lambda: carve.PoolResource(carve.CudaResource(0), 1 << 22), 2),
        (lambda: carve.AsyncResource(0), 2),
        (lambda: carve.ManagedResource(0), 13),
    ],
    ids=["cuda", "pool", "async", "managed"],
)
def test_device_buffers_expose_cuda_array_interface_and_dlpack(make, dl_type):
    r = make()
    buf = carve.DeviceBuffer(4096, r)
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False)
    assert cai["shape"] == (4096,) and cai["typestr"] == "|u1" and cai["stream"] == 1
    assert buf.__dlpack_device__() == (dl_type, 0)
    buf.__dlpack__(stream=1)
    buf.__dlpack__(max_version=(1, 0), stream=-1)


def test_resource_statistics_on_device():
    a = carve.AsyncResource(0, initial_size=1 << 22)
    p = a.allocate(1 << 20)
    s = a.stats()
    assert s["allocated_bytes"] == 1 << 20 and s["reserved"] >= 1 << 20
    a.deallocate(p, 1 << 20)
    free, total = carve.mem_info(0)
    assert 0 < free <= total
    assert carve.device_count() >= 1


def test_limits_surface_as_out_of_memory():
    lim = carve.LimitingAdaptor(carve.CudaResource(0), 1 << 20)
    with pytest.raises(carve.OutOfMemoryError):
        carve.DeviceBuffer(2 << 20, lim)
    with pytest.raises(carve.OutOfMemoryError):
        carve.CudaResource(0).allocate(1 << 50)


def test_zero_copy_into_cupy_and_torch():
    cupy = need("cupy")
    torch = need("torch")
    buf = carve.DeviceBuffer(1 << 20, carve.PoolResource(carve.CudaResource(0)))
    a = cupy.asarray(buf)
    assert a.data.ptr == buf.ptr
    a[:] = 3
    t = torch.from_dlpack(buf)
    assert t.data_ptr() == buf.ptr and t.device.type == "cuda"
    assert int(t.sum().item()) == 3 << 20
    nb = need("numba.cuda")
    d = nb.cuda.as_cuda_array(buf)
    assert d.__cuda_array_interface__["data"][0] == buf.ptr


def test_async_pool_handle_is_shared_with_cupy():
    cupy = need("cupy")
    a = carve.AsyncResource(0)
    assert a.pool_handle
    # One handle per visible device: CuPy makes a single int every device's pool, and a device
    # refuses a pool of another (cudaErrorInvalidValue with two GPUs).
    n = cupy.cuda.runtime.getDeviceCount()
    shared = cupy.cuda.MemoryAsyncPool([a.pool_handle] + ["current"] * (n - 1))
    mem = shared.malloc(1 << 20)
    assert mem.ptr
    del mem
