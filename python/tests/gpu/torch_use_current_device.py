"""carve.torch.use(r) with no device, as the first thing in a fresh process (as the README
shows it): it must swap PyTorch's allocator before anything initialises PyTorch's CUDA state."""

import torch

import carve
import carve.torch

MiB = 1 << 20
res = carve.StatisticsAdaptor(carve.CudaResource(0))
carve.torch.use(res)

before = res.stats()["current_bytes"]
x = torch.ones(MiB, dtype=torch.float32, device="cuda")
torch.cuda.synchronize()
held = res.stats()["current_bytes"] - before
assert held >= 4 * MiB, res.stats()
assert torch.cuda.current_device() == 0
assert carve._carve.current_device() == 0
assert int(x.sum().item()) == MiB
print(f"torch use on the current device: ok ({held / MiB:.1f} MiB from carve)")
