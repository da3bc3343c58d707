"""DeviceBuffer over host memory: DLPack into NumPy, lifetime, and the protocol's errors."""

import gc

import numpy as np
import pytest

import carve


def test_dlpack_into_numpy_is_writable_and_shares_memory():
    stats = carve.StatisticsAdaptor(carve.HostResource())
    buf = carve.DeviceBuffer(1000, stats)
    assert buf.nbytes == len(buf) == 1000 and buf.resource is stats
    assert buf.__dlpack_device__() == (1, 0)  # kDLCPU
    a = np.from_dlpack(buf)
    assert a.shape == (1000,) and a.dtype == np.uint8
    a[:] = 7
    b = np.from_dlpack(buf)
    assert b.ctypes.data == buf.ptr and int(b.sum()) == 7000


def test_the_block_lives_until_the_last_view_goes():
    stats = carve.StatisticsAdaptor(carve.HostResource())
    buf = carve.DeviceBuffer(4096, stats)
    view = np.from_dlpack(buf)
    del buf
    gc.collect()
    assert stats.stats()["current_count"] == 1
    view[:] = 1  # still valid memory
    del view
    gc.collect()
    assert stats.stats()["current_count"] == 0


def test_unconsumed_capsules_free_their_reference():
    stats = carve.StatisticsAdaptor(carve.HostResource())
    buf = carve.DeviceBuffer(64, stats)
    for kw in ({}, {"max_version": (1, 0)}, {"max_version": (0, 8)}):
        cap = buf.__dlpack__(**kw)
        del cap
    del buf
    gc.collect()
    assert stats.stats()["current_count"] == 0


def test_capsule_names_follow_the_requested_version():
    buf = carve.DeviceBuffer(64, carve.HostResource())
    assert "dltensor_versioned" in repr(buf.__dlpack__(max_version=(1, 2)))
    assert '"dltensor"' in repr(buf.__dlpack__())


def test_host_memory_has_no_cuda_array_interface_and_dlpack_refuses_other_devices():
    buf = carve.DeviceBuffer(64, carve.HostResource())
    assert not hasattr(buf, "__cuda_array_interface__")
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)


def test_bad_arguments():
    h = carve.HostResource()
    with pytest.raises(carve.InvalidArgumentError):
        carve.DeviceBuffer(0, h)
    with pytest.raises(TypeError):
        carve.DeviceBuffer(64, "nope")
    limited = carve.LimitingAdaptor(h, 1024)
    with pytest.raises(carve.OutOfMemoryError):
        carve.DeviceBuffer(4096, limited)


def test_a_failed_free_is_recorded_not_swallowed():
    carve.take_deferred_error()  # start clean
    before = carve.deferred_error_count()
    h = carve.HostResource()
    buf = carve.DeviceBuffer(256, h)
    h.deallocate(buf.ptr, 256)  # freed behind the buffer's back: its own free must fail
    del buf
    gc.collect()
    e = carve.take_deferred_error()
    assert isinstance(e, carve.BadPointerError), e
    assert "DeviceBuffer" in str(e)
    assert carve.deferred_error_count() == before + 1
    assert carve.take_deferred_error() is None


class _Stream:
    """A stream object as frameworks hand them out (``__cuda_stream__``); 0 is the legacy
    default stream, which needs no GPU to name."""

    def __cuda_stream__(self):
        return (0, 0)


def test_a_stream_object_lives_as_long_as_the_buffer_ordered_on_it():
    import weakref

    s = _Stream()
    alive = weakref.ref(s)
    buf = carve.DeviceBuffer(64, carve.HostResource(), stream=s)
    view = np.from_dlpack(buf)
    assert buf.stream == 0
    del s, buf
    gc.collect()
    assert alive() is not None  # the view still holds the block, and the block its stream
    del view
    gc.collect()
    # NumPy ran the DLPack deleter outside carve's calls, so the reference goes back at the
    # next one.
    carve.deferred_error_count()
    assert alive() is None


def test_streams_are_ints_or_stream_objects():
    h = carve.HostResource()

    class Torchish:
        cuda_stream = 0

    class Cupyish:
        ptr = 0

    for s in (0, Torchish(), Cupyish(), _Stream()):
        assert carve.DeviceBuffer(64, h, stream=s).stream == 0
        p = h.allocate(64, stream=s)
        h.deallocate(p, 64, stream=s)
    for bad in ("stream", 1.5, object()):
        with pytest.raises(TypeError):
            carve.DeviceBuffer(64, h, stream=bad)
    with pytest.raises(carve.InvalidArgumentError):
        carve.DeviceBuffer(64, h, stream=-5)


def test_dlpack_refuses_a_negative_stream_other_than_minus_one():
    buf = carve.DeviceBuffer(64, carve.HostResource())
    for s in (-2, -7, -(2**40)):
        with pytest.raises(carve.InvalidArgumentError):
            buf.__dlpack__(stream=s)
    buf.__dlpack__(stream=-1)
