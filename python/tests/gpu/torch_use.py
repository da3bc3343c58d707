"""carve.torch.use in a fresh process (the allocator swap is once per process)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import carve  # noqa: E402
import carve.torch  # noqa: E402
from transformer import SHAPES, make_model, train  # noqa: E402

MiB = 1 << 20
res = carve.StatisticsAdaptor(carve.PoolResource(carve.CudaResource(0), 64 * MiB))
carve.torch.use(res, device=0)

x = torch.randn(1024, 1024, device="cuda")
y = x @ x
torch.cuda.synchronize()
s = res.stats()
assert s["current_bytes"] >= 2 * 4 * MiB, s
losses = train(make_model(seed=0), SHAPES, seed=1)
assert all(l == l and l < 20 for l in losses), losses  # finite
peak = res.stats()["peak_bytes"]
print(f"trained {len(losses)} steps under use(); carve peak {peak / MiB:.1f} MiB")
del x, y
torch.cuda.synchronize()
before = res.stats()["current_count"]

# Exhaustion: switch the current resource to a small limit; PyTorch must raise, not return
# a tensor with a null pointer.
lim = carve.LimitingAdaptor(carve.CudaResource(0), 16 * MiB)
carve.torch.use(lim, device=0)
try:
    t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    first = str(e).splitlines()[0]
    print(f"OOM raised as torch.OutOfMemoryError: {first}")
    if not first.startswith("carve: CUDA out of memory") or "limit is" not in str(e):
        print("FAIL: the message is not carve's")
        sys.exit(1)
except RuntimeError as e:
    print(f"OOM raised as {type(e).__name__} (not torch.OutOfMemoryError): {e}")
    sys.exit(1)
else:
    print(f"FAIL: PyTorch returned a tensor at {t.data_ptr():#x} from an exhausted resource")
    sys.exit(1)
small = torch.ones(MiB, dtype=torch.uint8, device="cuda")
assert int(small.sum().item()) == MiB
print("torch use: ok")
