"""Numba kernels with NUMBA_CUDA_MEMORY_MANAGER=carve.numba (set by the caller)."""

import gc
import os
import sys

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack  # numba-cuda 0.30 overloads it; NumPy removed it

import carve  # noqa: E402

assert os.environ.get("NUMBA_CUDA_MEMORY_MANAGER") == "carve.numba"
stats = carve.StatisticsAdaptor(carve.PoolResource(carve.CudaResource(0), 1 << 24))
carve.set_current_resource(0, stats)

from numba import cuda  # noqa: E402

import carve.numba  # noqa: E402


@cuda.jit
def axpy(a, x, y, out):
    i = cuda.grid(1)
    if i < out.size:
        out[i] = a * x[i] + y[i]


ctx = cuda.current_context()
assert isinstance(ctx.memory_manager, carve.numba.CarveNumbaManager), type(ctx.memory_manager)
n = 1 << 20
x = cuda.to_device(np.arange(n, dtype=np.float32))
y = cuda.to_device(np.ones(n, dtype=np.float32))
out = cuda.device_array(n, dtype=np.float32)
axpy[(n + 255) // 256, 256](np.float32(2), x, y, out)
host = out.copy_to_host()
assert np.array_equal(host, 2 * np.arange(n, dtype=np.float32) + 1)
s = stats.stats()
assert s["current_count"] >= 3 and s["current_bytes"] >= 3 * 4 * n, s
free, total = ctx.get_memory_info()
assert 0 < free <= total
handle = x.get_ipc_handle()
print(f"ipc handle: {type(handle).__name__}, offset {getattr(handle, 'offset', '?')}")
z = cuda.device_array(0, dtype=np.float32)  # zero bytes: no carve allocation
del x, y, out, z, handle
gc.collect()
cuda.synchronize()
left = stats.stats()["current_count"]
if left != 0:
    print(f"FAIL: {left} carve blocks still live after the arrays were collected")
    sys.exit(1)
print("numba emm: ok")
