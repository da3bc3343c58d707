#!/usr/bin/env python3
"""Numba @cuda.jit kernels that allocate and free from carve's device heap.

- carve's PTX exports the heap's device functions; `carve heap-ptx` writes it to a file that
  Numba links (`cuda.jit(link=[...])`). Numba calls foreign functions with its own convention
  (`int f(T *result, args...)`), so the kernels declare the `carve_numba_*` forms.
- The heap lives in a Numba device array, formatted as carve's DeviceHeap formats its own
  regions: zero it, then write the 128-byte handle that `carve heap-layout ... --base ADDR`
  prints for its address. `carve heap-layout ... --stats FILE` decodes the statistics from a
  copy of the region's prefix.

Run it (needs a GPU, numba-cuda and numpy):

    cargo build --release
    python3 examples/numba_heap.py --carve target/release/carve

It checks its own results and exits non-zero on any mismatch.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

if not hasattr(np, "row_stack"):
    # numba-cuda 0.30 overloads np.row_stack when it first compiles a kernel; NumPy removed it.
    np.row_stack = np.vstack

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


class Heap:
    """A carve heap in a Numba device array, formatted through `carve heap-layout`."""

    def __init__(self, carve, kind_args, workdir):
        self.carve, self.kind_args, self.workdir = carve, kind_args, workdir
        layout = self._layout()
        self.bytes, self.stats_bytes = layout["bytes"], layout["stats_bytes"]
        align = layout["align"]
        self.mem = cuda.device_array(self.bytes + align, dtype=np.uint8)
        raw = self.mem.__cuda_array_interface__["data"][0]
        self.offset = (-raw) % align
        self.address = np.uint64(raw + self.offset)  # a uint64 kernel argument, like the blocks
        handle = bytes.fromhex(self._layout("--base", hex(int(self.address)))["handle"])
        host = np.zeros(self.mem.size, dtype=np.uint8)
        host[self.offset : self.offset + len(handle)] = np.frombuffer(handle, dtype=np.uint8)
        self.mem.copy_to_device(host)

    def _layout(self, *extra):
        cmd = [self.carve, "heap-layout", *self.kind_args, *extra]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    def stats(self):
        cuda.synchronize()
        prefix = self.mem[self.offset : self.offset + self.stats_bytes].copy_to_host()
        path = os.path.join(self.workdir, "prefix.bin")
        prefix.tofile(path)
        return self._layout("--stats", path)["stats"]


failures = 0


def check(ok, what):
    global failures
    print(("ok   " if ok else "FAIL ") + what)
    failures += 0 if ok else 1


def blocks(n):
    return (n + THREADS_PER_BLOCK - 1) // THREADS_PER_BLOCK


def slab_demo(kernels, carve, workdir):
    alloc_fill, check_free = kernels[0], kernels[1]
    capacity, block = 1 << 20, 64
    words = block // 4
    heap = Heap(carve, ["slab", "--capacity", str(capacity), "--block-size", str(block)], workdir)
    bad = cuda.to_device(np.zeros(1, dtype=np.uint32))

    n = 2 * capacity
    out = cuda.device_array(n, dtype=np.uint64)
    alloc_fill[blocks(n), THREADS_PER_BLOCK](heap.address, out, words)
    ptrs = out.copy_to_host()
    live = np.sort(ptrs[ptrs != 0])
    check(live.size == capacity, f"slab: {live.size} of {n} requests served, capacity {capacity}")
    check(np.all(np.diff(live) >= block), "slab: no two blocks overlap")
    s = heap.stats()
    print(f"     stats after allocating: {s}")
    check(s["in_use"] == capacity and s["failed_allocs"] == capacity, "slab: stats count K in use, K failed")

    check_free[blocks(n), THREADS_PER_BLOCK](heap.address, out, words, bad)
    check(bad.copy_to_host()[0] == 0, "slab: every block kept its pattern")
    s = heap.stats()
    print(f"     stats after freeing:    {s}")
    check(s["in_use"] == 0 and s["double_frees"] == 0 and s["foreign_frees"] == 0, "slab: all freed, none twice")

    again = cuda.device_array(capacity, dtype=np.uint64)
    alloc_fill[blocks(capacity), THREADS_PER_BLOCK](heap.address, again, words)
    served = int(np.count_nonzero(again.copy_to_host()))
    check(served == capacity, f"slab: after exhaustion and frees, {served} of {capacity} served again")
    check_free[blocks(capacity), THREADS_PER_BLOCK](heap.address, again, words, bad)
    s = heap.stats()
    check(s["in_use"] == 0 and bad.copy_to_host()[0] == 0, "slab: second round freed cleanly")


def bump_demo(kernels, carve, workdir):
    alloc_fill, bump_check = kernels[2], kernels[3]
    n, nbytes, align = 1 << 20, 48, np.uint64(64)  # uint64: `address % align` stays integral
    heap = Heap(carve, ["bump", "--capacity", str(n * 80)], workdir)
    bad = cuda.to_device(np.zeros(1, dtype=np.uint32))
    out = cuda.device_array(n, dtype=np.uint64)
    alloc_fill[blocks(n), THREADS_PER_BLOCK](heap.address, out, nbytes, align)
    ptrs = out.copy_to_host()
    live = np.sort(ptrs[ptrs != 0])
    check(live.size == n, f"bump: {live.size} of {n} requests of {nbytes} B served")
    check(np.all(np.diff(live) >= nbytes) and np.all(live % align == 0), "bump: ranges disjoint and aligned")
    bump_check[blocks(n), THREADS_PER_BLOCK](out, nbytes, align, bad)
    check(bad.copy_to_host()[0] == 0, "bump: every range kept its pattern")
    s = heap.stats()
    print(f"     stats: {s}")
    check(s["failed_allocs"] == 0 and n * nbytes <= s["in_use"] <= n * 80, "bump: stats agree")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--carve", default=os.environ.get("CARVE") or shutil.which("carve") or "target/release/carve",
                    help="the carve binary (default: $CARVE, carve on PATH, target/release/carve)")
    args = ap.parse_args()
    if not cuda.is_available():
        sys.exit("no CUDA GPU visible to Numba")
    name = cuda.get_current_device().name
    print(f"device: {name.decode() if isinstance(name, bytes) else name}, numpy {np.__version__}")
    with tempfile.TemporaryDirectory() as workdir:
        ptx = os.path.join(workdir, "carve.ptx")
        subprocess.run([args.carve, "heap-ptx", "--out", ptx], check=True)
        kernels = build_kernels(ptx)
        slab_demo(kernels, args.carve, workdir)
        bump_demo(kernels, args.carve, workdir)
    print(f"{failures} check(s) failed" if failures else "all checks passed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
