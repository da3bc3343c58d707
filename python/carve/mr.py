"""RMM's ``rmm.mr`` names for carve's resources, for code written against RMM::

    import carve
    carve.mr.set_current_device_resource(
        carve.mr.PoolMemoryResource(carve.mr.CudaMemoryResource(), initial_pool_size=2**30)
    )

Classes whose RMM constructor matches carve's are the same classes (``CudaMemoryResource`` is
:class:`carve.CudaResource`); the others are thin subclasses that take RMM's keywords. "The
current device" is the device whose CUDA context is current on the calling thread (device 0
when none is), as in RMM.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple, Type, Union

from . import _carve
from ._resources import (
    ArenaResource,
    AsyncResource,
    BinningResource,
    CudaResource,
    FixedSizeResource,
    LimitingAdaptor,
    LoggingAdaptor,
    ManagedResource,
    PinnedResource,
    PoolResource,
    Resource,
    StatisticsAdaptor,
    TrackingAdaptor,
    get_current_resource,
    set_current_resource,
)
from ._sizes import optional_bytes

Size = Union[int, str]

DeviceMemoryResource = Resource
CudaMemoryResource = CudaResource
ManagedMemoryResource = ManagedResource
PinnedHostMemoryResource = PinnedResource
StatisticsResourceAdaptor = StatisticsAdaptor


class PoolMemoryResource(PoolResource):
    """RMM's ``PoolMemoryResource(upstream_mr, initial_pool_size, maximum_pool_size)``; the
    initial size defaults to 0 (the pool grows on demand)."""

    __slots__ = ()

    def __init__(
        self,
        upstream_mr: Resource,
        initial_pool_size: Optional[Size] = None,
        maximum_pool_size: Optional[Size] = None,
    ) -> None:
        super().__init__(
            upstream_mr, optional_bytes(initial_pool_size) or 0, optional_bytes(maximum_pool_size)
        )


class BinningMemoryResource(BinningResource):
    """RMM's ``BinningMemoryResource(upstream_mr, min_size_exponent, max_size_exponent)``: bins of
    ``2**min .. 2**max`` bytes (-1: carve's defaults, 2**8 .. 2**22)."""

    __slots__ = ()

    def __init__(
        self, upstream_mr: Resource, min_size_exponent: int = -1, max_size_exponent: int = -1
    ) -> None:
        lo = 8 if min_size_exponent < 0 else min_size_exponent
        hi = 22 if max_size_exponent < 0 else max_size_exponent
        super().__init__(upstream_mr, lo, hi)


class FixedSizeMemoryResource(FixedSizeResource):
    """RMM's ``FixedSizeMemoryResource(upstream_mr, block_size, blocks_to_preallocate)``."""

    __slots__ = ()

    def __init__(
        self, upstream_mr: Resource, block_size: int = 1 << 20, blocks_to_preallocate: int = 128
    ) -> None:
        super().__init__(upstream_mr, block_size, blocks_to_preallocate)


class ArenaMemoryResource(ArenaResource):
    """RMM's ``ArenaMemoryResource(upstream_mr, arena_size)``: at most ``arena_size`` bytes."""

    __slots__ = ()

    def __init__(self, upstream_mr: Resource, arena_size: Optional[Size] = None) -> None:
        super().__init__(upstream_mr, maximum_size=optional_bytes(arena_size))


class CudaAsyncMemoryResource(AsyncResource):
    """RMM's ``CudaAsyncMemoryResource(initial_pool_size, release_threshold)``: a new CUDA
    driver pool on the current device."""

    __slots__ = ()

    def __init__(
        self,
        initial_pool_size: Optional[Size] = None,
        release_threshold: Optional[Size] = None,
        enable_ipc: bool = False,
    ) -> None:
        if enable_ipc:
            raise NotImplementedError("carve.mr.CudaAsyncMemoryResource: enable_ipc is not offered")
        super().__init__(
            _current_device(),
            optional_bytes(initial_pool_size) or 0,
            optional_bytes(release_threshold),
        )


class LimitingResourceAdaptor(LimitingAdaptor):
    """RMM's ``LimitingResourceAdaptor(upstream_mr, allocation_limit)``."""

    __slots__ = ()

    def __init__(self, upstream_mr: Resource, allocation_limit: Size) -> None:
        super().__init__(upstream_mr, optional_bytes(allocation_limit) or 0)

    def get_allocated_bytes(self) -> int:
        """Bytes allocated through the adaptor and not yet freed."""
        return int(self.stats()["allocated_bytes"])

    def get_allocation_limit(self) -> int:
        """The limit in bytes."""
        return int(self.stats()["limit"])


class TrackingResourceAdaptor(TrackingAdaptor):
    """RMM's ``TrackingResourceAdaptor(upstream_mr, capture_stacks)``."""

    __slots__ = ()

    def __init__(self, upstream_mr: Resource, capture_stacks: bool = False) -> None:
        super().__init__(upstream_mr, capture_stacks)

    def get_allocated_bytes(self) -> int:
        """Bytes allocated through the adaptor and not yet freed."""
        return int(self.stats()["allocated_bytes"])


class LoggingResourceAdaptor(LoggingAdaptor):
    """RMM's ``LoggingResourceAdaptor(upstream_mr, log_file_name)``: RMM's CSV to
    ``name.dev<N>.ext`` for the current device N (default name: ``CARVE_LOG_FILE`` or
    ``RMM_LOG_FILE``)."""

    __slots__ = ("_file_name",)

    def __init__(
        self,
        upstream_mr: Resource,
        log_file_name: Optional[Union[str, "os.PathLike[str]"]] = None,
        auto_flush: bool = False,
    ) -> None:
        name = log_file_name or os.environ.get("CARVE_LOG_FILE") or os.environ.get("RMM_LOG_FILE")
        if not name:
            raise ValueError(
                "LoggingResourceAdaptor needs log_file_name (or CARVE_LOG_FILE / RMM_LOG_FILE)"
            )
        root, ext = os.path.splitext(os.fspath(name))
        self._file_name = f"{root}.dev{_current_device()}{ext}"
        super().__init__(upstream_mr, self._file_name, auto_flush)

    def get_file_name(self) -> str:
        """The path the log is written to."""
        return self._file_name


def _current_device() -> int:
    return _carve.current_device()


def set_current_device_resource(mr: Resource) -> None:
    """Makes ``mr`` the current resource of the current device."""
    set_current_resource(_current_device(), mr)


def get_current_device_resource() -> Resource:
    """The current resource of the current device."""
    return get_current_resource(_current_device())


def set_per_device_resource(device: int, mr: Resource) -> None:
    """Makes ``mr`` the current resource of ``device``."""
    set_current_resource(device, mr)


def get_per_device_resource(device: int) -> Resource:
    """The current resource of ``device``."""
    return get_current_resource(device)


def get_current_device_resource_type() -> Type[Resource]:
    """The class of the current device's resource."""
    return type(get_current_device_resource())


def available_device_memory() -> Tuple[int, int]:
    """``(free, total)`` bytes of the current device."""
    return _carve.mem_info(_current_device())


__all__ = [
    "ArenaMemoryResource",
    "BinningMemoryResource",
    "CudaAsyncMemoryResource",
    "CudaMemoryResource",
    "DeviceMemoryResource",
    "FixedSizeMemoryResource",
    "LimitingResourceAdaptor",
    "LoggingResourceAdaptor",
    "ManagedMemoryResource",
    "PinnedHostMemoryResource",
    "PoolMemoryResource",
    "StatisticsResourceAdaptor",
    "TrackingResourceAdaptor",
    "available_device_memory",
    "get_current_device_resource",
    "get_current_device_resource_type",
    "get_per_device_resource",
    "set_current_device_resource",
    "set_per_device_resource",
]
