"""CuPy allocates through carve.

    carve.cupy.set_allocator(carve.PoolResource(carve.CudaResource(0), 1 << 30))
    a = cupy.zeros(1 << 20)          # from the pool

CuPy's ``CFunctionAllocator`` calls carve's C functions directly. It does not check for a
null pointer, so the allocator installed here raises ``cupy.cuda.memory.OutOfMemoryError``
itself (chained to carve's error, which says why). Blocks are allocated and freed in the order
of the legacy default stream; arrays used on other streams must be synchronised with it before
they are freed, as with any stream-unaware allocator.
"""

from __future__ import annotations

from typing import Callable, Optional

import cupy as _cupy
from cupy.cuda import memory as _memory

from . import _carve
from ._errors import OutOfMemoryError as _CarveOOM
from ._resources import Resource

__all__ = ["allocator", "set_allocator"]


def allocator(resource: Optional[Resource] = None) -> Callable[[int], "_memory.MemoryPointer"]:
    """A CuPy allocator (``size -> MemoryPointer``) over ``resource`` (None: the current carve
    resource of the device CuPy allocates on)."""
    if resource is not None and not isinstance(resource, Resource):
        raise TypeError(f"expected a carve resource, got {type(resource).__name__}")
    fns = _carve.function_addresses()
    param = 0 if resource is None else resource.handle
    cfa = _memory.CFunctionAllocator(
        param, fns["carve_cupy_malloc"], fns["carve_cupy_free"], resource
    )
    raw = cfa.malloc
    oom = _memory.OutOfMemoryError

    def malloc(size: int) -> "_memory.MemoryPointer":
        mem = raw(size)
        if mem.ptr == 0 and size:
            cause = _CarveOOM(_carve.last_error() or f"{size} bytes")
            raise oom(size, 0) from cause
        return mem

    malloc.carve_resource = resource  # type: ignore[attr-defined]
    malloc.cfunction_allocator = cfa  # type: ignore[attr-defined]
    return malloc


def set_allocator(resource: Optional[Resource] = None) -> None:
    """Makes CuPy allocate from ``resource`` (None: the current carve resource per device)."""
    _cupy.cuda.set_allocator(allocator(resource))
