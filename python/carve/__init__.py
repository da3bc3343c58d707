"""carve: composable, stream-ordered CUDA memory resources (the role of RAPIDS RMM), with
allocators for PyTorch (:mod:`carve.torch`), CuPy (:mod:`carve.cupy`) and Numba
(:mod:`carve.numba`), a Dask worker plugin (:mod:`carve.dask`), and device heaps that kernels
allocate from (:class:`DeviceHeap`).

>>> import carve
>>> pool = carve.PoolResource(carve.CudaResource(0), initial_size=1 << 30)
>>> carve.set_current_resource(0, pool)
>>> buf = carve.DeviceBuffer(1 << 20)          # from the current resource
>>> import cupy; a = cupy.asarray(buf)           # no copy (__cuda_array_interface__)
"""

from __future__ import annotations

import os as _os

from . import _carve
from ._carve import (
    DeviceBuffer,
    DeviceHeap,
    ImportedChunk,
    deferred_error_count,
    device_count,
    is_available,
    mem_info,
    ptx_path,
    take_deferred_error,
)
from ._errors import (
    BadPointerError,
    CarveError,
    CarveIOError,
    DriverError,
    InvalidArgumentError,
    InvalidHandleError,
    NoDeviceError,
    OutOfMemoryError,
    UnsupportedError,
)
from ._host import (
    get_device_pointer,
    host_alloc_flags,
    mem_get_info,
    pagelocked_empty,
    pagelocked_empty_like,
    pagelocked_zeros,
    pagelocked_zeros_like,
)
from ._resources import (
    AlignedAdaptor,
    ArenaResource,
    AsyncResource,
    BinningResource,
    CudaResource,
    ExpandableResource,
    FailureCallbackAdaptor,
    FixedSizeResource,
    GraphSafeResource,
    HostResource,
    LimitingAdaptor,
    LoggingAdaptor,
    ManagedResource,
    PinnedResource,
    PoolResource,
    PrefetchAdaptor,
    Resource,
    StatisticsAdaptor,
    TrackingAdaptor,
    VirtualMemoryResource,
    get_current_resource,
    set_current_resource,
)
from ._reinit import (
    register_reinitialize_hook,
    reinitialize,
    unregister_reinitialize_hook,
)
from . import mr, statistics  # noqa: E402  (RMM's `rmm.mr`, `rmm.statistics`)

__version__ = "0.1.0"


def lib_path() -> str:
    """Path of the shared library that exports carve's C ABI (``include/carve.h``): this
    package's extension module. Frameworks load their allocator symbols from it."""
    return _os.path.abspath(_carve.__file__)


__all__ = [
    "AlignedAdaptor",
    "ArenaResource",
    "AsyncResource",
    "BadPointerError",
    "BinningResource",
    "CarveError",
    "CarveIOError",
    "CudaResource",
    "DeviceBuffer",
    "DeviceHeap",
    "DriverError",
    "ExpandableResource",
    "FailureCallbackAdaptor",
    "FixedSizeResource",
    "GraphSafeResource",
    "HostResource",
    "ImportedChunk",
    "InvalidArgumentError",
    "InvalidHandleError",
    "LimitingAdaptor",
    "LoggingAdaptor",
    "ManagedResource",
    "NoDeviceError",
    "OutOfMemoryError",
    "PinnedResource",
    "PoolResource",
    "PrefetchAdaptor",
    "Resource",
    "StatisticsAdaptor",
    "TrackingAdaptor",
    "UnsupportedError",
    "VirtualMemoryResource",
    "deferred_error_count",
    "device_count",
    "get_current_resource",
    "get_device_pointer",
    "host_alloc_flags",
    "is_available",
    "lib_path",
    "mem_get_info",
    "mem_info",
    "pagelocked_empty",
    "pagelocked_empty_like",
    "pagelocked_zeros",
    "pagelocked_zeros_like",
    "mr",
    "ptx_path",
    "register_reinitialize_hook",
    "reinitialize",
    "set_current_resource",
    "statistics",
    "take_deferred_error",
    "unregister_reinitialize_hook",
]
