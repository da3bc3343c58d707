"""The guide's Numba and PyTorch hooks in a fresh process (each swap is once per process)."""

import sys

import numpy as np

import carve

stats = carve.StatisticsAdaptor(carve.mr.CudaMemoryResource())
carve.mr.set_current_device_resource(stats)

if sys.argv[1] == "numba":
    if not hasattr(np, "row_stack"):
        np.row_stack = np.vstack  # numba-cuda 0.30 overloads it; NumPy removed it
    from numba import cuda

    from carve.allocators.numba import CarveNumbaManager

    if sys.argv[2] == "set_memory_manager":
        cuda.set_memory_manager(CarveNumbaManager)
    ctx = cuda.current_context()
    assert isinstance(ctx.memory_manager, CarveNumbaManager), type(ctx.memory_manager)
    x = cuda.to_device(np.arange(1 << 20, dtype=np.float32))
    assert stats.stats()["current_bytes"] >= 4 << 20, stats.stats()
    assert np.array_equal(x.copy_to_host(), np.arange(1 << 20, dtype=np.float32))
else:
    import torch

    from carve.allocators.torch import carve_torch_allocator

    torch.cuda.memory.change_current_allocator(carve_torch_allocator)
    x = torch.ones(1 << 20, device="cuda")
    assert stats.stats()["current_bytes"] >= 4 << 20, stats.stats()
    assert float(x.sum()) == float(1 << 20)
print("ok", sys.argv[1:])
