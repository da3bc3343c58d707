"""PyTorch allocates through carve.

Recommended: :func:`mem_pool` gives a ``torch.cuda.MemPool`` whose segments come from a carve
resource. PyTorch's caching allocator stays in charge of blocks, so ``memory_stats``,
snapshots, ``torch.compile``, CUDA graphs and the out-of-memory retry keep working, and an
exhausted carve resource surfaces as ``torch.OutOfMemoryError``::

    pool = carve.torch.mem_pool(carve.PoolResource(carve.CudaResource(0), 1 << 30))
    with torch.cuda.use_mem_pool(pool):
        y = model(x)

:func:`use` replaces PyTorch's allocator for the whole process
(``torch.cuda.memory.change_current_allocator``): every tensor is allocated and freed by the
device's current carve resource. PyTorch's caching statistics are then empty. It must run
before PyTorch allocates any CUDA memory.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch as _torch

from . import _carve, lib_path
from ._resources import Resource, set_current_resource

__all__ = ["mem_pool", "use", "pluggable_allocator", "slot_of"]

# slot -> (resource, CUDAPluggableAllocator); kept alive for the life of the process because
# PyTorch may call a pool's free function until it exits.
_slots: Dict[int, Tuple[Resource, object]] = {}
_global: Optional[object] = None


def slot_of(resource: Resource) -> int:
    """The PyTorch slot (``carve_torch_alloc_<slot>``) bound to ``resource``, binding a free
    one on first use. There are ``carve._carve.TORCH_SLOTS`` slots."""
    for slot, (r, _) in _slots.items():
        if r is resource:
            return slot
    for slot in range(_carve.TORCH_SLOTS):
        if slot not in _slots:
            _carve.torch_bind_slot(slot, resource._r)
            alloc = _torch.cuda.memory.CUDAPluggableAllocator(
                lib_path(), f"carve_torch_alloc_{slot}", f"carve_torch_free_{slot}"
            )
            _slots[slot] = (resource, alloc)
            return slot
    raise RuntimeError(
        f"carve.torch: all {_carve.TORCH_SLOTS} PyTorch slots are bound; reuse a resource"
    )


def pluggable_allocator(resource: Resource) -> "_torch.cuda.memory.CUDAPluggableAllocator":
    """A ``CUDAPluggableAllocator`` that allocates from ``resource``."""
    if not isinstance(resource, Resource):
        raise TypeError(f"expected a carve resource, got {type(resource).__name__}")
    return _slots[slot_of(resource)][1]  # type: ignore[return-value]


def mem_pool(resource: Resource, **kwargs: object) -> "_torch.cuda.MemPool":
    """A ``torch.cuda.MemPool`` whose segments come from ``resource``. Extra keyword arguments
    go to ``MemPool`` (e.g. ``use_on_oom``). Use it with ``torch.cuda.use_mem_pool(pool)``."""
    alloc = pluggable_allocator(resource)
    return _torch.cuda.MemPool(alloc.allocator(), **kwargs)  # type: ignore[attr-defined]


def use(resource: Resource, device: Optional[int] = None) -> None:
    """Makes ``resource`` the current carve resource of ``device`` (default: the current torch
    device) and routes every PyTorch CUDA allocation to the current carve resources. The swap
    happens once per process, before PyTorch allocates; later calls only change the resource."""
    global _global
    if device is None:
        device = _torch.cuda.current_device()
    set_current_resource(device, resource)
    if _global is None:
        alloc = _torch.cuda.memory.CUDAPluggableAllocator(
            lib_path(), "carve_torch_alloc", "carve_torch_free"
        )
        _torch.cuda.memory.change_current_allocator(alloc)
        _global = alloc
