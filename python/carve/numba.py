"""Numba External Memory Management (EMM) plugin: Numba allocates device memory from the
current carve resource of each device.

Select it before Numba initialises CUDA, either with the environment variable
``NUMBA_CUDA_MEMORY_MANAGER=carve.numba`` or with ``numba.cuda.set_memory_manager(
carve.numba.CarveNumbaManager)``. Host allocations (``memhostalloc``, ``mempin``) stay with
Numba (``HostOnlyCUDAMemoryManager``).
"""

from __future__ import annotations

import ctypes

from numba import cuda as _cuda
from numba.cuda.cudadrv import driver as _drv

from ._errors import UnsupportedError
from ._resources import get_current_resource
from ._carve import mem_info

try:
    from numba.cuda import HostOnlyCUDAMemoryManager, IpcHandle, MemoryInfo, MemoryPointer
except ImportError:  # older layouts keep them only in the driver module
    HostOnlyCUDAMemoryManager = _drv.HostOnlyCUDAMemoryManager
    IpcHandle = _drv.IpcHandle
    MemoryInfo = _drv.MemoryInfo
    MemoryPointer = _drv.MemoryPointer

__all__ = ["CarveNumbaManager"]

_NV_BINDING = bool(getattr(_drv, "USE_NV_BINDING", True)) and hasattr(_drv, "binding")


def _device_pointer(addr: int):
    if _NV_BINDING:
        return _drv.binding.CUdeviceptr(addr)
    return _drv.drvapi.cu_device_ptr(addr)


def _address(ptr) -> int:
    """An address from a ctypes pointer, a binding's CUdeviceptr, or an int."""
    value = getattr(ptr, "value", ptr)
    return int(value or 0)


class CarveNumbaManager(HostOnlyCUDAMemoryManager):
    """Numba EMM plugin over carve's current resource per device."""

    def initialize(self) -> None:
        """Nothing to set up: resources are chosen per allocation."""
        get_current_resource(self._device_id())

    def _device_id(self) -> int:
        return int(self.context.device.id) if self.context is not None else 0

    def memalloc(self, size: int):
        """``size`` bytes from the device's current carve resource (freed through it)."""
        ctx = self.context
        if size == 0:
            return MemoryPointer(ctx, _device_pointer(0), 0)
        resource = get_current_resource(self._device_id())
        addr = resource.allocate(size)

        def finalizer(resource=resource, addr=addr, size=size) -> None:
            resource.deallocate(addr, size)

        return MemoryPointer(ctx, _device_pointer(addr), size, finalizer=finalizer)

    def get_memory_info(self):
        """Free and total memory of the device (``cuMemGetInfo``)."""
        free, total = mem_info(self._device_id())
        return MemoryInfo(free=free, total=total)

    def get_ipc_handle(self, memory):
        """An IPC handle for ``memory``, offset into the driver allocation that holds it. Works
        for memory from ``cuMemAlloc`` (cuda resources and suballocators over them); other
        memory raises :class:`carve.UnsupportedError`."""
        try:
            mixin = getattr(_drv, "GetIpcHandleMixin", None)
            if mixin is not None:  # Numba's own implementation of exactly this
                return mixin.get_ipc_handle(self, memory)
            start, _end = _drv.device_extents(memory)
            if _NV_BINDING:
                handle = _drv.driver.cuIpcGetMemHandle(start)
            else:
                handle = _drv.drvapi.cu_ipc_mem_handle()
                _drv.driver.cuIpcGetMemHandle(ctypes.byref(handle), start)
        except _drv.CudaAPIError as e:
            raise UnsupportedError(
                f"get_ipc_handle: this resource's memory cannot be exported over IPC ({e})"
            ) from e
        offset = _address(memory.handle) - _address(start)
        source = self.context.device.get_device_identity()
        return IpcHandle(memory, handle, memory.size, source, offset=offset)

    @property
    def interface_version(self) -> int:
        """The EMM interface version this plugin implements."""
        return 1


# Numba looks this name up for NUMBA_CUDA_MEMORY_MANAGER=carve.numba.
_numba_memory_manager = CarveNumbaManager
