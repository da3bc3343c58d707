"""The segment callback and the NCCL options of the virtual-memory resources, over host virtual
memory (no GPU)."""

import threading

import pytest

import carve

KIB = 1 << 10
MIB = 1 << 20
G = 64 * KIB  # the host granularity


def test_the_callback_sees_each_chunk_mapped_and_each_released():
    seen = []
    r = carve.VirtualMemoryResource.over_host(
        64 * G, on_segment=lambda p, n, mapped: seen.append((p, n, mapped))
    )
    a = r.allocate(3 * G // 2)
    assert seen == [(a, G, True), (a + G, G, True)]
    seen.clear()
    r.deallocate(a, 3 * G // 2)
    assert seen == [], "a free unmaps nothing"
    assert r.release() == 2 * G
    assert sorted(seen) == [(a, G, False), (a + G, G, False)]
    assert r.segment_error() is None


def test_the_expandable_pool_reports_small_and_large_chunks_and_a_late_callback_catches_up():
    r = carve.ExpandableResource.over_host(64 * MIB)
    small = r.allocate(100)
    large = r.allocate(3 * MIB)
    seen = []
    r.set_segment_callback(lambda p, n, mapped: seen.append((p, n, mapped)))
    assert sorted(seen) == sorted([(small & ~(G - 1), G, True), (large, 16 * G, True)] + [
        (large + k * 16 * G, 16 * G, True) for k in range(1, 3)
    ])
    seen.clear()
    r.set_segment_callback(None)
    r.allocate(5 * MIB)
    assert seen == []


def test_an_exception_in_the_callback_is_kept_and_the_resource_goes_on():
    def fails(p, n, mapped):
        raise ValueError(f"no room to register {p:#x}")

    r = carve.ExpandableResource.over_host(16 * MIB, on_segment=fails)
    p = r.allocate(1000)
    e = r.segment_error()
    assert isinstance(e, ValueError) and "no room" in str(e)
    assert r.segment_error() is None, "taken"
    r.deallocate(p, 1000)
    r.release()
    assert isinstance(r.segment_error(), ValueError)
    q = r.allocate(1000)
    r.deallocate(q, 1000)


def test_the_callback_may_allocate_and_threads_see_their_chunks_announced():
    mapped = set()
    lock = threading.Lock()
    r = None

    def follow(p, n, is_mapped):
        with lock:
            if is_mapped:
                assert p not in mapped
                mapped.add(p)
            else:
                mapped.remove(p)

    r = carve.VirtualMemoryResource.over_host(256 * G, on_segment=follow)
    failures = []

    def work(t):
        try:
            for k in range(50):
                n = 1 + (k * 7919 + t * 104729) % (3 * G)
                p = r.allocate(n)
                with lock:
                    first = p - p % G
                    assert all(first + i * G in mapped for i in range((p + n - first + G - 1) // G))
                r.deallocate(p, n)
                if k % 10 == 9:
                    r.release()
        except Exception as e:  # reported below
            failures.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert r.segment_error() is None


@pytest.mark.parametrize(
    "kwargs",
    [{"fabric": "sometimes"}, {"fabric": 1.5}, {"granularity": "huge"}],
)
def test_bad_nccl_options_are_value_errors(kwargs):
    with pytest.raises(ValueError):
        carve.ExpandableResource(0, **kwargs)
    with pytest.raises(ValueError):
        carve.VirtualMemoryResource(0, **kwargs)


def test_other_resources_have_no_segments():
    r = carve.HostResource()
    with pytest.raises(carve.UnsupportedError):
        carve._carve.vm_set_segment_callback(r._r, lambda *a: None)
