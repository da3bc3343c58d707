"""carve.torch.use against a stand-in for torch that keeps torch's rule: looking up the current
device through ``torch.cuda`` runs its lazy CUDA initialisation, which initialises the caching
allocator, after which ``change_current_allocator`` raises. Runs without a GPU or torch."""

import importlib
import sys
import types

import pytest

import carve


class _Allocator:
    def __init__(self, *args):
        self.args = args

    def allocator(self):
        return self


def _fake_torch(log):
    """A module with the parts of torch that carve.torch.use touches."""
    state = {"initialized": False}
    torch = types.ModuleType("torch")
    torch.__version__ = "0.0-fake"
    cuda = types.ModuleType("torch.cuda")
    memory = types.ModuleType("torch.cuda.memory")

    def current_device():
        # torch.cuda.current_device: _lazy_init() -> torch._C._cuda_init() ->
        # CUDAHooks::init() -> CUDACachingAllocator::init(num_devices).
        log.append("torch.cuda.current_device")
        state["initialized"] = True
        return 0

    def change_current_allocator(alloc):
        log.append("change_current_allocator")
        if state["initialized"]:
            raise RuntimeError("Can't swap an already initialized allocator")

    cuda.current_device = current_device
    cuda.memory = memory
    memory.CUDAPluggableAllocator = _Allocator
    memory._CUDAAllocator = _Allocator
    memory.change_current_allocator = change_current_allocator
    torch.cuda = cuda
    torch._C = types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True)
    return torch


@pytest.fixture
def torch_use(monkeypatch):
    """carve.torch imported against the stand-in; yields (module, call log)."""
    log = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(log))
    # Modules that import torch are imported afresh against the stand-in, and dropped after.
    fresh = ("carve.torch", "carve._torch_unified")
    for name in fresh:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(carve, "torch", raising=False)
    mod = importlib.import_module("carve.torch")
    # Kept for the test of the lookup itself; use() gets the stand-in.
    monkeypatch.setattr(mod, "_real_checked_alloc_address", mod._checked_alloc_address, raising=False)
    monkeypatch.setattr(mod, "_checked_alloc_address", lambda: None)
    monkeypatch.setattr(mod, "set_current_resource", lambda d, r: log.append(("set", d)))
    yield mod, log
    for name in fresh:
        sys.modules.pop(name, None)


def test_use_without_a_device_swaps_before_torch_initialises_cuda(torch_use, monkeypatch):
    mod, log = torch_use
    monkeypatch.setattr(mod._carve, "current_device", lambda: 0, raising=False)
    mod.use(object())
    assert "torch.cuda.current_device" not in log, log
    assert log == [("set", 0), "change_current_allocator"], log


def test_use_takes_the_drivers_current_device(torch_use, monkeypatch):
    mod, log = torch_use
    monkeypatch.setattr(mod._carve, "current_device", lambda: 3, raising=False)
    mod.use(object())
    assert log[0] == ("set", 3), log


def test_out_of_memory_support_loads_nothing_from_disk(torch_use, monkeypatch, tmp_path):
    # The throwing allocation function is resolved only in PyTorch libraries already loaded:
    # a libc10.so beside a torch that did not load it is never opened, and nothing is built.
    mod, _ = torch_use
    lib = tmp_path / "torch" / "lib"
    lib.mkdir(parents=True)
    for name in ("libc10.so", "libc10_cuda.so"):
        (lib / name).write_bytes(b"not a library")
    monkeypatch.setattr(mod._torch, "__file__", str(tmp_path / "torch" / "__init__.py"), raising=False)
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.warns(RuntimeWarning, match="is not loaded"):
        assert mod._real_checked_alloc_address() is None
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
