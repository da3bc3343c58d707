//! Launchers for the device-heap kernels of the test PTX (`kernels/src/heap_entry.rs`): used by
//! the GPU tests and `carve bench device-alloc`, and an example of calling the heap from Rust.

use carve::cudarc::driver::{LaunchConfig, PushKernelArg};
use carve::driver::{Device, Stream};
use carve::error::{Error, Result};

use crate::kernels::{launch_error, TestKernels};

/// Threads per block of every heap launch.
pub const BLOCK: u32 = 256;

/// Typed launchers; every `u64` pointer argument is a device address.
#[derive(Debug)]
pub struct HeapKernels<'a> {
    stream: &'a Stream,
}

fn config(n: u64) -> Result<LaunchConfig> {
    let blocks = n.div_ceil(BLOCK as u64).max(1);
    let blocks = u32::try_from(blocks)
        .map_err(|_| Error::InvalidArgument(format!("{n} threads exceed one 1-D grid")))?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    })
}

macro_rules! launcher {
    ($(#[$doc:meta])* $name:ident => $kernel:literal ($($arg:ident: $ty:ty),*)) => {
        $(#[$doc])*
        ///
        /// # Safety
        /// The pointers must be what the kernel's documentation in `heap_entry.rs` asks for, and
        /// stay valid until the launch completes on the stream.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn $name(&self, threads: u64, $($arg: $ty),*) -> Result<()> {
            let f = TestKernels::get(self.stream.device())?.function($kernel)?;
            let mut launch = self.stream.cudarc().launch_builder(&f);
            $(launch.arg(&$arg);)*
            // SAFETY: the argument list matches the kernel's signature; the caller vouches for
            // the memory.
            unsafe { launch.launch(config(threads)?) }
                .map(drop)
                .map_err(launch_error)
        }
    };
}

impl<'a> HeapKernels<'a> {
    /// Launchers on `stream`.
    pub fn new(stream: &'a Stream) -> Self {
        HeapKernels { stream }
    }

    /// The device the launches run on.
    pub fn device(&self) -> &Device {
        self.stream.device()
    }

    launcher!(
        /// Thread `i < n` allocates one block of the slab at `heap` into `out[i]`.
        slab_alloc => "carve_heap_slab_alloc"(heap: u64, out: u64, n: u64)
    );
    launcher!(
        /// Thread `i < n` frees `ptrs[i]` into the slab at `heap`.
        slab_free => "carve_heap_slab_free"(heap: u64, ptrs: u64, n: u64)
    );
    launcher!(
        /// One round of racing allocations and frees (see `carve_heap_slab_churn`).
        slab_churn => "carve_heap_slab_churn"(heap: u64, ptrs: u64, n: u64, bytes: u64, round: u32, bad: u64)
    );
    launcher!(
        /// Thread `i < n` allocates `test_request_size(i, seed)` bytes (16 B to 4 KiB) from the
        /// general heap at `heap` into `out[i]` and fills them with its pattern.
        general_malloc => "carve_test_general_malloc"(heap: u64, out: u64, n: u64, seed: u32)
    );
    launcher!(
        /// Thread `i < n` checks the pattern at `ptrs[i]` (mismatches counted into `bad[0]`),
        /// then frees it into the general heap at `heap`.
        general_check_free => "carve_test_general_check_free"(heap: u64, ptrs: u64, n: u64, seed: u32, bad: u64)
    );
    launcher!(
        /// One round of the general heap's stress test (see `carve_test_general_churn`): thread
        /// `i` toggles slot `i × mult mod n` (allocate and fill, or check and free); `counts`
        /// gets mismatches, nulls, allocations and frees.
        general_churn => "carve_test_general_churn"(heap: u64, ptrs: u64, n: u64, seed: u32, round: u32, mult: u64, counts: u64)
    );
    launcher!(
        /// Benchmark: thread `i < n` allocates a hashed size over `16..=max` bytes from the
        /// general heap at `heap` into `out[i]`, writing nothing into the block.
        general_malloc_bench => "carve_bench_general_malloc"(heap: u64, out: u64, n: u64, max: u64, seed: u32)
    );
    launcher!(
        /// Benchmark: thread `i < n` allocates `bytes` (the same for every thread) from the
        /// general heap at `heap` into `out[i]`, writing nothing into the block.
        general_malloc_one_bench => "carve_bench_general_malloc_one"(heap: u64, out: u64, n: u64, bytes: u64)
    );
    launcher!(
        /// Benchmark: thread `i < n` frees `ptrs[i]` into the general heap at `heap`.
        general_free_bench => "carve_bench_general_free"(heap: u64, ptrs: u64, n: u64)
    );
    launcher!(
        /// Floor of the mixed-size bench: the class groups' reservation `fetch_add` (and, with
        /// `claim`, their Acquire `fetch_or`) on bare arrays (see `kernels/src/test_floor.rs`).
        floor_malloc => "carve_bench_floor_malloc"(counts: u64, words: u64, out: u64, n: u64, max: u64, seed: u32, shards_log2: u32, claim: u32)
    );
    launcher!(
        /// Floor of the mixed-size bench's frees: each group's Release `fetch_and` and (with
        /// `count`) its count `fetch_sub`, on the arrays [`HeapKernels::floor_malloc`] used.
        floor_free => "carve_bench_floor_free"(counts: u64, words: u64, out: u64, n: u64, count: u32)
    );
    launcher!(
        /// Floor of a free that caches: one `fetch_add` per warp on its hardware slot's ring,
        /// and a store per lane (see `kernels/src/test_floor.rs`).
        floor_cache_free => "carve_bench_floor_cache_free"(slots: u64, ring: u64, out: u64, n: u64, ring_log2: u32)
    );
    launcher!(
        /// Baseline: thread `i < n` calls CUDA's in-kernel `malloc` for a hashed size over
        /// `16..=max` bytes into `out[i]`.
        cuda_malloc_mixed => "carve_bench_malloc_mixed"(out: u64, n: u64, max: u64, seed: u32)
    );
    launcher!(
        /// Thread `i < n` makes one call with its own heap `heaps[i]` (0 for none) and argument
        /// `args[i]`: `op` 0 `carve_slab_alloc`, 1 `carve_slab_free(heap, args[i])`, 2
        /// `carve_bump_alloc(heap, args[i], 16)`, 3 `carve_malloc(heap, args[i])`, 4
        /// `carve_free(heap, args[i])`; an allocation's pointer goes to `out[i]`, and its first
        /// 8 bytes get `i` (`kernels/src/test_divergent.rs`).
        per_lane => "carve_test_heap_per_lane"(op: u32, heaps: u64, args: u64, out: u64, n: u64)
    );
    launcher!(
        /// Thread `i < n` bump-allocates `bytes` aligned to `align` into `out[i]`.
        bump_alloc => "carve_heap_bump_alloc"(heap: u64, out: u64, n: u64, bytes: u64, align: u64)
    );
    launcher!(
        /// As `bump_alloc`, keeping no pointer (benchmarks).
        bump_alloc_sink => "carve_heap_bump_alloc_sink"(heap: u64, n: u64, bytes: u64, align: u64, sink: u64)
    );
    launcher!(
        /// Every thread calls `carve_bump_alloc_block` (one reservation per block) for `bytes`,
        /// or with `mixed != 0` for `bytes × (1 + i % 5)` and nothing when `i % 7 == 3`;
        /// thread `i < n` stores its pointer into `out[i]`.
        bump_alloc_block => "carve_heap_bump_alloc_block"(heap: u64, out: u64, n: u64, bytes: u64, align: u64, mixed: u32)
    );
    launcher!(
        /// As `bump_alloc_block` for one size, keeping no pointer (benchmarks).
        bump_alloc_block_sink => "carve_heap_bump_alloc_block_sink"(heap: u64, n: u64, bytes: u64, align: u64, sink: u64)
    );
    launcher!(
        /// Thread `i` writes its pattern over the `bytes` at `ptrs[i]` (if not 0).
        pattern_fill => "carve_heap_pattern_fill"(ptrs: u64, n: u64, bytes: u64)
    );
    launcher!(
        /// Counts into `bad[0]` the threads whose pattern was overwritten.
        pattern_check => "carve_heap_pattern_check"(ptrs: u64, n: u64, bytes: u64, bad: u64)
    );
    launcher!(
        /// Thread `i < n` builds a `Vec<u32>` of `len` elements `i, i + 1, ..` with Rust's
        /// allocator over the heap at `heap` (slab or bump; `carve_kernels::global_alloc`), and
        /// writes its sum to `out[i]`, or `u64::MAX` if an allocation failed; then drops the Vec,
        /// or with `keep != 0` leaks it. Launches with different heaps must not overlap.
        vec_sum => "carve_test_vec_sum"(heap: u64, out: u64, n: u64, len: u32, keep: u32)
    );
    launcher!(
        /// Ablation: `slab_alloc` with relaxed bitmap atomics (benchmarks only).
        slab_alloc_relaxed => "carve_bench_slab_alloc_relaxed"(heap: u64, out: u64, n: u64)
    );
    launcher!(
        /// Ablation: `slab_free` with relaxed bitmap atomics (benchmarks only).
        slab_free_relaxed => "carve_bench_slab_free_relaxed"(heap: u64, ptrs: u64, n: u64)
    );
    launcher!(
        /// Does nothing: the launch floor.
        empty => "carve_bench_empty"()
    );
    launcher!(
        /// One `atomicAdd(counter, bytes)` per thread.
        atomic_add => "carve_bench_atomic_add"(counter: u64, n: u64, bytes: u64, sink: u64)
    );
    launcher!(
        /// CUDA's in-kernel `malloc(bytes)` per thread into `out[i]`.
        cuda_malloc => "carve_bench_malloc"(out: u64, n: u64, bytes: u64)
    );
    launcher!(
        /// CUDA's in-kernel `free(ptrs[i])` per thread.
        cuda_free => "carve_bench_free"(ptrs: u64, n: u64)
    );
}
