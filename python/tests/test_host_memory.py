"""PyCUDA's page-locked host memory names, and what they do without a GPU."""

import numpy as np
import pytest

import carve


def test_host_alloc_flags_have_pycuda_and_driver_values():
    f = carve.host_alloc_flags
    assert (int(f.PORTABLE), int(f.DEVICEMAP), int(f.WRITECOMBINED)) == (1, 2, 4)
    assert int(f.PORTABLE | f.DEVICEMAP | f.WRITECOMBINED) == 7


def test_unknown_flags_bad_shapes_and_object_dtypes_are_refused():
    with pytest.raises(carve.InvalidArgumentError, match="host_alloc_flags"):
        carve.pagelocked_empty(4, np.float32, mem_flags=8)
    with pytest.raises(ValueError, match="negative"):
        carve.pagelocked_empty((2, -1), np.float32)
    with pytest.raises(TypeError, match="objects"):
        carve.pagelocked_zeros(4, object)
    with pytest.raises(ValueError, match="order"):
        carve.pagelocked_zeros(4, np.float32, order="K")


def test_device_pointer_of_memory_carve_did_not_pin_is_a_type_error():
    with pytest.raises(TypeError, match="page-locked"):
        carve.get_device_pointer(np.zeros(4))


def test_without_a_driver_pinning_and_mem_get_info_raise_no_device():
    if carve.is_available():
        pytest.skip("a CUDA device is present (tests/gpu/test_host_memory.py covers it)")
    with pytest.raises(carve.NoDeviceError):
        carve.pagelocked_empty((2, 3), np.float32)
    with pytest.raises(carve.NoDeviceError):
        carve.mem_get_info()
    with pytest.raises(carve.NoDeviceError):
        carve.mem_get_info(0)
