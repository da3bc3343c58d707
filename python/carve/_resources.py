"""Resource classes. Each wraps a :class:`carve._carve.Resource` (in ``_r``) and composes as in
Rust: an adaptor or suballocator takes its upstream as its first argument and keeps it alive."""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

from . import _carve, _errors
from ._counts import Statistics

Number = Union[int, float]


class Resource:
    """A carve memory resource. Build one of the subclasses; don't instantiate this directly."""

    __slots__ = ("_r", "_upstream")

    def __init__(self, raw: "_carve.Resource", upstream: Optional["Resource"] = None) -> None:
        self._r = raw
        self._upstream = upstream

    @classmethod
    def _wrap(cls, raw: "_carve.Resource") -> "Resource":
        obj = cls.__new__(cls)
        Resource.__init__(obj, raw)
        return obj

    @property
    def kind(self) -> str:
        """"cuda", "pool", "statistics", ... ("current" for a resource set outside Python)."""
        return self._r.kind

    @property
    def handle(self) -> int:
        """This resource's handle in carve's C ABI (``include/carve.h``)."""
        return self._r.handle

    @property
    def upstream(self) -> Optional["Resource"]:
        """The resource this one allocates from (None for plain resources)."""
        return self._upstream

    @property
    def device_accessible(self) -> bool:
        """Kernels may dereference this resource's pointers."""
        return self._r.device_accessible

    @property
    def host_accessible(self) -> bool:
        """Host code may dereference this resource's pointers."""
        return self._r.host_accessible

    def allocate(self, nbytes: int, alignment: int = 256, stream: Any = 0) -> int:
        """Allocates ``nbytes`` aligned to ``alignment`` on ``stream`` (a CUstream as an int, or
        a stream object); returns the address. Prefer :class:`carve.DeviceBuffer`, which frees
        itself."""
        return self._r.allocate(nbytes, alignment, stream)

    def deallocate(self, ptr: int, nbytes: int, alignment: int = 256, stream: Any = 0) -> None:
        """Frees a block from :meth:`allocate` with the same size and alignment."""
        self._r.deallocate(ptr, nbytes, alignment, stream)

    def stats(self) -> Dict[str, Number]:
        """The resource's statistics (empty for resources that keep none)."""
        return self._r.stats()

    def release(self) -> int:
        """Returns unused memory upstream (pool, arena, driver pool); the bytes released."""
        return self._r.release()

    def __repr__(self) -> str:
        return f"<carve.{type(self).__name__} {self.kind} {self.handle:#x}>"


class CudaResource(Resource):
    """``cuMemAlloc`` / ``cuMemFree`` on one device."""

    __slots__ = ()

    def __init__(self, device: int = 0) -> None:
        super().__init__(_carve.make_cuda(device))


class ManagedResource(Resource):
    """Managed (unified) memory, ``cuMemAllocManaged``."""

    __slots__ = ()

    def __init__(self, device: int = 0) -> None:
        super().__init__(_carve.make_managed(device))


class PinnedResource(Resource):
    """Pinned (page-locked) host memory, ``cuMemHostAlloc``."""

    __slots__ = ()

    def __init__(
        self,
        device: int = 0,
        *,
        portable: bool = False,
        device_mapped: bool = False,
        write_combined: bool = False,
    ) -> None:
        super().__init__(_carve.make_pinned(device, portable, device_mapped, write_combined))


class AsyncResource(Resource):
    """A new CUDA driver memory pool (``cuMemAllocAsync``), as RMM's cuda_async resource."""

    __slots__ = ()

    @property
    def pool_handle(self) -> int:
        """The driver pool (``CUmemoryPool`` as an int), e.g. for CuPy's
        ``cupy.cuda.MemoryAsyncPool``, which takes one handle per visible device."""
        return self._r.pool_handle

    def __init__(
        self,
        device: int = 0,
        initial_size: int = 0,
        release_threshold: Optional[int] = None,
        hard_limit: Optional[int] = None,
    ) -> None:
        super().__init__(_carve.make_async(device, initial_size, release_threshold, hard_limit))


class HostResource(Resource):
    """Pageable host memory. Needs no GPU; refuses foreign pointers and double frees."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(_carve.make_host())


class PoolResource(Resource):
    """A coalescing, stream-ordered pool over ``upstream`` (RMM's pool role), with CuPy's pool
    methods: :meth:`used_bytes`, :meth:`free_bytes`, :meth:`total_bytes`,
    :meth:`free_all_blocks`, :meth:`set_limit` and :meth:`get_limit`.

    ``maximum_size`` is fixed at construction; :meth:`set_limit` is a second bound, on what the
    pool takes from ``upstream``, that may change at any time."""

    __slots__ = ("_limit",)

    def __init__(
        self, upstream: Resource, initial_size: int = 0, maximum_size: Optional[int] = None
    ) -> None:
        raw, self._limit = _carve.make_limited_pool(_as_raw(upstream), initial_size, maximum_size)
        super().__init__(raw, upstream)

    def _counters(self) -> Dict[str, Any]:
        stats = _carve.memory_stats(self._r)
        assert stats is not None, "a pool keeps counters"
        return stats

    def used_bytes(self) -> int:
        """Bytes handed out and not yet freed (CuPy's ``used_bytes()``)."""
        return int(self._counters()["bytes_in_use"])

    def total_bytes(self) -> int:
        """Bytes the pool holds from its upstream, in use or free (CuPy's ``total_bytes()``)."""
        return int(self._counters()["bytes_reserved"])

    def free_bytes(self) -> int:
        """Bytes the pool holds and does not hand out (CuPy's ``free_bytes()``)."""
        c = self._counters()
        return int(c["bytes_reserved"]) - int(c["bytes_in_use"])

    def free_all_blocks(self, stream: Any = None) -> None:
        """Returns every chunk with no live block to the upstream (CuPy's
        ``free_all_blocks()``). carve first waits for all work on the device, so the chunks
        freed on every stream, ``stream``'s included, go back; ``stream`` is accepted for
        CuPy's signature."""
        self._r.release()

    def set_limit(self, size: Optional[Number] = None, fraction: Optional[float] = None) -> None:
        """Bounds the bytes the pool takes from its upstream (its :meth:`total_bytes`), as
        CuPy's ``set_limit``: ``size`` in bytes, or ``fraction`` (0 to 1) of the device's total
        memory; neither, or 0, removes the limit. Memory already held stays; an allocation that
        would grow the pool past the limit raises :class:`carve.OutOfMemoryError`."""
        if size is None:
            if fraction is None:
                size = 0
            else:
                if not 0 <= fraction <= 1:
                    raise ValueError(f"memory limit fraction out of range: {fraction}")
                device = self._limit.device
                if device is None:
                    raise _errors.InvalidArgumentError(
                        "set_limit(fraction=...) needs a pool of device memory; "
                        "this pool holds host memory"
                    )
                size = fraction * _carve.mem_info(device)[1]
        elif fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if size < 0:
            raise ValueError(f"memory limit size out of range: {size}")
        size = int(size)
        self._limit.set_limit(size if size > 0 else None)

    def get_limit(self) -> int:
        """The limit from :meth:`set_limit` in bytes; 0 when there is none (as CuPy)."""
        limit = self._limit.limit
        return 0 if limit is None else int(limit)


class BinningResource(Resource):
    """Power-of-two bins ``2**min_exp .. 2**max_exp`` over ``upstream``."""

    __slots__ = ()

    def __init__(self, upstream: Resource, min_exp: int = 8, max_exp: int = 22) -> None:
        super().__init__(_carve.make_binning(_as_raw(upstream), min_exp, max_exp), upstream)


class ArenaResource(Resource):
    """Per-thread arenas over ``upstream``; zeros pick the defaults."""

    __slots__ = ()

    def __init__(
        self,
        upstream: Resource,
        superblock_size: int = 0,
        arenas: int = 0,
        maximum_size: Optional[int] = None,
    ) -> None:
        raw = _carve.make_arena(_as_raw(upstream), superblock_size, arenas, maximum_size)
        super().__init__(raw, upstream)


class FixedSizeResource(Resource):
    """Blocks of ``block_size`` bytes over ``upstream``."""

    __slots__ = ()

    def __init__(self, upstream: Resource, block_size: int, blocks_per_refill: int = 0) -> None:
        raw = _carve.make_fixed_size(_as_raw(upstream), block_size, blocks_per_refill)
        super().__init__(raw, upstream)


class LimitingAdaptor(Resource):
    """Refuses requests once ``limit`` bytes are live (:class:`carve.OutOfMemoryError`)."""

    __slots__ = ()

    def __init__(self, upstream: Resource, limit: int) -> None:
        super().__init__(_carve.make_limiting(_as_raw(upstream), limit), upstream)


class StatisticsAdaptor(Resource):
    """Counts current, peak and total bytes and allocations (see :meth:`stats`), in nested
    scopes (:meth:`push_counters`, :meth:`pop_counters`) as RMM's statistics adaptor."""

    __slots__ = ("_scopes",)

    def __init__(self, upstream: Resource) -> None:
        raw, self._scopes = _carve.make_statistics_scoped(_as_raw(upstream))
        super().__init__(raw, upstream)

    @property
    def allocation_counts(self) -> Statistics:
        """The counters of the innermost scope."""
        return Statistics._of(self._scopes.counters())

    def push_counters(self) -> Statistics:
        """Opens a scope with zeroed counters; returns the counters of the scope below it."""
        return Statistics._of(self._scopes.push())

    def pop_counters(self) -> Statistics:
        """Closes the innermost scope and returns its counters; the scope below absorbs them
        (its peak covers the inner one). :class:`carve.InvalidArgumentError` without a push."""
        return Statistics._of(self._scopes.pop())


class TrackingAdaptor(Resource):
    """Tracks outstanding blocks; refuses foreign pointers and double frees."""

    __slots__ = ()

    def __init__(self, upstream: Resource, capture_backtraces: bool = False) -> None:
        super().__init__(_carve.make_tracking(_as_raw(upstream), capture_backtraces), upstream)


class LoggingAdaptor(Resource):
    """Logs every call as RMM's CSV to ``path`` (readable by ``carve replay``)."""

    __slots__ = ()

    def __init__(
        self, upstream: Resource, path: Union[str, "os.PathLike[str]"], auto_flush: bool = False
    ) -> None:
        super().__init__(_carve.make_logging(_as_raw(upstream), os.fspath(path), auto_flush), upstream)



def _fabric(fabric: Union[bool, str]) -> str:
    if fabric is True:
        return "required"
    if fabric is False:
        return "off"
    if fabric == "auto":
        return "auto"
    raise ValueError(f"fabric={fabric!r}: False, True or 'auto'")


class _ExportsChunks(Resource):
    """A virtual-memory resource whose physical chunks other processes can map, and whose
    mappings a callback can follow (:meth:`set_segment_callback`)."""

    __slots__ = ("_segment_errors",)

    def set_segment_callback(self, callback: Optional[Callable[[int, int, bool], object]]) -> None:
        """Calls ``callback(ptr, size, mapped)`` for every physical chunk this resource has
        mapped now and maps from now on (``mapped=True``: access granted, before a block on it
        is handed out), and for each it unmaps (``mapped=False``: after the unmap, with no live
        block or queued work on it; when the resource goes, before), to register the memory with
        NCCL or NIXL as it appears. ``None`` removes it. The callback runs with the GIL held, on
        the thread whose allocation or :meth:`release` caused the change; it may allocate from
        this resource. An exception it raises is kept, not propagated: :meth:`segment_error`
        returns it. A thread that holds the GIL while another thread's allocation from this
        resource delivers events waits for the GIL: keep callbacks short, and allocate from
        Python (which releases the GIL) rather than from C code that holds it."""
        self._segment_errors = _carve.vm_set_segment_callback(self._r, callback)

    def segment_error(self) -> Optional[BaseException]:
        """The exception the segment callback raised last (cleared), or None."""
        errors = getattr(self, "_segment_errors", None)
        return None if errors is None else errors.take()


    def export_chunk(self, ptr: int) -> Tuple[int, int, int]:
        """``(fd, chunk_start, chunk_size)``: a new POSIX file descriptor for the physical chunk
        holding ``ptr`` (a live block of this resource), and the chunk's range. Send ``fd`` to
        another process (``subprocess``'s ``pass_fds``, ``socket.send_fds``), which maps it with
        :class:`carve.ImportedChunk` ``(fd, chunk_size)``; close it here with ``os.close``. The
        block lies at ``ptr - chunk_start`` in the chunk; a block larger than a chunk spans
        several. Needs a resource created with ``exportable=True`` (else
        :class:`UnsupportedError`); a pointer it did not hand out is :class:`BadPointerError`."""
        return _carve.vm_export_chunk(self._r, ptr)


class ExpandableResource(_ExportsChunks):
    """The expandable pool (PyTorch's ``expandable_segments``) on ``device``: blocks share
    pages of virtual memory mapped as needed, so fragmentation does not strand memory. Sizes
    left None take the defaults (``maximum_size``: the device's memory). ``exportable=True``
    creates chunks that :meth:`export_chunk` can hand to other processes. ``fabric=True``
    gives chunks fabric handles as well (multi-node NVLink; :class:`UnsupportedError` where the
    device cannot), ``fabric="auto"`` only where it can, as NCCL chooses;
    ``granularity="recommended"`` sizes chunks by the driver's recommended granularity rather
    than its minimum. NCCL registration wants ``exportable=True, fabric="auto",
    granularity="recommended"`` (:func:`carve.torch.nccl_mem_pool`). ``on_segment``: see
    :meth:`set_segment_callback`. :meth:`over_host` builds one over host virtual memory (no GPU
    needed)."""

    __slots__ = ()

    def __init__(
        self,
        device: int = 0,
        maximum_size: Optional[int] = None,
        small_limit: Optional[int] = None,
        small_chunk: Optional[int] = None,
        large_chunk: Optional[int] = None,
        headroom: Optional[float] = None,
        exportable: bool = False,
        fabric: Union[bool, str] = False,
        granularity: str = "minimum",
        on_segment: Optional[Callable[[int, int, bool], object]] = None,
    ) -> None:
        raw = _carve.make_expandable(
            device,
            maximum_size,
            small_limit,
            small_chunk,
            large_chunk,
            headroom,
            exportable,
            _fabric(fabric),
            granularity,
        )
        super().__init__(raw)
        if on_segment is not None:
            self.set_segment_callback(on_segment)

    @classmethod
    def over_host(
        cls,
        maximum_size: int,
        granularity: int = 64 << 10,
        small_limit: Optional[int] = None,
        small_chunk: Optional[int] = None,
        large_chunk: Optional[int] = None,
        headroom: Optional[float] = None,
        on_segment: Optional[Callable[[int, int, bool], object]] = None,
    ) -> "ExpandableResource":
        """Over host virtual memory (Linux memory files) with pages of ``granularity`` bytes."""
        raw = _carve.make_expandable_host(
            granularity, maximum_size, small_limit, small_chunk, large_chunk, headroom
        )
        r = cls._wrap(raw)
        if on_segment is not None:
            r.set_segment_callback(on_segment)  # type: ignore[attr-defined]
        return r  # type: ignore[return-value]


class VirtualMemoryResource(_ExportsChunks):
    """Whole-chunk virtual memory on ``device`` (the driver's ``cuMemCreate`` / ``cuMemMap``).
    ``exportable=True`` creates chunks that :meth:`export_chunk` can hand to other processes;
    ``fabric``, ``granularity`` and ``on_segment`` as for :class:`ExpandableResource`.
    :meth:`over_host` builds one over host virtual memory (no GPU needed)."""

    __slots__ = ()

    def __init__(
        self,
        device: int = 0,
        maximum_size: Optional[int] = None,
        chunk_size: Optional[int] = None,
        reserve: Optional[int] = None,
        exportable: bool = False,
        fabric: Union[bool, str] = False,
        granularity: str = "minimum",
        on_segment: Optional[Callable[[int, int, bool], object]] = None,
    ) -> None:
        raw = _carve.make_virtual(
            device, maximum_size, chunk_size, reserve, exportable, _fabric(fabric), granularity
        )
        super().__init__(raw)
        if on_segment is not None:
            self.set_segment_callback(on_segment)

    @classmethod
    def over_host(
        cls,
        maximum_size: int,
        granularity: int = 64 << 10,
        chunk_size: Optional[int] = None,
        reserve: Optional[int] = None,
        on_segment: Optional[Callable[[int, int, bool], object]] = None,
    ) -> "VirtualMemoryResource":
        """Over host virtual memory (Linux memory files) with pages of ``granularity`` bytes."""
        raw = _carve.make_virtual_host(granularity, maximum_size, chunk_size, reserve)
        r = cls._wrap(raw)
        if on_segment is not None:
            r.set_segment_callback(on_segment)  # type: ignore[attr-defined]
        return r  # type: ignore[return-value]


class GraphSafeResource(Resource):
    """Allocation that is safe inside CUDA graph capture: requests on a captured stream come
    from a pool kept for that capture; others go to ``upstream``."""

    __slots__ = ()

    def __init__(self, upstream: Resource) -> None:
        super().__init__(_carve.make_graph_safe(_as_raw(upstream)), upstream)


class AlignedAdaptor(Resource):
    """Aligns requests of ``threshold`` bytes or more to ``alignment`` (a power of two), as
    RMM's ``AlignedResourceAdaptor``."""

    __slots__ = ()

    def __init__(self, upstream: Resource, alignment: int, threshold: int = 0) -> None:
        super().__init__(_carve.make_aligned(_as_raw(upstream), alignment, threshold), upstream)


class PrefetchAdaptor(Resource):
    """Prefetches each (managed) block to ``device`` when it is allocated, as RMM's
    ``PrefetchResourceAdaptor``."""

    __slots__ = ()

    def __init__(self, upstream: Resource, device: int = 0) -> None:
        super().__init__(_carve.make_prefetch(_as_raw(upstream), device), upstream)


class FailureCallbackAdaptor(Resource):
    """On out-of-memory calls ``callback(nbytes)`` and retries while it returns true, as RMM's
    ``FailureCallbackResourceAdaptor``. An exception in the callback means "do not retry":
    :meth:`allocate` raises the out-of-memory error with that exception as its cause."""

    __slots__ = ("_errors", "_callback")

    def __init__(self, upstream: Resource, callback: Callable[[int], bool]) -> None:
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}")
        raw, self._errors = _carve.make_failure_callback(_as_raw(upstream), callback)
        self._callback = callback
        super().__init__(raw, upstream)

    def allocate(self, nbytes: int, alignment: int = 256, stream: Any = 0) -> int:
        self._errors.take()
        try:
            return super().allocate(nbytes, alignment, stream)
        except _errors.OutOfMemoryError as e:
            cause = self._errors.take()
            if cause is not None:
                raise e from cause
            raise

_current: Dict[int, Resource] = {}


def set_current_resource(device: int, resource: Resource) -> Resource:
    """Makes ``resource`` current for ``device``; returns the resource it replaces."""
    if not isinstance(resource, Resource):
        raise TypeError(f"expected a carve resource, got {type(resource).__name__}")
    before = get_current_resource(device)
    _carve.set_current_resource(device, resource._r)
    _current[device] = resource
    return before


def get_current_resource(device: int = 0) -> Resource:
    """The current resource of ``device`` (a cuda resource until one is set)."""
    raw = _carve.get_current_resource(device)
    known = _current.get(device)
    if known is not None and raw.same_as(known._r):
        return known
    return Resource._wrap(raw)


def _as_raw(resource: Any) -> "_carve.Resource":
    if isinstance(resource, Resource):
        return resource._r
    if isinstance(resource, _carve.Resource):
        return resource
    raise TypeError(f"expected a carve resource, got {type(resource).__name__}")
