"""Megatron's unified-memory functions (``megatron.core.inference.unified_memory``) on carve's
managed resource, with Megatron's signatures and semantics; re-exported by ``carve.torch``,
which also gives ``create_unified_mempool``.

Device ``-1`` is the CPU (``cudaCpuDeviceId``). Prefetch moves pages ahead of use and never
changes a tensor's address, so it is safe with recorded CUDA graphs. Nothing is compiled.
"""

from __future__ import annotations

import threading
from typing import Iterator, Optional, Tuple

import torch as _torch

from . import _carve
from ._errors import CarveError
from ._resources import ManagedResource, Resource

__all__ = [
    "UnifiedMemoryUnsupportedError",
    "prefetch_managed_tensor",
    "advise_managed_tensor_preferred_location",
    "advise_managed_tensor_accessed_by",
    "prefetch_managed_module_parameters",
    "advise_managed_module_parameters_preferred_location",
    "managed_range_attributes",
]


class UnifiedMemoryUnsupportedError(Exception):
    """Unified memory is not supported on this system."""


# One managed resource for the process, like Megatron's one compiled allocator: PyTorch may free
# into a pool until the process exits, so it is never dropped.
_managed: Optional[Resource] = None
_lock = threading.Lock()


def managed_resource() -> Resource:
    """The process's managed resource (created on first use, on the current device); raises
    :class:`UnifiedMemoryUnsupportedError` where managed memory is not available."""
    global _managed
    with _lock:
        if _managed is None:
            try:
                _managed = ManagedResource(_carve.current_device())
            except CarveError as e:
                raise UnifiedMemoryUnsupportedError(str(e)) from e
        return _managed


def _span(tensor: "_torch.Tensor") -> Tuple[int, int]:
    """``(address, bytes)`` of the memory a tensor's elements occupy (views included)."""
    if tensor.numel() == 0:
        return tensor.data_ptr(), 0
    if tensor.is_contiguous():
        return tensor.data_ptr(), tensor.numel() * tensor.element_size()
    lo = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if s < 0)
    hi = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()) if s > 0)
    size = tensor.element_size()
    return tensor.data_ptr() + lo * size, (hi - lo + 1) * size


def _check(tensor: object) -> "_torch.Tensor":
    if not isinstance(tensor, _torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_cuda:
        raise ValueError(f"expected a CUDA tensor, got one on {tensor.device}")
    return tensor


def _device(device: int) -> int:
    if not isinstance(device, int) or isinstance(device, bool) or device < -1:
        raise ValueError(f"device {device!r}: expected a device ordinal or -1 for the CPU")
    return device


def prefetch_managed_tensor(tensor, *, device: int, stream=None) -> None:
    """Migrates the pages of a tensor from a unified mempool to ``device`` (-1: the CPU),
    asynchronously on ``stream`` (default: the current stream of the tensor's device;
    ``cudaMemPrefetchAsync``). The address does not change. Empty tensors and ``None`` are
    ignored; memory that is not managed raises ``carve.BadPointerError``."""
    device = _device(device)
    if tensor is None:
        return
    ptr, nbytes = _span(_check(tensor))
    if nbytes == 0:
        return
    if stream is None:
        stream = _torch.cuda.current_stream(tensor.device)
    _carve.managed_prefetch(ptr, nbytes, device, tensor.device.index, stream)


def advise_managed_tensor_preferred_location(tensor, *, device: int) -> None:
    """Sets where the tensor's pages should preferably live (``cudaMemAdviseSetPreferredLocation``;
    -1: the CPU). A hint: it migrates nothing by itself."""
    device = _device(device)
    if tensor is None:
        return
    ptr, nbytes = _span(_check(tensor))
    if nbytes:
        _carve.managed_advise(ptr, nbytes, "preferred_location", device)


def advise_managed_tensor_accessed_by(tensor, *, device: int) -> None:
    """Keeps the tensor's pages mapped in ``device``'s page tables wherever they live
    (``cudaMemAdviseSetAccessedBy``), so its first touches do not fault. ``device`` must be a
    GPU."""
    if _device(device) < 0:
        raise ValueError("advise_managed_tensor_accessed_by: device must be a GPU, not -1")
    if tensor is None:
        return
    ptr, nbytes = _span(_check(tensor))
    if nbytes:
        _carve.managed_advise(ptr, nbytes, "accessed_by", device)


def _managed_tensors(module, include_buffers: bool) -> Iterator["_torch.Tensor"]:
    """The module's distinct CUDA parameters (and buffers) that lie in managed memory."""
    seen = set()
    tensors = list(module.parameters())
    if include_buffers:
        tensors += list(module.buffers())
    for t in tensors:
        if t is None or not t.is_cuda:
            continue
        ptr, nbytes = _span(t)
        if nbytes == 0 or (ptr, nbytes) in seen:
            continue
        seen.add((ptr, nbytes))
        if _carve.managed_is_managed(ptr, nbytes):
            yield t


def prefetch_managed_module_parameters(module, *, device: int, include_buffers: bool = False) -> int:
    """Prefetches every managed parameter of ``module`` (and its buffers with
    ``include_buffers``) to ``device`` (-1: the CPU) on the current stream; returns the bytes
    for which a prefetch was queued. Tensors outside managed memory are skipped."""
    device = _device(device)
    total = 0
    for t in _managed_tensors(module, include_buffers):
        prefetch_managed_tensor(t, device=device)
        total += _span(t)[1]
    return total


def advise_managed_module_parameters_preferred_location(
    module, *, device: int, include_buffers: bool = False
) -> None:
    """Sets the preferred location of every managed parameter of ``module`` (and its buffers
    with ``include_buffers``) to ``device`` (-1: the CPU). Tensors outside managed memory are
    skipped."""
    device = _device(device)
    for t in _managed_tensors(module, include_buffers):
        advise_managed_tensor_preferred_location(t, device=device)


def managed_range_attributes(tensor) -> dict:
    """What the driver reports for the tensor's memory (``cuMemRangeGetAttribute``):
    ``last_prefetch_location`` and ``preferred_location`` (a device, -1 for the CPU, None for
    none), ``accessed_by`` (a sorted list of devices) and ``read_mostly``. Prefetches still
    queued may not show yet: synchronise their stream first."""
    ptr, nbytes = _span(_check(tensor))
    if nbytes == 0:
        raise ValueError("managed_range_attributes: the tensor is empty")
    return _carve.managed_range_attributes(ptr, nbytes)
