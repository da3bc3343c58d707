"""Allocation statistics of the current device's resource, as ``rmm.statistics``.

:func:`enable_statistics` puts a :class:`carve.StatisticsAdaptor` on top of the current
resource; :func:`get_statistics` reads it; :func:`push_statistics` / :func:`pop_statistics`
open and close nested scopes of counters (an outer scope's peak covers its inner ones);
:func:`statistics` is a context manager over them; :func:`profiler` records each function's or
block's peak and total in :data:`default_profiler_records`::

    with carve.statistics.statistics():
        buf = carve.DeviceBuffer(size=1000)
        print(carve.statistics.get_statistics().peak_bytes)   # 1000

Every function is a no-op returning None while the current resource is not a statistics
adaptor (except :func:`enable_statistics` and :func:`statistics`, which make it one).
"""

from __future__ import annotations

import inspect
import threading
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any, Callable, Dict, Iterator, Literal, Optional

from . import mr as _mr
from ._counts import Statistics
from ._resources import StatisticsAdaptor

__all__ = [
    "ProfilerRecords",
    "Statistics",
    "default_profiler_records",
    "enable_statistics",
    "get_statistics",
    "pop_statistics",
    "profiler",
    "push_statistics",
    "statistics",
]


def _stats_mr() -> Optional[StatisticsAdaptor]:
    r = _mr.get_current_device_resource()
    return r if isinstance(r, StatisticsAdaptor) else None


def enable_statistics() -> None:
    """Puts a statistics adaptor on top of the current device's resource, unless the current
    resource is one already. It must stay on top while statistics are gathered."""
    if _stats_mr() is None:
        _mr.set_current_device_resource(StatisticsAdaptor(_mr.get_current_device_resource()))


def get_statistics() -> Optional[Statistics]:
    """The counters of the innermost scope; None when statistics are not enabled."""
    r = _stats_mr()
    return None if r is None else r.allocation_counts


def push_statistics() -> Optional[Statistics]:
    """Opens a scope of zeroed counters; returns the counters before the push (None when
    statistics are not enabled)."""
    r = _stats_mr()
    return None if r is None else r.push_counters()


def pop_statistics() -> Optional[Statistics]:
    """Closes the innermost scope and returns its counters (None when statistics are not
    enabled); the scope below absorbs them."""
    r = _stats_mr()
    return None if r is None else r.pop_counters()


@contextmanager
def statistics() -> Iterator[None]:
    """Gathers statistics inside the block: in a new scope when they are enabled already, else
    with a statistics adaptor set for the block and removed after it. ``ValueError`` if the
    current resource was replaced inside the block."""
    prior = None
    if push_statistics() is None:
        prior = _mr.get_current_device_resource()
        enable_statistics()
    current = _mr.get_current_device_resource()
    try:
        yield
    finally:
        if current is not _mr.get_current_device_resource():
            raise ValueError("the current resource was changed inside the statistics context")
        if prior is None:
            pop_statistics()
        else:
            _mr.set_current_device_resource(prior)


class ProfilerRecords:
    """The statistics a :func:`profiler` recorded, per function or named block."""

    @dataclass
    class MemoryRecord:
        """One function's or block's calls, peak bytes (the highest of any call) and total
        bytes (over all calls)."""

        num_calls: int = 0
        memory_total: int = 0
        memory_peak: int = 0

        def add(self, memory_total: int, memory_peak: int) -> None:
            self.num_calls += 1
            self.memory_total += memory_total
            self.memory_peak = max(self.memory_peak, memory_peak)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: Dict[str, ProfilerRecords.MemoryRecord] = defaultdict(
            ProfilerRecords.MemoryRecord
        )

    def add(self, name: str, data: Statistics) -> None:
        """Records one call of ``name``."""
        with self._lock:
            self._records[name].add(memory_total=data.total_bytes, memory_peak=data.peak_bytes)

    @property
    def records(self) -> Dict[str, "ProfilerRecords.MemoryRecord"]:
        """A copy of the records, by name."""
        with self._lock:
            return dict(self._records)

    def report(
        self, ordered_by: Literal["num_calls", "memory_peak", "memory_total"] = "memory_peak"
    ) -> str:
        """The records as a table, largest first by ``ordered_by``."""
        ret = "Memory Profiling\n================\n\n"
        records = self.records
        if not records:
            return ret + "No data, maybe profiling wasn't enabled?"
        ret += (
            "Legends:\n"
            "  ncalls       - number of times the function or code block was called\n"
            "  memory_peak  - peak memory allocated in function or code block (in bytes)\n"
            "  memory_total - total memory allocated in function or code block (in bytes)\n"
        )
        ret += f"\nOrdered by: {ordered_by}\n"
        ret += "\nncalls     memory_peak    memory_total  filename:lineno(function)\n"
        for name, record in sorted(
            records.items(), key=lambda x: getattr(x[1], ordered_by), reverse=True
        ):
            ret += f"{record.num_calls:6,d} {record.memory_peak:15,d} "
            ret += f"{record.memory_total:15,d}  {name}\n"
        return ret[:-1]

    def __str__(self) -> str:
        return self.report()


def _name_of(obj: Any) -> str:
    try:
        _, lineno = inspect.getsourcelines(obj)
        return f"{inspect.getfile(obj)}:{lineno}({obj.__qualname__})"
    except (TypeError, OSError):
        return str(getattr(obj, "__qualname__", obj))


default_profiler_records = ProfilerRecords()


class _Profiler:
    def __init__(self, records: ProfilerRecords, name: str) -> None:
        self._records = records
        self._name = name

    def __call__(self, func: Callable[..., Any]) -> Callable[..., Any]:
        name = self._name or _name_of(func)
        records = self._records

        @wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            push_statistics()
            try:
                return func(*args, **kwargs)
            finally:
                stats = pop_statistics()
                if stats is not None:
                    records.add(name=name, data=stats)

        return wrapper

    def __enter__(self) -> "_Profiler":
        if not self._name:
            raise ValueError("when profiling a code block, give it a `name`")
        push_statistics()
        return self

    def __exit__(self, *exc: Any) -> bool:
        stats = pop_statistics()
        if stats is not None:
            self._records.add(name=self._name, data=stats)
        return False


def profiler(*, records: ProfilerRecords = default_profiler_records, name: str = "") -> _Profiler:
    """A decorator (``@profiler()``) or context manager (``with profiler(name="x"):``) that
    records the peak and total bytes of each call in ``records``, while statistics are
    enabled (else it records nothing)."""
    return _Profiler(records, name)
