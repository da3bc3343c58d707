"""Byte sizes given as ints or strings ("1GiB", "512 MB", "1e9"), as RMM accepts them."""

from __future__ import annotations

import re
from typing import Optional, Union

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_bytes(size: Union[int, str]) -> int:
    """``size`` in bytes: an int as is, or a string with an optional unit (kB, MiB, GB, ...)."""
    if isinstance(size, bool):
        raise TypeError("a size must be an int or a string, not a bool")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"a size cannot be negative: {size}")
        return size
    if not isinstance(size, str):
        raise TypeError(f"a size must be an int or a string, not {type(size).__name__}")
    m = _PATTERN.match(size.lower())
    if m is None or m.group(2) not in _UNITS:
        raise ValueError(f"not a size: {size!r} (e.g. 1024, '512MiB', '1GB')")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def optional_bytes(size: Optional[Union[int, str]]) -> Optional[int]:
    """As :func:`parse_bytes`, with None kept."""
    return None if size is None else parse_bytes(size)
