// CUDA C++ kernels that allocate from a carve device heap created by Rust host code.
// tests/interop_cuda_cpp_gpu.rs compiles this with `nvcc -rdc=true -ptx`, JIT-links it with carve's
// PTX, and launches it. Each thread owns at most one block: it allocates and fills it in one
// launch; a second launch checks the pattern and frees (slab) or only checks (bump).
#include "carve_heap.h"

typedef unsigned long long u64;

// The k-th word of thread i's pattern.
__device__ __forceinline__ unsigned pattern(u64 i, u64 k) {
    return (unsigned)(i * 2654435761ull) ^ (unsigned)(k * 0x01010101u) ^ 0xC0FFEEu;
}

__device__ __forceinline__ void fill(unsigned *p, u64 i, u64 bytes) {
    for (u64 k = 0; k < bytes / 4; ++k) p[k] = pattern(i, k);
}

__device__ __forceinline__ bool intact(const unsigned *p, u64 i, u64 bytes) {
    bool ok = true;
    for (u64 k = 0; k < bytes / 4; ++k) ok &= p[k] == pattern(i, k);
    return ok;
}

// Thread i < n allocates a slab block into out[i] (0 when the heap is exhausted) and fills it.
extern "C" __global__ void cpp_slab_alloc_fill(const carve_heap_t *heap, u64 *out, u64 n,
                                               u64 bytes) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned *p = (unsigned *)carve_slab_alloc(heap);
    out[i] = (u64)p;
    if (p) fill(p, i, bytes);
}

// Thread i < n with a block checks its pattern (mismatches counted into bad[0]) and frees it.
extern "C" __global__ void cpp_slab_check_free(const carve_heap_t *heap, const u64 *ptrs, u64 n,
                                               u64 bytes, unsigned *bad) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned *p = (unsigned *)ptrs[i];
    if (!p) return;
    if (!intact(p, i, bytes)) atomicAdd(bad, 1u);
    carve_slab_free(heap, p);
}

// Thread i < n bump-allocates `bytes` aligned to `align` into out[i] and fills it.
extern "C" __global__ void cpp_bump_alloc_fill(const carve_heap_t *heap, u64 *out, u64 n,
                                               u64 bytes, u64 align) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned *p = (unsigned *)carve_bump_alloc(heap, bytes, align);
    out[i] = (u64)p;
    if (p) fill(p, i, bytes);
}

// Counts into bad[0] the threads whose range lost its pattern or its alignment.
extern "C" __global__ void cpp_bump_check(const u64 *ptrs, u64 n, u64 bytes, u64 align,
                                          unsigned *bad) {
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned *p = (const unsigned *)ptrs[i];
    if (!p) return;
    if ((u64)p % align != 0 || !intact(p, i, bytes)) atomicAdd(bad, 1u);
}
