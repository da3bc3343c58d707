"""carve.torch.graph_pool's arguments, against a stand-in for torch (no GPU or torch needed):
what it wraps in a GraphSafeResource and what it refuses."""

import importlib
import sys
import types

import pytest

import carve


def _fake_torch():
    """A module with the parts of torch that carve.torch imports and graph_pool touches."""
    torch = types.ModuleType("torch")
    cuda = types.ModuleType("torch.cuda")
    cuda.memory = types.ModuleType("torch.cuda.memory")
    cuda.current_device = lambda: 0
    torch.cuda = cuda
    return torch


@pytest.fixture
def torch_mod(monkeypatch):
    """carve.torch imported against the stand-in, with mem_pool recording its resource."""
    monkeypatch.setitem(sys.modules, "torch", _fake_torch())
    fresh = ("carve.torch", "carve._torch_unified")
    for name in fresh:
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delattr(carve, "torch", raising=False)
    mod = importlib.import_module("carve.torch")
    monkeypatch.setattr(mod, "mem_pool", lambda r, **kw: ("pool", r, kw))
    yield mod
    for name in fresh:
        sys.modules.pop(name, None)


def test_graph_pool_refuses_non_resources_and_host_memory(torch_mod):
    with pytest.raises(TypeError, match="expected a carve resource"):
        torch_mod.graph_pool(object())
    with pytest.raises(ValueError, match="needs a device resource, not a host resource"):
        torch_mod.graph_pool(carve.HostResource())
    with pytest.raises(ValueError, match="device resource"):
        torch_mod.graph_pool(carve.GraphSafeResource(carve.HostResource()))


def test_graph_pool_wraps_each_upstream_once(torch_mod, monkeypatch):
    # Host memory stands in for a device resource: nothing here allocates.
    monkeypatch.setattr(carve.Resource, "device_accessible", property(lambda self: True))
    up = carve.HostResource()
    _, first, kw = torch_mod.graph_pool(up, use_on_oom=True)
    assert isinstance(first, carve.GraphSafeResource) and first.upstream is up
    assert kw == {"use_on_oom": True}
    _, again, _ = torch_mod.graph_pool(up)
    assert again is first, "one graph-safe resource (one PyTorch slot) per upstream"
    _, other, _ = torch_mod.graph_pool(carve.HostResource())
    assert other is not first
    # A graph-safe resource is used as is.
    _, same, _ = torch_mod.graph_pool(first)
    assert same is first
    # No resource: the current resource of the device.
    monkeypatch.setattr(torch_mod, "get_current_resource", lambda d: up)
    _, default, _ = torch_mod.graph_pool()
    assert default is first
