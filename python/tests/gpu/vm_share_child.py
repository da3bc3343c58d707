"""The child of test_vm_share.py: maps the parent's chunk (its descriptor passed open) with
carve.ImportedChunk, checks the parent's bytes and overwrites them for the parent to check.
Copies go through the CUDA driver with ctypes; carve's import left the device's context
current on this thread. Usage: vm_share_child.py FD CHUNK_SIZE OFFSET NBYTES"""

import ctypes
import sys

import carve

CHILD_BYTE = 0x5C


def main():
    fd, size, offset, n = map(int, sys.argv[1:5])
    cuda = ctypes.CDLL("libcuda.so.1")
    with carve.ImportedChunk(fd, size, device=0) as chunk:
        assert chunk.size == size and chunk.device == 0 and not chunk.closed, chunk
        at = ctypes.c_uint64(chunk.ptr + offset)
        host = ctypes.create_string_buffer(n)
        assert cuda.cuMemcpyDtoH_v2(host, at, ctypes.c_size_t(n)) == 0
        expected = bytes((i * 7 + 3) & 0xFF for i in range(n))
        bad = next((i for i in range(n) if host.raw[i] != expected[i]), None)
        assert bad is None, f"byte {bad}: {host.raw[bad]} != {expected[bad]}"
        assert cuda.cuMemsetD8_v2(at, ctypes.c_ubyte(CHILD_BYTE), ctypes.c_size_t(n)) == 0
        assert cuda.cuCtxSynchronize() == 0
    assert chunk.closed
    try:
        chunk.ptr
    except carve.InvalidHandleError:
        pass
    else:
        raise AssertionError("a closed chunk has no address")
    chunk.close()  # closing twice does nothing
    print("VM-SHARE-CHILD-OK")


if __name__ == "__main__":
    main()
