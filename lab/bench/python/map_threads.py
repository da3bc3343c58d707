#!/usr/bin/env python3
"""Whether the driver's mapping calls run in parallel: 64 pages of 32 MiB, each created, mapped
and granted access (cuMemCreate, cuMemMap, cuMemSetAccess), from 1, 2, 4 and 8 threads, against
cuMemAlloc of the same bytes in one call and in 64. Driver API through ctypes (no toolkit).

    python3 bench/python/map_threads.py [--pages 64] [--reps 3]
"""

import argparse
import ctypes as C
import threading
import time

MIB = 1 << 20


class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class AllocFlags(C.Structure):
    _fields_ = [
        ("compressionType", C.c_ubyte),
        ("gpuDirectRDMACapable", C.c_ubyte),
        ("usage", C.c_ushort),
        ("reserved", C.c_ubyte * 4),
    ]


class Prop(C.Structure):
    _fields_ = [
        ("type", C.c_int),
        ("requestedHandleTypes", C.c_int),
        ("location", Loc),
        ("win32HandleMetaData", C.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class Access(C.Structure):
    _fields_ = [("location", Loc), ("flags", C.c_int)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cu = C.CDLL("libcuda.so.1")
    u64 = C.c_uint64
    cu.cuMemAddressReserve.argtypes = [C.POINTER(u64), C.c_size_t, C.c_size_t, u64, C.c_ulonglong]
    cu.cuMemCreate.argtypes = [C.POINTER(u64), C.c_size_t, C.POINTER(Prop), C.c_ulonglong]
    cu.cuMemMap.argtypes = [u64, C.c_size_t, C.c_size_t, u64, C.c_ulonglong]
    cu.cuMemSetAccess.argtypes = [u64, C.c_size_t, C.POINTER(Access), C.c_size_t]
    cu.cuMemUnmap.argtypes = [u64, C.c_size_t]
    cu.cuMemRelease.argtypes = [u64]
    cu.cuMemAlloc_v2.argtypes = [C.POINTER(u64), C.c_size_t]
    cu.cuMemFree_v2.argtypes = [u64]

    def ck(r, what):
        if r != 0:
            raise RuntimeError(f"{what}: CUresult {r}")

    ck(cu.cuInit(0), "cuInit")
    dev = C.c_int()
    ck(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
    ctx = C.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    prop = Prop()
    prop.type = 1  # pinned
    prop.location.type = 1  # device
    acc = Access()
    acc.location.type = 1
    acc.flags = 3  # read and write
    page, n = 32 * MIB, args.pages
    base = u64()
    ck(cu.cuMemAddressReserve(C.byref(base), n * page, 0, 0, 0), "cuMemAddressReserve")

    def work(pages, handles):
        ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        for i in pages:
            h = u64()
            ck(cu.cuMemCreate(C.byref(h), page, C.byref(prop), 0), "cuMemCreate")
            va = base.value + i * page
            ck(cu.cuMemMap(va, page, 0, h.value, 0), "cuMemMap")
            ck(cu.cuMemSetAccess(va, page, C.byref(acc), 1), "cuMemSetAccess")
            handles[i] = h.value

    for rep in range(args.reps):
        for threads in (1, 2, 4, 8):
            handles = {}
            ts = [
                threading.Thread(target=work, args=(range(t, n, threads), handles))
                for t in range(threads)
            ]
            t0 = time.perf_counter()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            dt = time.perf_counter() - t0
            print(f"rep {rep} threads {threads}: {n} pages of 32 MiB in {dt * 1e3:.2f} ms "
                  f"({dt / n * 1e6:.1f} us a page)", flush=True)
            ck(cu.cuCtxSynchronize(), "cuCtxSynchronize")
            for i, h in handles.items():
                ck(cu.cuMemUnmap(base.value + i * page, page), "cuMemUnmap")
                ck(cu.cuMemRelease(h), "cuMemRelease")
        p = u64()
        t0 = time.perf_counter()
        ck(cu.cuMemAlloc_v2(C.byref(p), n * page), "cuMemAlloc")
        dt = time.perf_counter() - t0
        ck(cu.cuMemFree_v2(p.value), "cuMemFree")
        print(f"rep {rep} cuMemAlloc of {n * 32} MiB in one call: {dt * 1e3:.2f} ms", flush=True)
        ps = []
        t0 = time.perf_counter()
        for _ in range(n):
            q = u64()
            ck(cu.cuMemAlloc_v2(C.byref(q), page), "cuMemAlloc")
            ps.append(q.value)
        dt = time.perf_counter() - t0
        for q in ps:
            ck(cu.cuMemFree_v2(q), "cuMemFree")
        print(f"rep {rep} cuMemAlloc of 32 MiB, {n} calls: {dt * 1e3:.2f} ms "
              f"({dt / n * 1e6:.1f} us each)", flush=True)


if __name__ == "__main__":
    main()
