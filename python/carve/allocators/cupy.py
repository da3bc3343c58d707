"""``cupy.cuda.set_allocator(carve_cupy_allocator)``: CuPy allocates from the current carve
resource of the device it allocates on (RMM's ``rmm.allocators.cupy.rmm_cupy_allocator``)."""

from __future__ import annotations

from ..cupy import allocator

carve_cupy_allocator = allocator()

__all__ = ["carve_cupy_allocator"]
