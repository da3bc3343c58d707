"""Numba's EMM plugin over carve (RMM's ``rmm.allocators.numba``):
``cuda.set_memory_manager(CarveNumbaManager)``, or
``NUMBA_CUDA_MEMORY_MANAGER=carve.allocators.numba``."""

from __future__ import annotations

from ..numba import CarveNumbaManager, _numba_memory_manager

__all__ = ["CarveNumbaManager", "_numba_memory_manager"]
