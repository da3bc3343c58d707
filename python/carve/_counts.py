"""Allocation counters, as RMM's ``rmm.statistics.Statistics``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping


@dataclass
class Statistics:
    """Bytes and allocations of one statistics scope: now, at the peak, and in total."""

    current_bytes: int
    current_count: int
    peak_bytes: int
    peak_count: int
    total_bytes: int
    total_count: int

    @classmethod
    def _of(cls, d: Mapping[str, int]) -> "Statistics":
        return cls(
            current_bytes=d["current_bytes"],
            current_count=d["current_count"],
            peak_bytes=d["peak_bytes"],
            peak_count=d["peak_count"],
            total_bytes=d["total_bytes"],
            total_count=d["total_count"],
        )
