"""The virtual-memory resources and the prefetch adaptor on a device."""

import carve

MIB = 1 << 20


def test_expandable_and_virtual_memory_on_the_device():
    for r in (carve.ExpandableResource(0), carve.VirtualMemoryResource(0, maximum_size=64 * MIB)):
        assert r.device_accessible
        p = r.allocate(3 * MIB)
        r.deallocate(p, 3 * MIB)


def test_prefetch_over_managed_memory_and_graph_safe_over_cuda():
    p_r = carve.PrefetchAdaptor(carve.ManagedResource(0), 0)
    p = p_r.allocate(MIB)
    p_r.deallocate(p, MIB)
    g = carve.GraphSafeResource(carve.CudaResource(0))
    p = g.allocate(MIB)
    g.deallocate(p, MIB)
