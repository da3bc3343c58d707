"""Megatron's unified-memory functions on carve's managed resource: each test checks what the
driver records for the tensor's range (cuMemRangeGetAttribute), not only that the call
returned."""

import gc

import pytest

import carve

from .conftest import need

torch = need("torch")
import carve.torch  # noqa: E402

CPU = -1
attrs = carve.torch.managed_range_attributes


@pytest.fixture
def unified():
    """A unified mempool, entered; yields it."""
    pool = carve.torch.create_unified_mempool()
    with torch.cuda.use_mem_pool(pool):
        yield pool
    torch.cuda.synchronize()
    gc.collect()


def test_the_unified_pool_hands_out_managed_memory(unified):
    t = torch.ones(1 << 20, device="cuda")
    assert carve._carve.managed_is_managed(t.data_ptr(), t.numel() * 4)
    assert all(seg["total_size"] > 0 for seg in unified.snapshot())
    assert int(t.sum().item()) == 1 << 20


def test_prefetch_records_the_gpu_then_the_cpu_as_last_prefetch_location(unified):
    t = torch.ones(1 << 20, device="cuda")
    ptr = t.data_ptr()
    carve.torch.prefetch_managed_tensor(t, device=0)
    torch.cuda.synchronize()
    assert attrs(t)["last_prefetch_location"] == 0
    s = torch.cuda.Stream()
    carve.torch.prefetch_managed_tensor(t, device=CPU, stream=s)
    s.synchronize()
    assert attrs(t)["last_prefetch_location"] == CPU
    assert t.data_ptr() == ptr  # the address never changes
    assert int(t.sum().item()) == 1 << 20


def test_advice_shows_in_the_range_attributes(unified):
    t = torch.zeros(1 << 20, device="cuda")
    carve.torch.advise_managed_tensor_preferred_location(t, device=CPU)
    assert attrs(t)["preferred_location"] == CPU
    carve.torch.advise_managed_tensor_preferred_location(t, device=0)
    assert attrs(t)["preferred_location"] == 0
    carve.torch.advise_managed_tensor_accessed_by(t, device=0)
    assert 0 in attrs(t)["accessed_by"]
    with pytest.raises(ValueError):
        carve.torch.advise_managed_tensor_accessed_by(t, device=CPU)


def test_module_prefetch_returns_the_bytes_and_moves_every_parameter(unified):
    m = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.BatchNorm1d(512)).cuda()
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    buffers = sum(b.numel() * b.element_size() for b in m.buffers())
    assert carve.torch.prefetch_managed_module_parameters(m, device=CPU) == params
    torch.cuda.synchronize()
    assert all(attrs(p)["last_prefetch_location"] == CPU for p in m.parameters())
    got = carve.torch.prefetch_managed_module_parameters(m, device=0, include_buffers=True)
    assert got == params + buffers
    torch.cuda.synchronize()
    assert all(attrs(t)["last_prefetch_location"] == 0 for t in [*m.parameters(), *m.buffers()])
    carve.torch.advise_managed_module_parameters_preferred_location(
        m, device=CPU, include_buffers=True
    )
    assert all(attrs(t)["preferred_location"] == CPU for t in [*m.parameters(), *m.buffers()])


def test_memory_outside_the_pool_is_refused_or_skipped():
    t = torch.ones(1 << 20, device="cuda")  # PyTorch's own allocator: device memory
    with pytest.raises(carve.BadPointerError):
        carve.torch.prefetch_managed_tensor(t, device=0)
    m = torch.nn.Linear(64, 64).cuda()
    assert carve.torch.prefetch_managed_module_parameters(m, device=0) == 0
    with pytest.raises(TypeError):
        carve.torch.prefetch_managed_tensor("not a tensor", device=0)
    with pytest.raises(ValueError):
        carve.torch.prefetch_managed_tensor(t, device=-2)
