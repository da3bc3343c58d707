"""``carve.reinitialize``: every chosen device's current resource in one call, as
``rmm.reinitialize``, with hooks that run first (``register_reinitialize_hook``)."""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

from . import _carve, _resources
from ._resources import LoggingAdaptor, Resource
from ._sizes import optional_bytes

_Hook = Tuple[Callable[..., Any], Tuple[Any, ...], dict]
_reinitialize_hooks: List[_Hook] = []


def register_reinitialize_hook(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
    """Adds ``func(*args, **kwargs)`` to the hooks that :func:`reinitialize` calls before it
    replaces any resource, e.g. to drop a cache of buffers from the old resource. Hooks run in
    the reverse order of registration. Returns ``func`` (usable as a decorator)."""
    _reinitialize_hooks.append((func, args, kwargs))
    return func


def unregister_reinitialize_hook(func: Callable[..., Any]) -> None:
    """Removes every registration of ``func``."""
    _reinitialize_hooks[:] = [h for h in _reinitialize_hooks if h[0] != func]


def _log_file(name: str, device: int) -> str:
    """RMM's per-device log name: ``dir/name.dev<N>.ext``."""
    root, ext = os.path.splitext(name)
    return f"{root}.dev{device}{ext}"


def reinitialize(
    pool_allocator: bool = False,
    managed_memory: bool = False,
    initial_pool_size: Optional[Union[int, str]] = None,
    maximum_pool_size: Optional[Union[int, str]] = None,
    devices: Union[int, Iterable[int]] = 0,
    logging: bool = False,
    log_file_name: Optional[Union[str, "os.PathLike[str]"]] = None,
) -> None:
    """Sets the current resource of each of ``devices`` (an ordinal or a list), as
    ``rmm.reinitialize`` does, after running the registered hooks:

    - ``managed_memory``: managed memory (``cuMemAllocManaged``) instead of device memory;
    - ``pool_allocator``: a pool in front of it, reserving ``initial_pool_size`` bytes at once
      (default 0: it grows on demand) and holding at most ``maximum_pool_size`` (default: no
      limit). Over device memory the pool is a CUDA driver pool (carve's ``AsyncResource``),
      over managed memory carve's ``PoolResource``. Sizes may be strings ("1GiB"). Without
      ``pool_allocator`` both sizes are ignored, as in RMM;
    - ``logging``: every call logged as RMM's CSV to ``log_file_name`` (default: the
      ``CARVE_LOG_FILE`` or ``RMM_LOG_FILE`` environment variable), one file per device named
      ``name.dev<N>.ext``, flushed per line.

    All devices' resources are built before any is set: on error (a bad ordinal, a bad size)
    no current resource changes. Buffers keep the resource they came from.
    """
    for func, args, kwargs in reversed(list(_reinitialize_hooks)):
        func(*args, **kwargs)
    ordinals = [devices] if isinstance(devices, int) else list(devices)
    initial = maximum = None
    if pool_allocator:
        initial = optional_bytes(initial_pool_size)
        maximum = optional_bytes(maximum_pool_size)
    log_files = None
    if logging:
        name = log_file_name or os.environ.get("CARVE_LOG_FILE") or os.environ.get("RMM_LOG_FILE")
        if not name:
            raise ValueError(
                "reinitialize(logging=True) needs log_file_name (or CARVE_LOG_FILE / RMM_LOG_FILE)"
            )
        log_files = [_log_file(os.fspath(name), d) for d in ordinals]
    now = _carve.reinitialize(
        pool_allocator, managed_memory, initial, maximum, ordinals, log_files
    )
    for device, raw in now:
        wrapper: Resource = LoggingAdaptor._wrap(raw) if logging else Resource._wrap(raw)
        _resources._current[device] = wrapper
