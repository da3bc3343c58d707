"""PyTorch allocates through carve.

Recommended: :func:`mem_pool` gives a ``torch.cuda.MemPool`` whose segments come from a carve
resource. PyTorch's caching allocator stays in charge of blocks, so ``memory_stats``,
snapshots, ``torch.compile``, CUDA graphs and the out-of-memory retry keep working, and an
exhausted carve resource surfaces as ``torch.OutOfMemoryError``::

    with carve.torch.pool(carve.PoolResource(carve.CudaResource(0), 1 << 30)):
        loss = model(x).sum()
        loss.backward()

:func:`pool` enters ``torch.cuda.use_mem_pool`` and runs autograd's backward pass on the calling
thread: PyTorch routes only the entering thread's allocations to a ``MemPool``, and backward
runs on autograd's worker threads by default, so its tensors would otherwise land in PyTorch's
default pool, which then reserves segments of its own beside the carve-backed ones.
:func:`mem_pool` gives the pool alone, for ``torch.cuda.use_mem_pool``.

:func:`nccl_mem_pool` gives a ``MemPool`` over carve virtual memory that NCCL can register
(chunks with POSIX-descriptor handles, fabric handles where the device has them, at the
driver's recommended granularity)::

    pool = carve.torch.nccl_mem_pool()
    backend = dist.group.WORLD._get_backend(torch.device("cuda"))
    backend.register_mem_pool(pool)
    with torch.cuda.use_mem_pool(pool):
        x = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(x)

:func:`graph_pool` gives a ``MemPool`` for CUDA graph capture (allocation during capture is
served by a :class:`~carve.GraphSafeResource`, so the graph bakes in carve addresses that stay
valid for every replay)::

    pool = carve.torch.graph_pool(carve.PoolResource(carve.CudaResource(0), 1 << 30))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool.id):
        y = model(static_x)
    g.replay()

Megatron's unified-memory functions run on carve's managed resource, with Megatron's names
and signatures: :func:`create_unified_mempool`, :func:`prefetch_managed_tensor`,
:func:`advise_managed_tensor_preferred_location`, :func:`advise_managed_tensor_accessed_by`,
:func:`prefetch_managed_module_parameters` and
:func:`advise_managed_module_parameters_preferred_location` (device -1 is the CPU).
:func:`managed_range_attributes` reports what the driver records for a tensor's range.

:func:`use` replaces PyTorch's allocator for the whole process
(``torch.cuda.memory.change_current_allocator``): every tensor is allocated and freed by the
device's current carve resource. PyTorch's caching statistics are then empty. It must run
before PyTorch allocates any CUDA memory.

PyTorch's ``CUDAPluggableAllocator`` does not check the pointer its allocation function returns
(a null pointer would become a tensor at address 0). So under :func:`use`, when carve refuses
an allocation, carve's function throws PyTorch's own ``c10::OutOfMemoryError``, found in the
loaded PyTorch libraries, and PyTorch raises ``torch.OutOfMemoryError`` with carve's message.
Nothing is compiled at run time.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch as _torch

from . import _carve, lib_path
from ._resources import (
    ExpandableResource,
    GraphSafeResource,
    Resource,
    VirtualMemoryResource,
    get_current_resource,
    set_current_resource,
)
from ._torch_unified import (
    UnifiedMemoryUnsupportedError,
    advise_managed_module_parameters_preferred_location,
    advise_managed_tensor_accessed_by,
    advise_managed_tensor_preferred_location,
    managed_range_attributes,
    managed_resource,
    prefetch_managed_module_parameters,
    prefetch_managed_tensor,
)

__all__ = [
    "pool",
    "mem_pool",
    "nccl_resource",
    "nccl_mem_pool",
    "graph_pool",
    "use",
    "pluggable_allocator",
    "slot_of",
    "create_unified_mempool",
    "prefetch_managed_tensor",
    "advise_managed_tensor_preferred_location",
    "advise_managed_tensor_accessed_by",
    "prefetch_managed_module_parameters",
    "advise_managed_module_parameters_preferred_location",
    "managed_range_attributes",
    "UnifiedMemoryUnsupportedError",
]

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


def nccl_resource(
    device: Optional[int] = None, *, expandable: bool = True, **opts: object
) -> Union[ExpandableResource, VirtualMemoryResource]:
    """A carve virtual-memory resource on ``device`` (default: PyTorch's current device) whose
    memory NCCL can register: ``exportable=True`` (POSIX descriptors, which NCCL exports to its
    peers), ``fabric="auto"`` (fabric handles where the device can create them, as NCCL picks
    its own handle type) and ``granularity="recommended"``. ``expandable=True`` gives an
    :class:`~carve.ExpandableResource`, else a whole-chunk :class:`~carve.VirtualMemoryResource`.
    Other keyword arguments go to the resource (``maximum_size``, ``on_segment``, ...) and may
    override those three."""
    dev = _torch.cuda.current_device() if device is None else device
    kwargs: Dict[str, object] = {
        "exportable": True,
        "fabric": "auto",
        "granularity": "recommended",
    }
    kwargs.update(opts)
    cls = ExpandableResource if expandable else VirtualMemoryResource
    return cls(dev, **kwargs)  # type: ignore[arg-type]


def nccl_mem_pool(
    device: Optional[int] = None, *, expandable: bool = True, **opts: object
) -> "_torch.cuda.MemPool":
    """A :func:`mem_pool` over :func:`nccl_resource` ``(device, expandable=..., **opts)``: a
    ``torch.cuda.MemPool`` that ``ProcessGroupNCCL.register_mem_pool`` accepts. Register it
    (``backend.register_mem_pool(pool)``, with ``backend`` the group's NCCL backend) once
    tensors are in it; PyTorch then registers the pool's later segments as they appear."""
    return mem_pool(nccl_resource(device, expandable=expandable, **opts))


# (upstream, its GraphSafeResource): one graph-safe resource, and so one slot, per upstream.
_graph_safe: List[Tuple[Resource, GraphSafeResource]] = []


def graph_pool(
    resource: Optional[Resource] = None, device: Optional[int] = None, **kwargs: object
) -> "_torch.cuda.MemPool":
    """A ``torch.cuda.MemPool`` for CUDA graph capture: pass its ``id`` as
    ``torch.cuda.graph(g, pool=p.id)`` and the tensors the capture creates come from carve.

    PyTorch asks the pool for segments on the capturing stream; a :class:`GraphSafeResource`
    serves them from a private pool of that capture, grown from its upstream with the capture
    mode relaxed, so nothing is recorded into the graph and the addresses stay valid for every
    replay. Over an upstream that already holds the memory (a :class:`PoolResource` with an
    ``initial_size``) the capture makes no driver allocation at all.

    ``resource``: a :class:`GraphSafeResource` is used as is; another device resource is
    wrapped in one (the same one on every call); None wraps the current carve resource of
    ``device`` (default: PyTorch's current device). The upstream should allocate synchronously
    (not :class:`AsyncResource`, whose stream-ordered allocation capture would record). Keep
    the pool while its graphs live. Extra keyword arguments go to ``MemPool``."""
    if resource is None:
        dev = _torch.cuda.current_device() if device is None else device
        resource = get_current_resource(dev)
    elif not isinstance(resource, Resource):
        raise TypeError(f"expected a carve resource, got {type(resource).__name__}")
    if not resource.device_accessible:
        raise ValueError(f"graph_pool needs a device resource, not a {resource.kind} resource")
    if not isinstance(resource, GraphSafeResource):
        upstream = resource
        found = [g for u, g in _graph_safe if u._r.same_as(upstream._r)]
        if found:
            resource = found[0]
        else:
            resource = GraphSafeResource(upstream)
            _graph_safe.append((upstream, resource))
    return mem_pool(resource, **kwargs)


def create_unified_mempool() -> "_torch.cuda.MemPool":
    """A ``torch.cuda.MemPool`` whose segments are CUDA managed memory from carve's managed
    resource (Megatron's ``create_unified_mempool``); its tensors take the prefetch and advice
    functions of this module. Raises :class:`UnifiedMemoryUnsupportedError` where managed
    memory is not available."""
    return mem_pool(managed_resource())


@contextmanager
def pool(
    resource: Resource, *, autograd_threads: bool = False, **kwargs: object
) -> Iterator["_torch.cuda.MemPool"]:
    """Allocates every tensor of the block, backward pass included, from a :func:`mem_pool`
    over ``resource``; yields the pool. Extra keyword arguments go to ``MemPool``.

    Inside the block autograd runs backward on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``), since a ``MemPool`` only receives
    the allocations of the thread that entered it. ``autograd_threads=True`` keeps autograd's
    worker threads; their allocations then go to PyTorch's default pool.
    """
    p = mem_pool(resource, **kwargs)
    with _torch.cuda.use_mem_pool(p):
        if autograd_threads:
            yield p
        else:
            with _torch.autograd.set_multithreading_enabled(False):
                yield p


def _checked_alloc_address() -> Optional[int]:
    """The address of carve's allocation function that throws ``c10::OutOfMemoryError`` when
    carve refuses, resolved in the loaded PyTorch (no compiler involved); None, with a warning,
    if this PyTorch build lacks a symbol it needs."""
    lib = os.path.join(os.path.dirname(_torch.__file__), "lib")
    try:
        return int(
            _carve.torch_oom_thrower(
                os.path.join(lib, "libc10.so"), os.path.join(lib, "libc10_cuda.so")
            )
        )
    except OSError as e:
        warnings.warn(
            f"carve.torch.use: {e}. An exhausted carve resource will give PyTorch a null "
            "pointer instead of raising torch.OutOfMemoryError.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def use(resource: Resource, device: Optional[int] = None) -> None:
    """Makes ``resource`` the current carve resource of ``device`` and routes every PyTorch CUDA
    allocation to the current carve resources. The swap happens once per process, before
    PyTorch allocates; later calls only change the resource.

    ``device`` defaults to the device whose CUDA context is current on this thread (device 0
    when none is), asked of the CUDA driver: ``torch.cuda.current_device()`` would initialise
    PyTorch's CUDA state, and with it the allocator that the swap must replace."""
    global _global
    if device is None:
        device = _carve.current_device()
    set_current_resource(device, resource)
    if _global is None:
        fns = _carve.function_addresses()
        checked = _checked_alloc_address()
        if checked is None:
            alloc = _torch.cuda.memory.CUDAPluggableAllocator(
                lib_path(), "carve_torch_alloc", "carve_torch_free"
            )
        else:
            raw = _torch._C._cuda_customAllocator(checked, fns["carve_torch_free"])
            alloc = _torch.cuda.memory._CUDAAllocator(raw)
        _torch.cuda.memory.change_current_allocator(alloc)
        _global = alloc
