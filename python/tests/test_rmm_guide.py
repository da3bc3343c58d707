"""RMM's Python user guide with carve's names, on the CPU: buffers over a host resource, the
statistics module over a host resource made current, reinitialize's hooks and arguments.
tests/gpu/test_rmm_guide.py runs the guide's examples as written, on the current device."""

import os

import numpy as np
import pytest

import carve
import carve.statistics as cs
from carve._sizes import parse_bytes

MiB = 1 << 20


def test_device_buffer_size_ptr_nbytes():
    h = carve.HostResource()
    buf = carve.DeviceBuffer(size=100, mr=h)
    assert buf.size == 100 and buf.nbytes == 100 and len(buf) == 100
    assert buf.ptr != 0
    assert buf.resource is h
    with pytest.raises(TypeError):
        carve.DeviceBuffer(100, size=100, mr=h)
    with pytest.raises(TypeError):
        carve.DeviceBuffer(size=100, resource=h, mr=h)


def test_to_device_and_back():
    h = carve.HostResource()
    a = np.array([1, 2, 3], dtype="float64")
    buf = carve.DeviceBuffer.to_device(a.view("int8"), mr=h)  # the guide's example
    assert buf.size == 24
    assert np.array_equal(np.frombuffer(buf.tobytes()), [1.0, 2.0, 3.0])
    # Any buffer-protocol object, as its bytes in C order.
    for host in (b"abc", bytearray(b"abc"), memoryview(b"abc"), np.frombuffer(b"abc", "u1")):
        assert carve.DeviceBuffer.to_device(host, mr=h).tobytes() == b"abc"
    m = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert carve.DeviceBuffer.to_device(m, mr=h).tobytes() == m.tobytes()
    strided = m[:, ::2]
    assert carve.DeviceBuffer.to_device(strided, mr=h).tobytes() == strided.tobytes()
    with pytest.raises(TypeError):
        carve.DeviceBuffer.to_device(12, mr=h)


def test_copy_to_host():
    h = carve.HostResource()
    buf = carve.DeviceBuffer.to_device(b"abcdef", mr=h)
    out = buf.copy_to_host()
    assert isinstance(out, np.ndarray) and out.dtype == np.uint8
    assert out.tobytes() == b"abcdef"
    out[0] = 0  # a writable array of its own
    assert buf.tobytes() == b"abcdef"
    ba = bytearray(8)
    assert buf.copy_to_host(ba) is ba and ba == bytearray(b"abcdef\0\0")
    arr = np.zeros(2, dtype=np.float64)
    assert buf.copy_to_host(out=arr) is arr
    assert arr.view(np.uint8)[:6].tobytes() == b"abcdef"
    with pytest.raises(ValueError):
        buf.copy_to_host(bytearray(5))
    with pytest.raises(TypeError):
        buf.copy_to_host(b"123456")  # read-only
    buf.copy_from_host(b"XY")
    assert buf.tobytes() == b"XYcdef"
    with pytest.raises(carve.InvalidArgumentError):
        buf.copy_from_host(b"0123456789")


def test_mr_names():
    assert carve.mr.CudaMemoryResource is carve.CudaResource
    assert carve.mr.ManagedMemoryResource is carve.ManagedResource
    assert carve.mr.StatisticsResourceAdaptor is carve.StatisticsAdaptor
    assert carve.mr.DeviceMemoryResource is carve.Resource
    h = carve.HostResource()
    pool = carve.mr.PoolMemoryResource(h, initial_pool_size="1MiB", maximum_pool_size=2**22)
    assert isinstance(pool, carve.PoolResource)
    buf = carve.DeviceBuffer(size=4096, mr=pool)
    limited = carve.mr.LimitingResourceAdaptor(h, allocation_limit=MiB)
    assert limited.get_allocation_limit() == MiB
    lb = carve.DeviceBuffer(size=1000, mr=limited)
    assert limited.get_allocated_bytes() >= 1000
    tracked = carve.mr.TrackingResourceAdaptor(h)
    tb = carve.DeviceBuffer(size=512, mr=tracked)
    assert tracked.get_allocated_bytes() == 512
    fixed = carve.mr.FixedSizeMemoryResource(h, block_size=4096, blocks_to_preallocate=4)
    binning = carve.mr.BinningMemoryResource(h, 10, 16)
    for r in (fixed, binning):
        assert carve.DeviceBuffer(size=1000, mr=r).size == 1000
    del buf, lb, tb


def test_logging_adaptor_names_its_file_per_device(tmp_path, monkeypatch):
    monkeypatch.setattr(carve._carve, "current_device", lambda: 0)
    log = carve.mr.LoggingResourceAdaptor(carve.HostResource(), str(tmp_path / "rmm_log.csv"))
    assert log.get_file_name() == str(tmp_path / "rmm_log.dev0.csv")
    del log
    assert (tmp_path / "rmm_log.dev0.csv").exists()
    monkeypatch.delenv("CARVE_LOG_FILE", raising=False)
    monkeypatch.delenv("RMM_LOG_FILE", raising=False)
    with pytest.raises(ValueError):
        carve.mr.LoggingResourceAdaptor(carve.HostResource())


@pytest.fixture
def host_current(monkeypatch):
    """The current device's resource is a host resource (no GPU needed)."""
    state = {"r": carve.HostResource()}
    monkeypatch.setattr(carve.mr, "get_current_device_resource", lambda: state["r"])
    monkeypatch.setattr(carve.mr, "set_current_device_resource", lambda r: state.update(r=r))
    return state


def test_statistics_enable_get_push_pop(host_current):
    assert cs.get_statistics() is None
    assert cs.push_statistics() is None and cs.pop_statistics() is None
    cs.enable_statistics()
    stats_mr = host_current["r"]
    assert isinstance(stats_mr, carve.mr.StatisticsResourceAdaptor)
    cs.enable_statistics()  # idempotent
    assert host_current["r"] is stats_mr
    a = carve.DeviceBuffer(size=1000, mr=stats_mr)
    s = cs.get_statistics()
    assert (s.current_bytes, s.current_count, s.peak_bytes, s.total_bytes) == (1000, 1, 1000, 1000)
    before = cs.push_statistics()
    assert before.current_bytes == 1000
    b = carve.DeviceBuffer(size=300, mr=stats_mr)
    del b
    inner = cs.get_statistics()
    assert (inner.current_bytes, inner.peak_bytes, inner.total_bytes) == (0, 300, 300)
    popped = cs.pop_statistics()
    assert popped == inner
    outer = cs.get_statistics()
    assert (outer.current_bytes, outer.peak_bytes, outer.total_bytes) == (1000, 1300, 1300)
    with pytest.raises(carve.InvalidArgumentError):
        stats_mr.pop_counters()
    del a


def test_statistics_context(host_current):
    plain = host_current["r"]
    with cs.statistics():
        mr = host_current["r"]
        assert isinstance(mr, carve.StatisticsAdaptor)
        buf = carve.DeviceBuffer(size=64, mr=mr)
        assert cs.get_statistics().peak_bytes == 64
        with cs.statistics():  # nested: a new scope on the same adaptor
            assert host_current["r"] is mr
            assert cs.get_statistics().current_bytes == 0
        del buf
    assert host_current["r"] is plain
    with pytest.raises(ValueError):
        with cs.statistics():
            host_current["r"] = carve.HostResource()


def test_profiler_reports_the_peak_per_function(host_current):
    records = cs.ProfilerRecords()

    @cs.profiler(records=records)
    def f(n):
        mr = carve.mr.get_current_device_resource()
        bufs = [carve.DeviceBuffer(size=n, mr=mr) for _ in range(3)]
        return len(bufs)

    f(100)  # statistics off: nothing recorded
    assert records.records == {}
    cs.enable_statistics()
    f(100)
    f(200)
    with cs.profiler(records=records, name="block"):
        carve.DeviceBuffer(size=50, mr=host_current["r"])
    with pytest.raises(ValueError):
        with cs.profiler(records=records):
            pass
    recs = records.records
    (fname,) = [k for k in recs if k.endswith("(test_profiler_reports_the_peak_per_function.<locals>.f)")]
    assert (recs[fname].num_calls, recs[fname].memory_peak, recs[fname].memory_total) == (2, 600, 900)
    assert (recs["block"].num_calls, recs["block"].memory_peak) == (1, 50)
    report = records.report()
    assert "Memory Profiling" in report and "block" in report and "600" in report
    names = [line.split("  ")[-1] for line in report.splitlines()[-2:]]
    assert names == [fname, "block"]  # ordered by peak
    assert "No data" in cs.ProfilerRecords().report()
    assert cs.default_profiler_records is not records


def test_reinitialize_runs_hooks_first_in_reverse_order(monkeypatch):
    calls = []

    def hook(tag, *, extra=None):
        calls.append((tag, extra))

    def other():
        calls.append("other")

    carve.register_reinitialize_hook(hook, "a", extra=1)
    carve.register_reinitialize_hook(other)
    carve.register_reinitialize_hook(hook, "b")
    seen = {}

    def fake(pool, managed, initial, maximum, devices, log_files):
        seen.update(pool=pool, managed=managed, initial=initial, maximum=maximum, devices=devices, log_files=log_files)
        return []

    monkeypatch.setattr(carve._carve, "reinitialize", fake)
    try:
        carve.reinitialize(
            pool_allocator=True,
            initial_pool_size="1GiB",
            maximum_pool_size=2**32,
            devices=[0, 1],
            logging=True,
            log_file_name="/tmp/x/carve.csv",
        )
        assert calls == [("b", None), "other", ("a", 1)]
        assert seen == dict(
            pool=True,
            managed=False,
            initial=2**30,
            maximum=2**32,
            devices=[0, 1],
            log_files=["/tmp/x/carve.dev0.csv", "/tmp/x/carve.dev1.csv"],
        )
        carve.unregister_reinitialize_hook(hook)
        calls.clear()
        carve.reinitialize(initial_pool_size=5, managed_memory=True)  # sizes ignored without a pool
        assert calls == ["other"]
        assert seen["initial"] is None and seen["managed"] and seen["devices"] == [0]
        assert seen["log_files"] is None
    finally:
        carve.unregister_reinitialize_hook(hook)
        carve.unregister_reinitialize_hook(other)


def test_reinitialize_bad_arguments(monkeypatch):
    monkeypatch.delenv("CARVE_LOG_FILE", raising=False)
    monkeypatch.delenv("RMM_LOG_FILE", raising=False)
    with pytest.raises(ValueError):
        carve.reinitialize(logging=True)
    with pytest.raises(ValueError):
        carve.reinitialize(pool_allocator=True, initial_pool_size="lots")
    # Refused before any device is touched, so the same error with or without a GPU.
    with pytest.raises(carve.InvalidArgumentError):
        carve.reinitialize(devices=[])
    with pytest.raises(carve.InvalidArgumentError):
        carve.reinitialize(devices=[0, 0])
    with pytest.raises(carve.InvalidArgumentError):
        carve.reinitialize(pool_allocator=True, initial_pool_size=2 * MiB, maximum_pool_size=MiB)


def test_reinitialize_without_a_gpu_fails_typed():
    if carve.is_available():
        pytest.skip("a GPU is present (tests/gpu/test_rmm_guide.py covers it)")
    with pytest.raises(carve.CarveError):
        carve.reinitialize()


def test_parse_bytes():
    assert parse_bytes(12) == 12
    assert parse_bytes("1GiB") == 2**30
    assert parse_bytes("512 MB") == 512 * 10**6
    assert parse_bytes("1e9") == 10**9
    assert parse_bytes("4kib") == 4096
    for bad in ("-1", "1 parsec", ""):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError):
        parse_bytes(-1)
    with pytest.raises(TypeError):
        parse_bytes(1.5)
