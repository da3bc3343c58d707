"""Hostile input from Python and through the C ABI: forged handles, resources destroyed while
their blocks are out, and counts that would exhaust memory. Each is a typed error, never a
crash or an abort. Cases that could abort run in a child process."""

import ctypes
import gc
import random
import subprocess
import sys
import textwrap

import pytest

import carve

lib = ctypes.CDLL(carve.lib_path())
lib.carve_last_error.restype = ctypes.c_char_p
lib.carve_allocate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.carve_deallocate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.c_void_p]
lib.carve_resource_destroy.argtypes = [ctypes.c_void_p]
lib.carve_resource_release.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
lib.carve_torch_bind_slot.argtypes = [ctypes.c_int, ctypes.c_void_p]
lib.carve_ort_set_resource.argtypes = [ctypes.c_void_p]
lib.carve_host_resource_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
lib.carve_statistics_adaptor_create.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.carve_cupy_malloc.restype = ctypes.c_ssize_t
lib.carve_cupy_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_size_t, ctypes.c_int]
lib.carve_cupy_free.argtypes = [ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_int]
lib.carve_framework_outstanding.restype = ctypes.c_size_t

INVALID_HANDLE = 1


def forged_handles(n=200, seed=32):
    rng = random.Random(seed)
    live = {r.handle for r in (carve.HostResource(),)}  # one live handle, kept out of the list
    values = [1, 2, 0xFFFF_FFFF, 2**63, 2**64 - 1]
    values += [rng.getrandbits(64) for _ in range(n)]
    values += [rng.getrandbits(16) for _ in range(n // 4)]
    return [v for v in values if v and v not in live]


def test_forged_handles_are_invalid_handle_errors_in_every_c_function():
    out = ctypes.c_void_p()
    size = ctypes.c_size_t()
    for h in forged_handles():
        hv = ctypes.c_void_p(h)
        assert lib.carve_allocate(hv, 64, 256, None, ctypes.byref(out)) == INVALID_HANDLE, h
        assert lib.carve_deallocate(hv, ctypes.c_void_p(4096), 64, 256, None) == INVALID_HANDLE
        assert lib.carve_resource_release(hv, ctypes.byref(size)) == INVALID_HANDLE
        assert lib.carve_statistics_adaptor_create(hv, ctypes.byref(out)) == INVALID_HANDLE
        assert lib.carve_torch_bind_slot(3, hv) == INVALID_HANDLE
        assert lib.carve_ort_set_resource(hv) == INVALID_HANDLE
        assert lib.carve_resource_destroy(hv) == INVALID_HANDLE
        assert lib.carve_cupy_malloc(h & (2**63 - 1) or 1, 64, 0) == 0
        assert b"not live" in lib.carve_last_error() or b"handle" in lib.carve_last_error()


def test_forged_pointers_are_refused_by_resources_that_track_blocks():
    rng = random.Random(7)
    for r in (carve.HostResource(), carve.TrackingAdaptor(carve.HostResource()),
              carve.PoolResource(carve.HostResource(), 1 << 16)):
        for _ in range(50):
            with pytest.raises(carve.BadPointerError):
                r.deallocate(rng.getrandbits(48) << 8 or 256, 64)
    before = lib.carve_framework_outstanding()
    for _ in range(50):
        lib.carve_cupy_free(0, rng.getrandbits(48) << 8, 0)  # refused, no crash
    assert lib.carve_framework_outstanding() == before


def test_a_destroyed_c_handle_frees_its_framework_blocks_safely():
    h = ctypes.c_void_p()
    assert lib.carve_host_resource_create(ctypes.byref(h)) == 0
    before = lib.carve_framework_outstanding()
    p = lib.carve_cupy_malloc(h.value, 4096, 0)
    assert p
    assert lib.carve_resource_destroy(h) == 0
    # The block still frees through the resource that made it.
    lib.carve_cupy_free(h.value, p, 0)
    assert lib.carve_framework_outstanding() == before
    # But the handle itself is gone.
    out = ctypes.c_void_p()
    assert lib.carve_allocate(h, 64, 256, None, ctypes.byref(out)) == INVALID_HANDLE


def test_a_destroyed_c_handle_refuses_frees_of_blocks_it_made():
    h = ctypes.c_void_p()
    assert lib.carve_host_resource_create(ctypes.byref(h)) == 0
    p = ctypes.c_void_p()
    assert lib.carve_allocate(h, 4096, 256, None, ctypes.byref(p)) == 0
    assert lib.carve_resource_destroy(h) == 0
    assert lib.carve_deallocate(h, p, 4096, 256, None) == INVALID_HANDLE


def test_python_resources_dropped_while_buffers_are_out():
    stats = carve.StatisticsAdaptor(carve.PoolResource(carve.HostResource(), 1 << 16))
    inner = stats._r
    bufs = [carve.DeviceBuffer(1000, stats) for _ in range(8)]
    views = [b.__dlpack__() for b in bufs[:4]]
    handle = stats.handle
    del stats
    gc.collect()
    # The buffers keep their resource; its C handle lives while the Python object does.
    assert inner.stats()["current_count"] == 8
    del bufs
    gc.collect()
    assert inner.stats()["current_count"] == 4
    del views
    gc.collect()
    assert inner.stats()["current_count"] == 0
    assert carve.take_deferred_error() is None
    del inner
    gc.collect()
    out = ctypes.c_void_p()
    assert lib.carve_allocate(ctypes.c_void_p(handle), 64, 256, None, ctypes.byref(out)) == 1


def test_release_while_blocks_are_out_keeps_them_valid():
    pool = carve.PoolResource(carve.HostResource(), 1 << 20)
    buf = carve.DeviceBuffer(1 << 19, pool)
    import numpy as np

    a = np.from_dlpack(buf)
    a[:] = 5
    pool.release()
    assert int(a.sum()) == 5 << 19
    del a, buf
    gc.collect()
    assert pool.stats()["bytes_in_use"] == 0


HUGE = [
    "carve.ArenaResource(carve.HostResource(), arenas=2**64 - 1)",
    "carve.ArenaResource(carve.HostResource(), arenas=2**40)",
    "carve.ArenaResource(carve.HostResource(), superblock_size=2**64 - 1)",
    "carve.FixedSizeResource(carve.HostResource(), 16, blocks_per_refill=2**32 - 1)",
    "carve.FixedSizeResource(carve.HostResource(), 2**63, 1)",
    "carve.BinningResource(carve.HostResource(), 0, 64)",
    "carve.PoolResource(carve.HostResource(), 2**63)",
    "carve.PoolResource(carve.HostResource(), 0, 2**64 - 1).allocate(2**63)",
    "carve.DeviceBuffer(2**64 - 1, carve.HostResource())",
    "carve.HostResource().allocate(2**62, 2**62)",
    "carve.HostResource().allocate(64, 3)",
    "carve._carve.torch_bind_slot(2**64 - 1, None)",
]


@pytest.mark.parametrize("expr", HUGE)
def test_huge_counts_and_sizes_are_typed_errors(expr):
    code = textwrap.dedent(
        f"""
        import carve
        try:
            {expr}
        except carve.CarveError as e:
            print("TYPED", type(e).__name__, e)
        except BaseException as e:
            print("UNTYPED", type(e).__module__, type(e).__name__, e)
        else:
            print("ACCEPTED")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"the process died (rc {proc.returncode}):\n{out[-2000:]}"
    assert proc.stdout.startswith("TYPED"), out[-2000:]
