"""The expandable pool and virtual memory over host virtual memory, the graph-safe resource and
the aligned, prefetch and failure-callback adaptors (no GPU)."""

import ctypes

import pytest

import carve

MIB = 1 << 20


def write_read(r, nbytes, alignment=256):
    p = r.allocate(nbytes, alignment)
    assert p % alignment == 0
    ctypes.memset(p, 0x5A, nbytes)
    assert ctypes.string_at(p + nbytes - 1, 1) == b"\x5a"
    r.deallocate(p, nbytes, alignment)


def test_expandable_over_host_memory_keeps_bytes_and_bounds_its_maximum():
    r = carve.ExpandableResource.over_host(maximum_size=16 * MIB)
    assert isinstance(r, carve.ExpandableResource)
    assert r.kind == "expandable"
    assert r.host_accessible
    write_read(r, 3 * MIB + 7)
    with pytest.raises(carve.OutOfMemoryError):
        r.allocate(64 * MIB)


def test_virtual_memory_over_host_memory():
    r = carve.VirtualMemoryResource.over_host(maximum_size=8 * MIB)
    assert r.kind == "virtual"
    write_read(r, 100_000, 4096)
    with pytest.raises(carve.OutOfMemoryError):
        r.allocate(32 * MIB)


@pytest.mark.parametrize(
    "make",
    [
        lambda: carve.ExpandableResource.over_host(MIB, granularity=3000),
        lambda: carve.ExpandableResource.over_host(MIB, headroom=2.0),
        lambda: carve.ExpandableResource.over_host(MIB, headroom=float("nan")),
        lambda: carve.VirtualMemoryResource.over_host(4 * MIB, chunk_size=3 << 10),
        lambda: carve.AlignedAdaptor(carve.HostResource(), 3000),
    ],
)
def test_bad_options_are_invalid_argument_errors(make):
    with pytest.raises(carve.InvalidArgumentError):
        make()


def test_device_constructors_without_a_device_are_typed_errors():
    if carve.is_available():
        pytest.skip("a device is present")
    with pytest.raises(carve.CarveError):
        carve.ExpandableResource()
    with pytest.raises(carve.CarveError):
        carve.VirtualMemoryResource()
    with pytest.raises(carve.NoDeviceError):
        carve.PrefetchAdaptor(carve.HostResource())


def test_aligned_adaptor_over_aligns_large_requests():
    a = carve.AlignedAdaptor(carve.HostResource(), 1 << 16, threshold=4096)
    assert a.kind == "aligned"
    p = a.allocate(8192)
    assert p % (1 << 16) == 0
    a.deallocate(p, 8192)


def test_graph_safe_wraps_an_upstream_and_keeps_it_alive():
    up = carve.HostResource()
    g = carve.GraphSafeResource(up)
    assert g.kind == "graph_safe"
    assert g.upstream is up
    with pytest.raises(TypeError):
        carve.GraphSafeResource(object())


def test_failure_callback_retries_while_it_returns_true():
    calls = []

    def cb(nbytes):
        calls.append(nbytes)
        return len(calls) < 3

    f = carve.FailureCallbackAdaptor(carve.LimitingAdaptor(carve.HostResource(), 4096), cb)
    assert f.kind == "failure_callback"
    with pytest.raises(carve.OutOfMemoryError):
        f.allocate(MIB)
    assert calls == [MIB] * 3
    write_read(f, 1024)


def test_an_exception_in_the_callback_means_no_retry_and_becomes_the_cause():
    calls = []

    def cb(nbytes):
        calls.append(nbytes)
        raise KeyError("spill failed")

    f = carve.FailureCallbackAdaptor(carve.LimitingAdaptor(carve.HostResource(), 4096), cb)
    with pytest.raises(carve.OutOfMemoryError) as info:
        f.allocate(MIB)
    assert calls == [MIB]
    assert isinstance(info.value.__cause__, KeyError)
    # The next failure does not report a stale exception.
    f2 = carve.FailureCallbackAdaptor(carve.LimitingAdaptor(carve.HostResource(), 4096), lambda n: False)
    with pytest.raises(carve.OutOfMemoryError) as info:
        f2.allocate(MIB)
    assert info.value.__cause__ is None


def test_failure_callback_must_be_callable():
    with pytest.raises(TypeError):
        carve.FailureCallbackAdaptor(carve.HostResource(), 42)
