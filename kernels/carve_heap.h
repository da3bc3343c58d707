/* carve's device heap, callable from CUDA C++ device code.
 *
 * The functions below are `.visible .func` symbols of carve's PTX module (carve::driver::PTX).
 * Compile your kernel with `nvcc -rdc=true -ptx`, then JIT-link both PTX texts with
 * cuLinkCreate / cuLinkAddData / cuLinkComplete. The heap itself is created on the host with
 * carve::DeviceHeap::{slab, bump}; pass DeviceHeap::device_ptr() to your kernel as `heap`.
 *
 * Semantics. All but carve_bump_alloc_block are warp-cooperative: lanes that call together
 * share the atomics. Any subset of a warp's lanes may call, each with its own arguments: lanes
 * may pass different heaps, NULL, or a heap of another kind. The lanes are grouped by heap
 * first; each group's collectives name its own lanes only, and a lane whose heap is NULL or of
 * another kind gets NULL (or frees nothing) without leaving the others' collectives.
 *   carve_slab_alloc(heap)            one block of the slab's block size; NULL when exhausted or
 *                                     when `heap` is not a slab. Blocks are aligned to 16 bytes,
 *                                     or to the block size when it is a power of two (<= 4096).
 *   carve_slab_free(heap, p)          returns a block. NULL is ignored. A pointer that is not a
 *                                     block of the heap (outside it, inside a block, misaligned,
 *                                     another heap's) is counted (foreign_frees) and ignored. A
 *                                     second free of a block that is still free is ignored, and
 *                                     counted (double_frees) on checked heaps (the default).
 *                                     A second free after the block was handed out again cannot
 *                                     be told from its new owner's free: it frees the new
 *                                     owner's block, uncounted (the new owner's own free is then
 *                                     the one counted as a double free).
 *   carve_bump_alloc(heap, n, align)  n bytes aligned to align (a power of two <= 4096); NULL when
 *                                     exhausted, n == 0, a bad alignment, or `heap` not a bump.
 *                                     Released all at once by DeviceHeap::reset on the host.
 *   carve_bump_alloc_block(heap, n, align)
 *                                     as carve_bump_alloc, but called by every thread of the
 *                                     block (as __syncthreads) with the same heap, each with
 *                                     its own n: one reservation for the whole block. When it
 *                                     does not fit, every thread of the block gets NULL.
 *   carve_malloc(heap, n)             n bytes (1 to 16 MiB) from a general heap
 *                                     (DeviceHeap::general): a block of the smallest size class
 *                                     that holds n (four classes per power of two up to 64 KiB,
 *                                     then whole power-of-two blocks), aligned to 16 bytes (to
 *                                     the class size when it is a power of two, up to 4096).
 *                                     NULL when the class is exhausted or not in use for this
 *                                     heap, n == 0, or `heap` is not a general heap.
 *   carve_free(heap, p)               returns a carve_malloc block; the class is found from p.
 *                                     NULL is ignored; other pointers are counted and ignored.
 *                                     Double frees as for carve_slab_free: counted while the
 *                                     block is free, undetectable once it is handed out again
 *                                     (the stale free frees the new owner's block).
 * None of them traps or unwinds; failures are counted in DeviceHeap::stats().
 *
 * The module exports exactly these functions and nothing else (tests/no_gpu.rs checks it): the
 * six above and their Numba-convention forms, carve_numba_slab_alloc, carve_numba_slab_free,
 * carve_numba_bump_alloc, carve_numba_bump_alloc_block, carve_numba_malloc and carve_numba_free (int f(T *result, args...),
 * returning 0), for cuda.declare_device;
 * see examples/numba_heap.py.
 * A heap in memory that carve did not allocate (a Python device array) is formatted with
 * carve::heap::ForeignHeapPlan or `carve heap-layout`: zero the region, write the handle.
 */
#ifndef CARVE_HEAP_H
#define CARVE_HEAP_H

#include <stddef.h>
#include <stdint.h>

/* Opaque: the first 128 bytes of a heap region (carve_kernels::heap_layout::HeapHandle). */
typedef struct carve_heap carve_heap_t;

#ifdef __cplusplus
extern "C" {
#endif

__device__ void *carve_slab_alloc(const carve_heap_t *heap);
__device__ void carve_slab_free(const carve_heap_t *heap, void *ptr);
__device__ void *carve_bump_alloc(const carve_heap_t *heap, uint64_t bytes, uint64_t align);
__device__ void *carve_bump_alloc_block(const carve_heap_t *heap, uint64_t bytes, uint64_t align);
__device__ void *carve_malloc(const carve_heap_t *heap, uint64_t bytes);
__device__ void carve_free(const carve_heap_t *heap, void *ptr);

/* Numba's calling convention: the result goes to *ret, the return value is 0 (no exception). */
__device__ int carve_numba_slab_alloc(uint64_t *ret, const carve_heap_t *heap);
__device__ int carve_numba_slab_free(uint64_t *ret, const carve_heap_t *heap, void *ptr);
__device__ int carve_numba_bump_alloc(uint64_t *ret, const carve_heap_t *heap, uint64_t bytes,
                                      uint64_t align);
__device__ int carve_numba_bump_alloc_block(uint64_t *ret, const carve_heap_t *heap,
                                            uint64_t bytes, uint64_t align);
__device__ int carve_numba_malloc(uint64_t *ret, const carve_heap_t *heap, uint64_t bytes);
__device__ int carve_numba_free(uint64_t *ret, const carve_heap_t *heap, void *ptr);

#ifdef __cplusplus
}
#endif

#endif /* CARVE_HEAP_H */
