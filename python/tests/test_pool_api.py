"""CuPy's pool methods on carve.PoolResource, over host memory (no GPU)."""

import pytest

import carve

MiB = 1 << 20


def test_used_free_and_total_bytes_follow_the_pool():
    pool = carve.PoolResource(carve.HostResource())
    assert (pool.used_bytes(), pool.free_bytes(), pool.total_bytes()) == (0, 0, 0)
    a = pool.allocate(1000)
    assert pool.used_bytes() == 1024  # rounded to the pool's 256-byte grain
    assert pool.total_bytes() >= 1024
    assert pool.free_bytes() == pool.total_bytes() - pool.used_bytes()
    stats = pool.stats()
    assert stats["bytes_in_use"] == pool.used_bytes()
    assert stats["pool_size"] == pool.total_bytes()
    pool.deallocate(a, 1000)
    assert pool.used_bytes() == 0
    assert pool.free_bytes() == pool.total_bytes() > 0


def test_free_all_blocks_returns_empty_chunks_upstream():
    host = carve.HostResource()
    pool = carve.PoolResource(host, 4 * MiB)
    kept = pool.allocate(100)
    blocks = [pool.allocate(MiB) for _ in range(8)]
    for b in blocks:
        pool.deallocate(b, MiB)
    held = pool.total_bytes()
    assert held > 4 * MiB
    assert pool.free_all_blocks() is None
    assert pool.used_bytes() == 256
    assert 0 < pool.total_bytes() < held
    assert host.stats()["allocated_bytes"] == pool.total_bytes()
    pool.deallocate(kept, 100)
    pool.free_all_blocks(stream=0)
    assert (pool.used_bytes(), pool.free_bytes(), pool.total_bytes()) == (0, 0, 0)
    assert host.stats()["allocated_bytes"] == 0


def test_set_limit_bounds_what_the_pool_takes_from_its_upstream():
    pool = carve.PoolResource(carve.HostResource())
    assert pool.get_limit() == 0
    pool.set_limit(size=4 * MiB)
    assert pool.get_limit() == 4 * MiB
    blocks = []
    with pytest.raises(carve.OutOfMemoryError, match="limit is 4194304 bytes"):
        for _ in range(8):
            blocks.append(pool.allocate(MiB))
    assert 1 <= len(blocks) <= 4
    assert pool.total_bytes() <= 4 * MiB
    # Lowering the limit below what the pool holds keeps that memory usable.
    for b in blocks:
        pool.deallocate(b, MiB)
    pool.set_limit(MiB // 2)
    again = pool.allocate(MiB)
    pool.deallocate(again, MiB)
    # No argument, or 0, removes the limit, as in CuPy.
    pool.set_limit()
    assert pool.get_limit() == 0
    big = [pool.allocate(MiB) for _ in range(8)]
    for b in big:
        pool.deallocate(b, MiB)
    pool.set_limit(MiB)
    pool.set_limit(0)
    assert pool.get_limit() == 0
    pool.set_limit(1.5 * MiB)
    assert pool.get_limit() == 3 * MiB // 2


def test_set_limit_refuses_what_cupy_refuses():
    pool = carve.PoolResource(carve.HostResource())
    with pytest.raises(ValueError, match="cannot be specified at one time"):
        pool.set_limit(size=MiB, fraction=0.5)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="fraction out of range"):
            pool.set_limit(fraction=bad)
    with pytest.raises(ValueError, match="size out of range"):
        pool.set_limit(-1)
    # A fraction is of a device's memory; a pool of host memory has none.
    with pytest.raises(carve.InvalidArgumentError, match="device memory"):
        pool.set_limit(fraction=0.5)
    assert pool.get_limit() == 0


def test_the_limit_applies_under_adaptors_and_through_the_maximum():
    pool = carve.PoolResource(carve.HostResource(), 0, maximum_size=2 * MiB)
    stats = carve.StatisticsAdaptor(pool)
    pool.set_limit(8 * MiB)
    with pytest.raises(carve.OutOfMemoryError, match="maximum"):
        stats.allocate(4 * MiB)
    pool.set_limit(MiB)
    with pytest.raises(carve.OutOfMemoryError, match="limit"):
        stats.allocate(2 * MiB)
    p = stats.allocate(MiB // 2)
    assert pool.used_bytes() == MiB // 2
    stats.deallocate(p, MiB // 2)


def test_memory_stats_reports_the_common_counters():
    pool = carve.PoolResource(carve.HostResource(), MiB)
    c = carve._carve.memory_stats(pool._r)
    assert c == {"bytes_in_use": 0, "bytes_reserved": MiB, "peak_bytes": None, "live_blocks": 0}
    s = carve.StatisticsAdaptor(pool)
    p = s.allocate(100)
    assert carve._carve.memory_stats(s._r)["peak_bytes"] == 100
    s.deallocate(p, 100)
