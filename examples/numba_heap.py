#!/usr/bin/env python3
"""Numba @cuda.jit kernels that allocate and free from carve's device heap.

- ``carve.ptx_path()`` writes carve's PTX, which exports the heap's device functions, to a
  file that Numba links (``cuda.jit(link=[...])``). Numba calls foreign functions with its own
  convention (``int f(T *result, args...)``), so the kernels declare the ``carve_numba_*`` forms.
- ``carve.DeviceHeap.slab(resource, capacity, block_size)`` and ``.bump(resource, capacity)``
  reserve and format a heap from any device-accessible carve resource; kernels get its
  ``address`` as a ``uint64``, and ``heap.stats()`` reads the statistics back.

Run it (needs a GPU, the carve package, numba-cuda and numpy):

    pip install ./python
    python3 examples/numba_heap.py

It checks its own results and exits non-zero on any mismatch.
"""

import argparse
import sys

import numpy as np

if not hasattr(np, "row_stack"):
    # numba-cuda 0.30 overloads np.row_stack when it first compiles a kernel; NumPy removed it.
    np.row_stack = np.vstack

import carve  # noqa: E402
from numba import cuda, types  # noqa: E402 (after the shim above)

try:  # numba-cuda keeps its own extension API; older Numba has only the core one.
    from numba.cuda.extending import intrinsic
except ImportError:
    from numba.extending import intrinsic

THREADS_PER_BLOCK = 256

# carve_heap.h's functions under Numba's calling convention; heaps and blocks are addresses.
slab_alloc = cuda.declare_device("carve_numba_slab_alloc", "uint64(uint64)")
slab_free = cuda.declare_device("carve_numba_slab_free", "void(uint64, uint64)")
bump_alloc = cuda.declare_device("carve_numba_bump_alloc", "uint64(uint64, uint64, uint64)")
# Every thread of the block calls (as cuda.syncthreads): one reservation for the block.
bump_alloc_block = cuda.declare_device(
    "carve_numba_bump_alloc_block", "uint64(uint64, uint64, uint64)"
)
# General heaps (DeviceHeap::general): any size from 1 byte to 64 KiB; free finds the class.
malloc = cuda.declare_device("carve_numba_malloc", "uint64(uint64, uint64)")
free = cuda.declare_device("carve_numba_free", "void(uint64, uint64)")


@intrinsic
def words_at(typingctx, addr):
    """The block at device address `addr`, as a pointer to 32-bit words."""
    ptr = types.CPointer(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptr))

    return ptr(types.uint64), codegen


@cuda.jit(device=True)
def pattern(i, k):
    return np.uint32((i * 2654435761 + k * 16843009) & 0xFFFFFFFF)


def build_kernels(ptx_path):
    """The kernels, linked with carve's PTX at `ptx_path`."""

    @cuda.jit(link=[ptx_path])
    def slab_alloc_fill(heap, out, words):
        i = cuda.grid(1)
        if i < out.size:
            p = slab_alloc(heap)
            out[i] = p
            if p != 0:
                w = words_at(p)
                for k in range(words):
                    w[k] = pattern(i, k)

    @cuda.jit(link=[ptx_path])
    def slab_check_free(heap, ptrs, words, bad):
        i = cuda.grid(1)
        if i < ptrs.size and ptrs[i] != 0:
            w = words_at(ptrs[i])
            for k in range(words):
                if w[k] != pattern(i, k):
                    cuda.atomic.add(bad, 0, 1)
                    break
            slab_free(heap, ptrs[i])

    @cuda.jit(link=[ptx_path])
    def bump_alloc_fill(heap, out, nbytes, align):
        i = cuda.grid(1)
        if i < out.size:
            p = bump_alloc(heap, nbytes, align)
            out[i] = p
            if p != 0:
                w = words_at(p)
                for k in range(nbytes // 4):
                    w[k] = pattern(i, k)

    @cuda.jit(link=[ptx_path])
    def bump_check(ptrs, nbytes, align, bad):
        i = cuda.grid(1)
        if i < ptrs.size and ptrs[i] != 0:
            ok = ptrs[i] % align == 0
            w = words_at(ptrs[i])
            for k in range(nbytes // 4):
                ok = ok and w[k] == pattern(i, k)
            if not ok:
                cuda.atomic.add(bad, 0, 1)

    return slab_alloc_fill, slab_check_free, bump_alloc_fill, bump_check


failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += 0 if ok else 1


def blocks(n):
    return (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK


def slab_demo(kernels, resource, capacity):
    alloc_fill, check_free = kernels[0], kernels[1]
    block = 64
    words = block // 4
    heap = carve.DeviceHeap.slab(resource, capacity, block)
    address = np.uint64(heap.address)  # a uint64 kernel argument, like the blocks
    bad = cuda.to_device(np.zeros(1, dtype=np.uint32))

    n = 2 * capacity
    out = cuda.device_array(n, dtype=np.uint64)
    alloc_fill[blocks(n), THREADS_PER_BLOCK](address, out, words)
    ptrs = out.copy_to_host()
    live = np.sort(ptrs[ptrs != 0])
    check(live.size == capacity, f"slab: {live.size} of {n} requests served, capacity {capacity}")
    check(np.all(np.diff(live) >= block), "slab: no two blocks overlap")
    cuda.synchronize()
    s = heap.stats()
    print(f"     stats after allocating: {s}")
    check(s["in_use"] == capacity and s["failed_allocs"] == capacity, "slab: stats count K in use, K failed")

    check_free[blocks(n), THREADS_PER_BLOCK](address, out, words, bad)
    check(bad.copy_to_host()[0] == 0, "slab: every block kept its pattern")
    cuda.synchronize()
    s = heap.stats()
    print(f"     stats after freeing:    {s}")
    check(s["in_use"] == 0 and s["double_frees"] == 0 and s["foreign_frees"] == 0, "slab: all freed, none twice")

    again = cuda.device_array(capacity, dtype=np.uint64)
    alloc_fill[blocks(capacity), THREADS_PER_BLOCK](address, again, words)
    served = int(np.count_nonzero(again.copy_to_host()))
    check(served == capacity, f"slab: after exhaustion and frees, {served} of {capacity} served again")
    check_free[blocks(capacity), THREADS_PER_BLOCK](address, again, words, bad)
    cuda.synchronize()
    s = heap.stats()
    check(s["in_use"] == 0 and bad.copy_to_host()[0] == 0, "slab: second round freed cleanly")


def bump_demo(kernels, resource, n):
    alloc_fill, bump_check = kernels[2], kernels[3]
    nbytes, align = 48, np.uint64(64)  # uint64: `address % align` stays integral
    heap = carve.DeviceHeap.bump(resource, n * 80)
    address = np.uint64(heap.address)
    bad = cuda.to_device(np.zeros(1, dtype=np.uint32))
    out = cuda.device_array(n, dtype=np.uint64)
    alloc_fill[blocks(n), THREADS_PER_BLOCK](address, out, nbytes, align)
    ptrs = out.copy_to_host()
    live = np.sort(ptrs[ptrs != 0])
    check(live.size == n, f"bump: {live.size} of {n} requests of {nbytes} B served")
    check(np.all(np.diff(live) >= nbytes) and np.all(live % align == 0), "bump: ranges disjoint and aligned")
    bump_check[blocks(n), THREADS_PER_BLOCK](out, nbytes, align, bad)
    check(bad.copy_to_host()[0] == 0, "bump: every range kept its pattern")
    cuda.synchronize()
    s = heap.stats()
    print(f"     stats: {s}")
    check(s["failed_allocs"] == 0 and n * nbytes <= s["in_use"] <= n * 80, "bump: stats agree")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capacity", type=int, default=1 << 20, help="slab blocks / bump ranges")
    args = ap.parse_args()
    if not cuda.is_available():
        sys.exit("no CUDA GPU visible to Numba")
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}, numpy {np.__version__}")
    resource = carve.PoolResource(carve.CudaResource(0))
    kernels = build_kernels(carve.ptx_path())
    slab_demo(kernels, resource, args.capacity)
    bump_demo(kernels, resource, args.capacity)
    print(f"{failures} check(s) failed" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
