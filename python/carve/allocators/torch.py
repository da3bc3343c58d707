"""``torch.cuda.memory.change_current_allocator(carve_torch_allocator)``: PyTorch allocates
from the current carve resource of each device (RMM's ``rmm.allocators.torch``). Swap it in
before PyTorch allocates CUDA memory. :func:`carve.torch.use` does the same and also sets the
resource."""

from __future__ import annotations

import torch as _torch

from .. import lib_path

carve_torch_allocator = _torch.cuda.memory.CUDAPluggableAllocator(
    lib_path(), "carve_torch_alloc", "carve_torch_free"
)

__all__ = ["carve_torch_allocator"]
