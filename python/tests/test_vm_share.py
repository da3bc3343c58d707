"""Sharing virtual-memory chunks between processes, without a GPU: every error path of
``export_chunk`` and ``carve.ImportedChunk`` is carve's typed error (tests/gpu/test_vm_share.py
shares a chunk with a child process)."""

import os

import pytest

import carve

MIB = 1 << 20


@pytest.mark.parametrize(
    "make",
    [
        lambda: carve.VirtualMemoryResource.over_host(maximum_size=16 * MIB),
        lambda: carve.ExpandableResource.over_host(maximum_size=16 * MIB),
    ],
    ids=["virtual", "expandable"],
)
def test_export_refuses_foreign_pointers_and_host_backings(make):
    r = make()
    p = r.allocate(4096)
    try:
        # A live block reaches the backing; host memory files are not exported.
        with pytest.raises(carve.UnsupportedError, match="does not export"):
            r.export_chunk(p)
        with pytest.raises(carve.BadPointerError):
            r.export_chunk(p + 8 * MIB)
        with pytest.raises(carve.BadPointerError, match="null pointer"):
            r.export_chunk(0)
        with pytest.raises(TypeError):
            r.export_chunk("not a pointer")
    finally:
        r.deallocate(p, 4096)


def test_other_resources_do_not_export():
    h = carve.HostResource()
    p = h.allocate(64)
    with pytest.raises(carve.UnsupportedError, match="a host resource does not export chunks"):
        carve._carve.vm_export_chunk(h._r, p)
    h.deallocate(p, 64)
    assert not hasattr(carve.PoolResource(h), "export_chunk")


def test_imported_chunk_refuses_bad_arguments():
    with pytest.raises(carve.InvalidArgumentError, match="file descriptor -1"):
        carve.ImportedChunk(-1, 2 * MIB)
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(carve.InvalidArgumentError, match="size of zero"):
            carve.ImportedChunk(fd, 0)
        # Not a chunk: no device here, or the driver refuses the descriptor.
        with pytest.raises(carve.CarveError):
            carve.ImportedChunk(fd, 2 * MIB)
        with pytest.raises(OverflowError):
            carve.ImportedChunk(fd, 2 * MIB, device=-1)
    finally:
        os.close(fd)


@pytest.mark.skipif(carve.is_available(), reason="checks the error without a device")
def test_exportable_device_resources_need_a_device():
    with pytest.raises(carve.NoDeviceError):
        carve.VirtualMemoryResource(0, exportable=True)
    with pytest.raises(carve.NoDeviceError):
        carve.ExpandableResource(0, exportable=True)
