"""Resources over host memory: every kind, composition, statistics and errors (no GPU)."""

import gc

import pytest

import carve


def roundtrip(r, sizes=(1, 100, 4096, 100_000)):
    ptrs = [(r.allocate(n), n) for n in sizes]
    for p, _ in ptrs:
        assert p % 256 == 0
    assert len({p for p, _ in ptrs}) == len(ptrs)
    for p, n in ptrs:
        r.deallocate(p, n)


@pytest.mark.parametrize(
    "make",
    [
        lambda h: carve.PoolResource(h, 1 << 20),
        lambda h: carve.PoolResource(h, 0, maximum_size=1 << 22),
        lambda h: carve.BinningResource(h, 8, 16),
        lambda h: carve.ArenaResource(h, superblock_size=1 << 20, arenas=2),
        lambda h: carve.FixedSizeResource(h, 1 << 17),
        lambda h: carve.LimitingAdaptor(h, 1 << 24),
        lambda h: carve.StatisticsAdaptor(h),
        lambda h: carve.TrackingAdaptor(h),
    ],
    ids=["pool", "pool-max", "binning", "arena", "fixed", "limiting", "statistics", "tracking"],
)
def test_every_suballocator_and_adaptor_works_over_host_memory(make):
    h = carve.HostResource()
    r = make(h)
    assert r.upstream is h
    assert r.host_accessible and not r.device_accessible
    roundtrip(r)
    assert h.stats()["allocated_bytes"] >= 0


def test_host_resource_counts_and_refuses_bad_frees():
    h = carve.HostResource()
    assert h.kind == "host"
    p = h.allocate(100, 64)
    assert h.stats() == {"allocated_bytes": 100, "allocation_count": 1}
    with pytest.raises(carve.BadPointerError, match="allocated as 100 bytes but freed as 50"):
        h.deallocate(p, 50)
    with pytest.raises(carve.BadPointerError, match="does not own"):
        h.deallocate(p + 256, 100)
    with pytest.raises(carve.BadPointerError, match="null pointer"):
        h.deallocate(0, 100)
    h.deallocate(p, 100)
    with pytest.raises(carve.BadPointerError):
        h.deallocate(p, 100)
    assert h.stats()["allocation_count"] == 0


def test_bad_sizes_and_alignments_raise_invalid_argument():
    h = carve.HostResource()
    with pytest.raises(carve.InvalidArgumentError, match="zero-byte"):
        h.allocate(0)
    with pytest.raises(carve.InvalidArgumentError, match="not a power of two"):
        h.allocate(64, 3)
    with pytest.raises(carve.InvalidArgumentError):
        h.allocate(2**64 - 1)
    with pytest.raises(OverflowError):
        h.allocate(-1)
    with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
        h.allocate(0)
    with pytest.raises(carve.InvalidArgumentError, match="bin exponents"):
        carve.BinningResource(h, 12, 4)
    with pytest.raises(carve.InvalidArgumentError):
        carve.PoolResource(h, 1 << 22, maximum_size=1 << 20)
    with pytest.raises(TypeError):
        carve.PoolResource("not a resource")


def test_stack_composes_and_statistics_count_through_it():
    h = carve.HostResource()
    pool = carve.PoolResource(h, 1 << 20, maximum_size=1 << 22)
    limited = carve.LimitingAdaptor(pool, 1 << 20)
    stats = carve.StatisticsAdaptor(limited)
    a = stats.allocate(4096)
    b = stats.allocate(8192)
    s = stats.stats()
    assert s["current_bytes"] == 12288 and s["current_count"] == 2
    assert pool.stats()["bytes_in_use"] == 12288
    assert limited.stats() == {"limit": 1 << 20, "allocated_bytes": 12288}
    with pytest.raises(carve.OutOfMemoryError, match="out of memory") as e:
        stats.allocate(1 << 20)
    assert isinstance(e.value, MemoryError)
    assert stats.stats()["current_count"] == 2
    stats.deallocate(a, 4096)
    stats.deallocate(b, 8192)
    s = stats.stats()
    assert s["current_bytes"] == 0 and s["peak_bytes"] == 12288 and s["total_count"] == 2
    assert pool.release() >= 0
    with pytest.raises(carve.UnsupportedError):
        stats.release()


def test_upstreams_stay_alive_while_an_adaptor_uses_them():
    pool = carve.PoolResource(carve.HostResource(), 1 << 20)
    stats = carve.StatisticsAdaptor(pool)
    del pool
    gc.collect()
    p = stats.allocate(1000)
    stats.deallocate(p, 1000)
    assert stats.upstream.kind == "pool"


def test_pool_exhaustion_is_out_of_memory():
    pool = carve.PoolResource(carve.HostResource(), 0, maximum_size=1 << 20)
    p = pool.allocate(1 << 20)
    with pytest.raises(carve.OutOfMemoryError):
        pool.allocate(256)
    pool.deallocate(p, 1 << 20)
    pool.deallocate(pool.allocate(256), 256)


def test_logging_adaptor_writes_rmm_csv(tmp_path):
    h = carve.HostResource()
    log = tmp_path / "log.csv"
    r = carve.LoggingAdaptor(h, log, auto_flush=True)
    r.deallocate(r.allocate(1000), 1000)
    lines = log.read_text().splitlines()
    assert len(lines) == 3
    assert "allocate" in lines[1] and "free" in lines[2]
    with pytest.raises(carve.CarveIOError):
        carve.LoggingAdaptor(h, tmp_path / "missing-dir" / "x.csv")
    with pytest.raises(OSError):
        carve.LoggingAdaptor(h, tmp_path / "missing-dir" / "x.csv")


def test_tracking_refuses_foreign_pointers():
    t = carve.TrackingAdaptor(carve.HostResource())
    with pytest.raises(carve.BadPointerError):
        t.deallocate(0x100000, 64)
    p = t.allocate(64)
    assert t.stats() == {"allocated_bytes": 64, "allocation_count": 1}
    t.deallocate(p, 64)


def test_repr_and_handles_are_distinct():
    a, b = carve.HostResource(), carve.HostResource()
    assert a.handle != b.handle
    assert "HostResource" in repr(a)


def test_device_resources_need_a_device():
    if carve.is_available():
        pytest.skip("a GPU is present; this checks the no-device path")
    for make in (
        lambda: carve.CudaResource(0),
        lambda: carve.ManagedResource(0),
        lambda: carve.PinnedResource(0),
        lambda: carve.AsyncResource(0),
        lambda: carve.get_current_resource(0),
        lambda: carve.set_current_resource(0, carve.HostResource()),
        lambda: carve.mem_info(0),
        lambda: carve.device_count(),
    ):
        with pytest.raises(carve.NoDeviceError, match="CUDA driver"):
            make()
    with pytest.raises(TypeError):
        carve.set_current_resource(0, object())
