"""Dask workers allocate through carve: the counterpart of dask-cuda's ``RMMSetup`` plugin
(``LocalCUDACluster(rmm_pool_size=...)``).

:class:`CarveSetup` is a ``distributed.WorkerPlugin``. On every worker, present and future, it
builds a carve resource on the worker's GPU, makes it that device's current carve resource,
and points CuPy (and PyTorch, when the worker has imported it) at it::

    from dask.distributed import Client
    import carve.dask

    client = Client(cluster)                      # one worker per GPU
    carve.dask.setup(client, pool_size="24GiB", statistics=True, log_directory="logs")
    ...
    client.run(carve.dask.worker_statistics)      # {worker address: carve.statistics.Statistics}

The keywords are those of ``LocalCUDACluster`` without the ``rmm_`` prefix: ``pool_size``,
``maximum_pool_size``, ``managed_memory``, ``async_alloc`` (``rmm_async``),
``release_threshold``, ``log_directory``, ``track_allocations`` and ``external_lib_list``
(``rmm_allocator_external_lib_list``); carve adds ``expandable``, ``statistics`` and
``resource``. Sizes are ints, strings ("1GiB", "512MB") or floats in (0, 1], a fraction of the
worker's device memory.

The worker's GPU is the device whose CUDA context is current in the worker (device 0 when none
is), which is the GPU that ``CUDA_VISIBLE_DEVICES`` gives each worker of dask-cuda or of a
cluster started with one such variable per worker. Without a CUDA device (CPU tests) the plugin
still builds the resource, which :func:`worker_resource` returns, but sets no current resource
and no allocator hook.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, Union

from distributed import WorkerPlugin

from . import _carve
from ._counts import Statistics
from ._errors import InvalidArgumentError
from ._resources import (
    AsyncResource,
    CudaResource,
    ExpandableResource,
    LoggingAdaptor,
    ManagedResource,
    PoolResource,
    Resource,
    StatisticsAdaptor,
    TrackingAdaptor,
    get_current_resource,
    set_current_resource,
)
from ._sizes import parse_bytes

__all__ = [
    "CarveSetup",
    "cluster_statistics",
    "log_file_name",
    "setup",
    "worker_resource",
    "worker_statistics",
]

Size = Union[int, str, float]
_LIBS = ("cupy", "torch")


def _size(name: str, value: Optional[Size]) -> Optional[Union[int, float]]:
    """A size checked on the client: bytes as an int, or a fraction of device memory."""
    if value is None:
        return None
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise InvalidArgumentError(
                f"{name}: a float is a fraction of device memory in (0, 1], got {value}"
            )
        return value
    try:
        return parse_bytes(value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _libs(value: Union[None, str, Iterable[str]]) -> Optional[List[str]]:
    if value is None:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in _LIBS]
    if unknown:
        raise InvalidArgumentError(
            f"external_lib_list: carve hooks {', '.join(_LIBS)}, not {', '.join(unknown)}"
        )
    return names


def log_file_name(worker: Any, log_directory: Union[str, "os.PathLike[str]"]) -> str:
    """The log of ``worker`` in ``log_directory``: ``carve_log_<worker name>.csv`` (RMM's CSV,
    which ``carve replay`` reads), as dask-cuda names ``rmm_log_<worker name>.txt``."""
    name = getattr(worker, "name", None)
    if name is None:
        name = f"pid{os.getpid()}"
    name = str(name).rsplit("/", 1)[-1].replace(":", "_")
    return os.path.join(os.fspath(log_directory), f"carve_log_{name}.csv")


class CarveSetup(WorkerPlugin):
    """Builds a carve resource on each worker and makes it the worker's current one.

    From the bottom up, the resource is:

    - its base: ``resource()`` when that zero-argument factory is given (it must be picklable
      and return a :class:`carve.Resource`), else managed memory (``managed_memory``), a CUDA
      driver pool (``async_alloc``: :class:`carve.AsyncResource` with ``pool_size`` reserved,
      ``release_threshold`` and ``maximum_pool_size`` as its hard limit), carve's expandable
      pool (``expandable``: :class:`carve.ExpandableResource` bounded by
      ``maximum_pool_size``), or plain device memory;
    - a :class:`carve.PoolResource` of ``pool_size`` bytes growing up to ``maximum_pool_size``
      over the base, when ``pool_size`` is given (not with ``async_alloc`` or ``expandable``,
      which pool by themselves);
    - a :class:`carve.LoggingAdaptor` writing :func:`log_file_name` in ``log_directory``,
      flushed per line;
    - a :class:`carve.TrackingAdaptor` (``track_allocations``);
    - a :class:`carve.StatisticsAdaptor` on top (``statistics``), read by
      :func:`worker_statistics` and by :mod:`carve.statistics` on the worker.

    ``external_lib_list`` names the libraries pointed at the device's current carve resource:
    "cupy" (``cupy.cuda.set_allocator``) and "torch" (:func:`carve.torch.use`, which must come
    before PyTorch allocates). None: CuPy when it is installed, PyTorch when the worker has
    imported it, both only over a device resource on a CUDA device, and a failure to hook
    either is a warning; a list: exactly those, and a failure is an error.

    On each worker, after setup: ``device`` (the CUDA device, None without one),
    ``built_resource`` (the top of the stack), ``statistics_adaptor``, ``log_file`` and
    ``hooked`` (the libraries pointed at carve); the worker keeps the plugin in
    ``worker.plugins["carve"]``.

    Bad options raise on the client when the plugin is built (:class:`carve.InvalidArgumentError`
    or ``TypeError``); errors on a worker (a size the device cannot hold, no device) reach the
    client from ``register_plugin``. On teardown (the plugin removed or replaced, the worker
    closed) the worker's previous current resource comes back; PyTorch's allocator swap cannot
    be undone.
    """

    name = "carve"
    idempotent = False

    def __init__(
        self,
        pool_size: Optional[Size] = None,
        maximum_pool_size: Optional[Size] = None,
        managed_memory: bool = False,
        async_alloc: bool = False,
        release_threshold: Optional[Size] = None,
        expandable: bool = False,
        statistics: bool = False,
        log_directory: Optional[Union[str, "os.PathLike[str]"]] = None,
        track_allocations: bool = False,
        external_lib_list: Union[None, str, Iterable[str]] = None,
        resource: Optional[Callable[[], Resource]] = None,
    ) -> None:
        self.pool_size = _size("pool_size", pool_size)
        self.maximum_pool_size = _size("maximum_pool_size", maximum_pool_size)
        self.release_threshold = _size("release_threshold", release_threshold)
        self.managed_memory = _flag("managed_memory", managed_memory)
        self.async_alloc = _flag("async_alloc", async_alloc)
        self.expandable = _flag("expandable", expandable)
        self.statistics = _flag("statistics", statistics)
        self.track_allocations = _flag("track_allocations", track_allocations)
        self.external_lib_list = _libs(external_lib_list)
        if resource is not None and not callable(resource):
            raise TypeError(
                f"resource must be a zero-argument factory, got {type(resource).__name__}"
            )
        self.resource = resource
        if log_directory is not None and not isinstance(log_directory, (str, os.PathLike)):
            raise TypeError(f"log_directory must be a path, got {type(log_directory).__name__}")
        self.log_directory = None if log_directory is None else os.fspath(log_directory)
        bases = [
            n
            for n, on in (
                ("resource", resource is not None),
                ("managed_memory", self.managed_memory),
                ("async_alloc", self.async_alloc),
                ("expandable", self.expandable),
            )
            if on
        ]
        if len(bases) > 1:
            raise InvalidArgumentError(f"{' and '.join(bases)} exclude each other")
        if self.expandable and self.pool_size is not None:
            raise InvalidArgumentError(
                "expandable grows on demand: give it maximum_pool_size, not pool_size"
            )
        if self.maximum_pool_size is not None and self.pool_size is None and not self.expandable:
            raise InvalidArgumentError(
                "maximum_pool_size was given without pool_size; pool_size makes the pool"
            )
        small, large = self.pool_size, self.maximum_pool_size
        if isinstance(small, int) and isinstance(large, int) and large < small:
            raise InvalidArgumentError(f"maximum_pool_size {large} is below pool_size {small}")
        if self.release_threshold is not None and not self.async_alloc:
            raise InvalidArgumentError("release_threshold needs async_alloc")
        self._reset()

    def _reset(self) -> None:
        self.device: Optional[int] = None
        self.built_resource: Optional[Resource] = None
        self.statistics_adaptor: Optional[StatisticsAdaptor] = None
        self.log_file: Optional[str] = None
        self.hooked: List[str] = []
        self._previous: Optional[Resource] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for k in ("built_resource", "statistics_adaptor", "_previous"):
            state[k] = None
        return state

    def _bytes(self, value: Optional[Union[int, float]]) -> Optional[int]:
        if value is None or isinstance(value, int):
            return value
        if self.device is None:
            raise InvalidArgumentError("a fractional size needs a CUDA device on the worker")
        total = _carve.mem_info(self.device)[1]
        return int(value * total) // 256 * 256

    def _base(self, device: int) -> Resource:
        if self.resource is not None:
            base = self.resource()
            if not isinstance(base, Resource):
                raise TypeError(
                    f"resource() must return a carve resource, got {type(base).__name__}"
                )
            return base
        maximum = self._bytes(self.maximum_pool_size)
        if self.managed_memory:
            return ManagedResource(device)
        if self.async_alloc:
            return AsyncResource(
                device,
                self._bytes(self.pool_size) or 0,
                self._bytes(self.release_threshold),
                maximum,
            )
        if self.expandable:
            return ExpandableResource(device, maximum_size=maximum)
        return CudaResource(device)

    def build(self, worker: Any = None) -> Resource:
        """The worker's resource, built with this plugin's options (sets nothing)."""
        device = self.device if self.device is not None else 0
        top = self._base(device)
        if self.pool_size is not None and not self.async_alloc:
            top = PoolResource(
                top, self._bytes(self.pool_size) or 0, self._bytes(self.maximum_pool_size)
            )
        if self.log_directory is not None:
            os.makedirs(self.log_directory, exist_ok=True)
            self.log_file = log_file_name(worker, self.log_directory)
            top = LoggingAdaptor(top, self.log_file, auto_flush=True)
        if self.track_allocations:
            top = TrackingAdaptor(top)
        if self.statistics:
            top = self.statistics_adaptor = StatisticsAdaptor(top)
        return top

    def setup(self, worker: Any = None) -> None:
        self._reset()
        if _carve.is_available():
            self.device = _carve.current_device()
        resource = self.build(worker)
        if self.device is not None:
            self._previous = set_current_resource(self.device, resource)
        self.built_resource = resource
        try:
            self._hook(resource)
        except BaseException:
            self.teardown(worker)
            raise

    def _hook(self, resource: Resource) -> None:
        on_device = self.device is not None and resource.device_accessible
        if self.external_lib_list is None:
            if not on_device:
                return
            for lib in ["cupy"] + (["torch"] if "torch" in sys.modules else []):
                try:
                    self._hook_one(lib, resource)
                except ImportError:
                    continue
                except Exception as e:
                    warnings.warn(f"carve.dask: {lib} not hooked: {e}", RuntimeWarning)
            return
        for lib in self.external_lib_list:
            if not on_device:
                raise InvalidArgumentError(
                    f"external_lib_list: {lib} allocates device memory; this worker has "
                    + ("no CUDA device" if self.device is None else f"a {resource.kind} resource")
                )
            self._hook_one(lib, resource)

    def _hook_one(self, lib: str, resource: Resource) -> None:
        if lib == "cupy":
            from . import cupy as carve_cupy

            carve_cupy.set_allocator(None)
        else:
            from . import torch as carve_torch

            carve_torch.use(resource, self.device)
        self.hooked.append(lib)

    def teardown(self, worker: Any = None) -> None:
        if self.device is not None and self._previous is not None:
            if get_current_resource(self.device) is self.built_resource:
                set_current_resource(self.device, self._previous)
        self._reset()


def setup(client: Any, **options: Any) -> Dict[str, Any]:
    """Registers :class:`CarveSetup` ``(**options)`` on every worker of ``client``'s cluster,
    present and future (replacing an earlier carve plugin), as ``LocalCUDACluster(rmm_...)``
    does. Returns ``register_plugin``'s replies by worker address."""
    return client.register_plugin(CarveSetup(**options))


def _plugin(dask_worker: Any = None) -> Optional[CarveSetup]:
    if dask_worker is None:
        from distributed import get_worker

        try:
            dask_worker = get_worker()
        except ValueError:
            return None
    for plugin in getattr(dask_worker, "plugins", {}).values():
        if isinstance(plugin, CarveSetup):
            return plugin
    return None


def worker_resource(dask_worker: Any = None) -> Optional[Resource]:
    """The resource :class:`CarveSetup` built on this worker (None without the plugin). Inside a
    task it finds the worker itself; a function run by ``client.run`` passes on the
    ``dask_worker`` that ``client.run`` gives it."""
    plugin = _plugin(dask_worker)
    return None if plugin is None else plugin.built_resource


def worker_statistics(dask_worker: Any = None) -> Optional[Statistics]:
    """This worker's allocation counters (None unless the plugin runs with
    ``statistics=True``): ``client.run(carve.dask.worker_statistics)`` gives every worker's."""
    plugin = _plugin(dask_worker)
    if plugin is None or plugin.statistics_adaptor is None:
        return None
    return plugin.statistics_adaptor.allocation_counts


def cluster_statistics(client: Any) -> Dict[str, Optional[Statistics]]:
    """:func:`worker_statistics` of every worker, by address."""
    return client.run(worker_statistics)
