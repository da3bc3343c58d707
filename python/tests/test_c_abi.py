"""carve's C ABI, loaded from the installed package's extension module with ctypes: the
symbols include/carve.h declares are exported, and error paths return codes, not crashes."""

import ctypes
import pathlib
import re

import pytest

import carve

HEADER = pathlib.Path(__file__).resolve().parents[2] / "include" / "carve.h"
lib = ctypes.CDLL(carve.lib_path())

lib.carve_last_error.restype = ctypes.c_char_p
lib.carve_error_name.restype = ctypes.c_char_p
lib.carve_allocate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
lib.carve_deallocate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_size_t, ctypes.c_void_p]
lib.carve_resource_destroy.argtypes = [ctypes.c_void_p]
lib.carve_host_resource_create.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
lib.carve_cupy_malloc.restype = ctypes.c_ssize_t
lib.carve_cupy_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_size_t, ctypes.c_int]
lib.carve_cupy_free.argtypes = [ctypes.c_ssize_t, ctypes.c_ssize_t, ctypes.c_int]
lib.carve_torch_alloc_7.restype = ctypes.c_void_p
lib.carve_torch_alloc_7.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.carve_torch_free_7.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.carve_framework_outstanding.restype = ctypes.c_size_t


def last():
    return lib.carve_last_error().decode()


def test_every_header_function_is_exported():
    names = set(re.findall(r"\b(carve_[a-z0-9_]+)\(", HEADER.read_text()))
    names |= {f"carve_torch_{k}_{i}" for k in ("alloc", "free") for i in range(16)}
    assert len(names) > 40
    missing = [n for n in sorted(names) if not hasattr(lib, n)]
    assert not missing, missing


def test_null_and_destroyed_handles():
    p = ctypes.c_void_p()
    assert lib.carve_allocate(None, 64, 256, None, ctypes.byref(p)) == 1
    assert "null carve resource handle" in last()
    h = ctypes.c_void_p()
    assert lib.carve_host_resource_create(ctypes.byref(h)) == 0
    assert lib.carve_resource_destroy(h) == 0
    assert lib.carve_resource_destroy(h) == 1
    assert lib.carve_allocate(h, 64, 256, None, ctypes.byref(p)) == 1
    assert lib.carve_error_name(1) == b"CARVE_ERROR_INVALID_HANDLE"


def test_python_resources_are_c_handles():
    r = carve.StatisticsAdaptor(carve.HostResource())
    p = ctypes.c_void_p()
    assert lib.carve_allocate(r.handle, 0, 256, None, ctypes.byref(p)) == 2
    assert lib.carve_allocate(r.handle, 64, 3, None, ctypes.byref(p)) == 2
    assert lib.carve_allocate(r.handle, 1000, 256, None, ctypes.byref(p)) == 0
    assert r.stats()["current_bytes"] == 1000
    assert lib.carve_deallocate(r.handle, p, 1000, 256, None) == 0
    assert lib.carve_deallocate(r.handle, p, 1000, 256, None) == 6  # double free, refused
    assert r.stats()["current_count"] == 0


def test_cupy_symbols_record_sizes_over_host_memory():
    h = carve.HostResource()
    before = lib.carve_framework_outstanding()
    p = lib.carve_cupy_malloc(h.handle, 1000, 0)
    assert p and p % 256 == 0
    assert h.stats()["allocated_bytes"] == 1000
    assert lib.carve_framework_outstanding() == before + 1
    lib.carve_cupy_free(h.handle, p, 0)
    assert h.stats()["allocation_count"] == 0
    lib.carve_cupy_free(h.handle, p, 0)  # double free: refused, no crash
    assert "not allocated through carve" in last()
    assert lib.carve_cupy_malloc(h.handle, 0, 0) == 0
    assert lib.carve_cupy_malloc(12345, 64, 0) == 0
    assert "not live" in last()


def test_torch_slot_symbols_over_host_memory():
    h = carve.HostResource()
    carve._carve.torch_bind_slot(7, h._r)
    p = lib.carve_torch_alloc_7(4096, 0, None)
    assert p, last()
    assert h.stats()["allocated_bytes"] == 4096
    lib.carve_torch_free_7(p, 4096, 0, None)
    assert h.stats()["allocated_bytes"] == 0
    assert lib.carve_torch_alloc_7(-5, 0, None) is None
    carve._carve.torch_bind_slot(7, None)
    assert lib.carve_torch_alloc_7(64, 0, None) is None
    assert "no resource bound" in last()
    with pytest.raises(carve.InvalidArgumentError):
        carve._carve.torch_bind_slot(99, h._r)


def test_onnxruntime_provider_options_call_carve():
    import carve.onnxruntime

    pool = carve.PoolResource(carve.HostResource())
    opts = carve.onnxruntime.provider_options(pool)
    assert set(opts) == {"gpu_external_alloc", "gpu_external_free", "gpu_external_empty_cache"}
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(int(opts["gpu_external_alloc"]))
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(int(opts["gpu_external_free"]))
    empty = ctypes.CFUNCTYPE(None)(int(opts["gpu_external_empty_cache"]))
    p = alloc(10_000)
    assert p and pool.stats()["bytes_in_use"] >= 10_000
    free(p)
    assert pool.stats()["bytes_in_use"] == 0
    empty()
    assert pool.stats()["pool_size"] == 0
    carve._carve.ort_set_resource(None)


def test_python_resources_release_their_handles():
    lib.carve_live_handles.restype = ctypes.c_size_t
    import gc

    gc.collect()
    before = lib.carve_live_handles()
    stack = carve.StatisticsAdaptor(carve.PoolResource(carve.HostResource()))
    assert lib.carve_live_handles() == before + 3
    assert stack.upstream._r.pool_handle is None
    del stack
    gc.collect()
    assert lib.carve_live_handles() == before
