/* carve's host C ABI: composable, stream-ordered CUDA memory resources.
 *
 * Link with libcarve_capi.so (cargo build --release -p carve-capi), or load the Python
 * extension module (carve.lib_path()), which exports the same symbols.
 *
 * Conventions
 * - Every function that can fail returns an int: CARVE_OK (0) or a CARVE_ERROR_* code, and
 *   sets this thread's message, read with carve_last_error(). Nothing unwinds into C: a panic
 *   inside carve is caught and returned as CARVE_ERROR_PANIC.
 * - Resources are opaque handles. A null, destroyed or never-created handle is
 *   CARVE_ERROR_INVALID_HANDLE, never a crash. Destroying a handle drops the caller's
 *   reference only: adaptors built over a resource, the current-resource table and blocks
 *   handed to frameworks keep it alive.
 * - Optional sizes take CARVE_SIZE_NONE for "no bound".
 * - Streams are CUstream / cudaStream_t values; NULL is the legacy default stream. Host
 *   resources ignore streams.
 */
#ifndef CARVE_H
#define CARVE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h> /* ssize_t */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct carve_resource_opaque *carve_resource_t;
typedef void *carve_stream_t;

typedef struct carve_stat {
    const char *name; /* static string */
    double value;     /* bytes and counts are exact below 2^53 */
} carve_stat_t;

enum {
    CARVE_OK = 0,
    CARVE_ERROR_INVALID_HANDLE = 1,   /* null, destroyed or forged handle */
    CARVE_ERROR_INVALID_ARGUMENT = 2, /* zero size, bad alignment, null output pointer, ... */
    CARVE_ERROR_OUT_OF_MEMORY = 3,
    CARVE_ERROR_NO_DEVICE = 4,        /* no driver, no device, ordinal out of range */
    CARVE_ERROR_DRIVER = 5,           /* a CUDA driver call failed */
    CARVE_ERROR_BAD_POINTER = 6,      /* foreign pointer, double free, size mismatch */
    CARVE_ERROR_UNSUPPORTED = 7,
    CARVE_ERROR_IO = 8,
    CARVE_ERROR_PANIC = 9
};

#define CARVE_SIZE_NONE ((size_t)-1)

/* Pinned-memory flags (carve_pinned_resource_create). */
#define CARVE_PINNED_PORTABLE 1u
#define CARVE_PINNED_DEVICE_MAPPED 2u
#define CARVE_PINNED_WRITE_COMBINED 4u

/* ---- errors ---- */
/* This thread's last error message ("" if none); valid until the next failing call. */
const char *carve_last_error(void);
/* "CARVE_OK", "CARVE_ERROR_OUT_OF_MEMORY", ... ("CARVE_ERROR_UNKNOWN" otherwise). */
const char *carve_error_name(int code);

/* ---- resources ---- */
int carve_cuda_resource_create(int device, carve_resource_t *out);
int carve_managed_resource_create(int device, carve_resource_t *out);
int carve_pinned_resource_create(int device, unsigned flags, carve_resource_t *out);
/* A new driver pool (cuMemPoolCreate); release_threshold, hard_limit: CARVE_SIZE_NONE. */
int carve_async_resource_create(int device, size_t initial_size, size_t release_threshold,
                                size_t hard_limit, carve_resource_t *out);
/* Pageable host memory: no GPU needed; tracks its blocks (foreign and double frees fail). */
int carve_host_resource_create(carve_resource_t *out);
/* Suballocators over any upstream. */
int carve_pool_resource_create(carve_resource_t upstream, size_t initial_size,
                               size_t maximum_size, carve_resource_t *out);
int carve_binning_resource_create(carve_resource_t upstream, unsigned min_exp, unsigned max_exp,
                                  carve_resource_t *out);
/* superblock_size, arenas: 0 picks the defaults; more than 4096 arenas is
 * CARVE_ERROR_INVALID_ARGUMENT. */
int carve_arena_resource_create(carve_resource_t upstream, size_t superblock_size, size_t arenas,
                                size_t maximum_size, carve_resource_t *out);
/* blocks_per_refill: 0 picks the default. */
int carve_fixed_size_resource_create(carve_resource_t upstream, size_t block_size,
                                     unsigned blocks_per_refill, carve_resource_t *out);
/* Adaptors. */
int carve_limiting_adaptor_create(carve_resource_t upstream, size_t limit, carve_resource_t *out);
int carve_statistics_adaptor_create(carve_resource_t upstream, carve_resource_t *out);
int carve_tracking_adaptor_create(carve_resource_t upstream, int capture_backtraces,
                                  carve_resource_t *out);
/* RMM's CSV log, to a new file at path. */
int carve_logging_adaptor_create(carve_resource_t upstream, const char *path, int auto_flush,
                                 carve_resource_t *out);
/* Virtual memory (the driver's cuMemCreate/cuMemMap on device; the *_host variants map
 * Linux memory files with pages of granularity bytes, no GPU needed, and need a maximum).
 * Sizes: CARVE_SIZE_NONE picks the default. The expandable pool (PyTorch's
 * expandable_segments): requests up to small_limit go to pages of small_chunk bytes, larger
 * ones to pages of large_chunk; headroom: growth above the most bytes ever live, a fraction
 * in [0, 1] (CARVE_HEADROOM_DEFAULT: 0.05). */
#define CARVE_HEADROOM_DEFAULT (-1.0)
/* flags of the device constructors, or-ed: CARVE_VM_EXPORTABLE for chunks that
 * carve_vm_export_chunk can hand to other processes (CARVE_ERROR_UNSUPPORTED where the device
 * has no POSIX file-descriptor handles); CARVE_VM_FABRIC for chunks with fabric handles too
 * (multi-node NVLink; CARVE_ERROR_UNSUPPORTED where the device cannot create them, e.g. no
 * IMEX channel), or CARVE_VM_FABRIC_WHERE_SUPPORTED for them only where it can, as NCCL
 * chooses; CARVE_VM_RECOMMENDED_GRANULARITY for chunks at the driver's recommended rather than
 * minimum granularity. Memory to register with NCCL: CARVE_VM_EXPORTABLE |
 * CARVE_VM_FABRIC_WHERE_SUPPORTED | CARVE_VM_RECOMMENDED_GRANULARITY. Other bits, or both
 * fabric flags, are CARVE_ERROR_INVALID_ARGUMENT. */
#define CARVE_VM_EXPORTABLE 1u
#define CARVE_VM_FABRIC 2u
#define CARVE_VM_RECOMMENDED_GRANULARITY 4u
#define CARVE_VM_FABRIC_WHERE_SUPPORTED 8u
int carve_expandable_resource_create(int device, size_t maximum, size_t small_limit,
                                     size_t small_chunk, size_t large_chunk, double headroom,
                                     unsigned flags, carve_resource_t *out);
int carve_expandable_host_resource_create(size_t granularity, size_t maximum,
                                          size_t small_limit, size_t small_chunk,
                                          size_t large_chunk, double headroom,
                                          carve_resource_t *out);
/* Whole-chunk virtual memory: chunk_size a power-of-two multiple of the granularity,
 * reserve the address space (four times maximum by default). */
int carve_virtual_resource_create(int device, size_t maximum, size_t chunk_size, size_t reserve,
                                  unsigned flags, carve_resource_t *out);
int carve_virtual_host_resource_create(size_t granularity, size_t maximum, size_t chunk_size,
                                       size_t reserve, carve_resource_t *out);
/* Allocation inside CUDA graph capture: captured requests come from a pool per capture. */
int carve_graph_safe_resource_create(carve_resource_t upstream, carve_resource_t *out);
/* Aligns requests of threshold bytes or more to alignment (a power of two). */
int carve_aligned_adaptor_create(carve_resource_t upstream, size_t alignment, size_t threshold,
                                 carve_resource_t *out);
/* Prefetches (managed) blocks to device after each allocation. */
int carve_prefetch_adaptor_create(carve_resource_t upstream, int device, carve_resource_t *out);
/* Asked on out-of-memory with the request's size; non-zero retries. Called from any thread
 * that allocates, while the adaptor lives; must not throw or longjmp. */
typedef int (*carve_failure_callback_t)(size_t bytes, void *user_data);
int carve_failure_callback_adaptor_create(carve_resource_t upstream,
                                          carve_failure_callback_t callback, void *user_data,
                                          carve_resource_t *out);
/* Forgets r. Blocks allocated through r can no longer be freed through it
 * (CARVE_ERROR_INVALID_HANDLE): free them first. Destroying a handle twice is
 * CARVE_ERROR_INVALID_HANDLE, also after a new resource took its slot. */
int carve_resource_destroy(carve_resource_t r);
/* "cuda", "pool", "statistics", ... ("current" for a resource found as current); NULL on a
 * bad handle. */
const char *carve_resource_kind(carve_resource_t r);

/* ---- allocation ---- */
/* alignment: a power of two (256 is always honoured). */
int carve_allocate(carve_resource_t r, size_t bytes, size_t alignment, carve_stream_t stream,
                   void **out);
int carve_deallocate(carve_resource_t r, void *ptr, size_t bytes, size_t alignment,
                     carve_stream_t stream);

/* ---- sharing virtual memory between processes (POSIX) ---- */
typedef struct carve_chunk_opaque *carve_chunk_t;
/* The physical chunk holding ptr, a live block of r (a virtual or expandable resource created
 * with CARVE_VM_EXPORTABLE): *fd gets a new descriptor (the caller's to close; send it to
 * another process, e.g. with SCM_RIGHTS), *chunk_start and *chunk_size the chunk's range. A
 * block larger than a chunk spans several: export each. A pointer r did not hand out is
 * CARVE_ERROR_BAD_POINTER; another resource kind or a backing created without
 * CARVE_VM_EXPORTABLE is CARVE_ERROR_UNSUPPORTED. */
int carve_vm_export_chunk(carve_resource_t r, void *ptr, int *fd, void **chunk_start,
                          size_t *chunk_size);
/* Maps another process's chunk (fd from carve_vm_export_chunk, size its chunk_size) read-write
 * on device at *ptr, an address of this process's own. fd stays the caller's. Both processes
 * see the same memory; order the writes (synchronise before signalling the other process). */
int carve_vm_import_chunk(int fd, size_t size, int device, carve_chunk_t *out, void **ptr);
/* Waits for the device, then unmaps the chunk here; the exporter's mapping is untouched.
 * Releasing twice is CARVE_ERROR_INVALID_HANDLE. */
int carve_vm_chunk_release(carve_chunk_t chunk);

/* ---- following a virtual-memory resource's mappings (NCCL, NIXL registration) ---- */
/* mapped: 1 for a chunk just mapped (with access granted), 0 for one unmapped. */
typedef void (*carve_segment_callback_t)(void *user, void *ptr, size_t size, int mapped);
/* Calls fn(user, chunk, chunk_size, 1) for every chunk r (a virtual or expandable resource,
 * device or host) has mapped now and maps from now on, before a block on it is handed out, and
 * fn(user, chunk, chunk_size, 0) for each it unmaps (after the unmap, with no live block or
 * queued work on it; at destruction, before). fn NULL removes the callback. fn runs outside
 * r's lock, on the thread whose call caused the change or one waiting for it, one call at a
 * time; it may allocate from r, must not wait for another thread that uses r, and must not
 * throw. user must be usable from any thread while the callback is set. Other resource kinds
 * are CARVE_ERROR_UNSUPPORTED. */
int carve_vm_set_segment_callback(carve_resource_t r, carve_segment_callback_t fn, void *user);

/* ---- statistics ---- */
/* Writes min(capacity, total) entries to out and the total to *count (call with out NULL,
 * capacity 0 to ask for the count). Resources without statistics report 0. */
int carve_resource_stats(carve_resource_t r, carve_stat_t *out, size_t capacity, size_t *count);
/* Returns unused memory upstream (pool, arena, driver pool); *released gets the bytes (may
 * be NULL). CARVE_ERROR_UNSUPPORTED for other kinds. */
int carve_resource_release(carve_resource_t r, size_t *released);

/* ---- current resource per device ---- */
/* previous (may be NULL) gets a new handle to the resource replaced: destroy it. */
int carve_set_current_resource(int device, carve_resource_t r, carve_resource_t *previous);
/* A new handle to the current resource of device: destroy it. */
int carve_get_current_resource(int device, carve_resource_t *out);
/* Live handles (for leak checks). */
size_t carve_live_handles(void);

/* ---- framework allocator symbols ----
 * Blocks are recorded with their resource and size, so frees go to the resource that
 * allocated them and size-less frees work. Allocations return NULL on failure and set
 * carve_last_error(); frees of pointers carve did not hand out are refused (last error). */

/* PyTorch torch.cuda.memory.CUDAPluggableAllocator(path, "carve_torch_alloc",
 * "carve_torch_free"): the device's current carve resource. */
void *carve_torch_alloc(ssize_t size, int device, carve_stream_t stream);
void carve_torch_free(void *ptr, ssize_t size, int device, carve_stream_t stream);
/* carve_torch_alloc_N / carve_torch_free_N, N = 0..15: the resource bound to slot N (one
 * slot per torch.cuda.MemPool). r NULL unbinds. */
int carve_torch_bind_slot(int slot, carve_resource_t r);
void *carve_torch_alloc_0(ssize_t size, int device, carve_stream_t stream);
void carve_torch_free_0(void *ptr, ssize_t size, int device, carve_stream_t stream);
/* ... through carve_torch_alloc_15 / carve_torch_free_15 */
/* Optional CUDAPluggableAllocator hooks (set_reset_fn, set_memory_fraction_fn; C++ API). */
void carve_torch_reset(void);
void carve_torch_set_memory_fraction(double fraction, int device);

/* CuPy cupy.cuda.memory.CFunctionAllocator(param, malloc, free, owner): param is a resource
 * handle cast to intptr_t (0: the device's current resource). Returns 0 on failure, which CuPy
 * does not check: raise cupy.cuda.memory.OutOfMemoryError yourself (carve.cupy does). */
intptr_t carve_cupy_malloc(intptr_t param, size_t size, int device);
void carve_cupy_free(intptr_t param, intptr_t ptr, int device);

/* ONNX Runtime CUDA EP provider options gpu_external_alloc / gpu_external_free /
 * gpu_external_empty_cache (pass the addresses as decimal strings). The resource is the one
 * bound here, else the current resource of the calling thread's device. */
int carve_ort_set_resource(carve_resource_t r);
void *carve_ort_alloc(size_t size);
void carve_ort_free(void *ptr);
void carve_ort_empty_cache(void);

/* Blocks handed out through the framework symbols and not yet freed. */
size_t carve_framework_outstanding(void);

#ifdef __cplusplus
}
#endif
#endif /* CARVE_H */
