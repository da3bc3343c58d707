"""A virtual-memory chunk shared with a child process: the parent writes a block through a
DeviceBuffer, exports the chunk holding it, and a fresh interpreter (CUDA needs a new process
to import) maps it with carve.ImportedChunk, checks the bytes and overwrites them."""

import os
import subprocess
import sys

import pytest

import carve

from .conftest import HERE

MIB = 1 << 20
LEN = MIB
CHILD_BYTE = 0x5C


def exportable_virtual():
    try:
        return carve.VirtualMemoryResource(0, maximum_size=64 * MIB, exportable=True)
    except carve.UnsupportedError as e:
        pytest.skip(f"the device does not export virtual memory: {e}")


def test_a_chunk_exported_in_python_is_read_and_written_by_a_child_process():
    r = exportable_virtual()
    data = bytes((i * 7 + 3) & 0xFF for i in range(LEN))
    buf = carve.DeviceBuffer(LEN, r)
    buf.copy_from_host(data)
    assert buf.tobytes() == data  # also waits for the copy
    fd, start, size = r.export_chunk(buf.ptr)
    try:
        offset = buf.ptr - start
        assert 0 <= offset and offset + LEN <= size, (hex(buf.ptr), hex(start), size)
        proc = subprocess.run(
            [sys.executable, os.path.join(HERE, "vm_share_child.py"), str(fd), str(size),
             str(offset), str(LEN)],
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        os.close(fd)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "VM-SHARE-CHILD-OK" in out, out
    assert buf.tobytes() == bytes([CHILD_BYTE]) * LEN, "the child's writes"
    del buf


def test_export_from_the_expandable_pool_and_refusals_on_a_device():
    try:
        e = carve.ExpandableResource(0, maximum_size=256 * MIB, exportable=True)
    except carve.UnsupportedError as err:
        pytest.skip(f"the device does not export virtual memory: {err}")
    for nbytes in (4096, 8 * MIB):  # the small and the large range
        p = e.allocate(nbytes)
        fd, start, size = e.export_chunk(p)
        os.close(fd)
        assert fd >= 0 and start <= p < start + size
        e.deallocate(p, nbytes)
    plain = carve.VirtualMemoryResource(0, maximum_size=64 * MIB)
    q = plain.allocate(MIB)
    with pytest.raises(carve.UnsupportedError):
        plain.export_chunk(q)
    with pytest.raises(carve.BadPointerError):
        plain.export_chunk(q + 128 * MIB)
    plain.deallocate(q, MIB)
