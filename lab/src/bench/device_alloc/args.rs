//! `carve bench device-alloc`'s flags, which narrow its grid to one table or a few sizes.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// `carve bench device-alloc` options: narrow the grid (for a focused run, or under a profiler).
#[derive(Args, Debug, Clone, Default)]
pub struct DeviceAllocArgs {
    /// device-alloc: run only one table (`slab`: only the slab's alloc and free columns).
    #[arg(long, value_enum, value_name = "TABLE")]
    pub only: Option<Only>,
    /// device-alloc: thread counts N as powers of two, comma-separated (e.g. 24 for 2^24;
    /// default 20,22,24,26, or 20,22 with --quick).
    #[arg(long, value_delimiter = ',', value_name = "LOG2_N")]
    pub log_threads: Vec<u32>,
    /// device-alloc: block sizes in bytes, comma-separated (default 16,64,256,1024,4096, or
    /// 16,1024 with --quick).
    #[arg(long, value_delimiter = ',', value_name = "BYTES")]
    pub block: Vec<u64>,
    /// device-alloc, mixed-size table: only these thread counts (log2), over both size ranges.
    #[arg(long, value_delimiter = ',', value_name = "LOG2_N")]
    pub mixed_log_threads: Vec<u32>,
    /// device-alloc, per-class table: these sizes, each a class's own (default
    /// 16,64,256,1024,4096,16384,65536, or 16,4096 with --quick).
    #[arg(long, value_delimiter = ',', value_name = "BYTES")]
    pub class_bytes: Vec<u64>,
    /// device-alloc, per-class table: the largest thread count (log2; default 22).
    #[arg(long, value_name = "LOG2_N")]
    pub class_log_threads: Option<u32>,
    /// device-alloc: a checkout of saltsystemslab/gallatin; with nvcc on this machine, its
    /// harness (lab/gallatin/harness.cu) is built against DIR/include and Gallatin joins the slab
    /// and mixed-size tables (without it, or without nvcc, the tables say why it is left out).
    #[arg(long, value_name = "DIR")]
    pub gallatin: Option<PathBuf>,
    /// device-alloc, with --gallatin: Gallatin's heap in GiB for every row (default: twice the
    /// bytes it hands out, plus 1 GiB).
    #[arg(long, value_name = "GIB")]
    pub gallatin_heap_gib: Option<f64>,
    /// device-alloc: where slab heaps come from.
    #[arg(long, value_enum, default_value_t = SlabHeap::Virtual)]
    pub slab_heap: SlabHeap,
}

/// `--only`: one table of `carve bench device-alloc`.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Only {
    /// The first table's slab alloc and free columns.
    Slab,
    /// Mixed sizes through the general heap and CUDA's malloc.
    Mixed,
    /// The floor under the mixed sizes: each class group's atomics on bare arrays.
    Floor,
    /// One class at a time through carve_malloc, against the slab of that size.
    Class,
}

/// `--slab-heap`: the memory slab heaps are made in.
#[derive(ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SlabHeap {
    /// A virtual range of its own per heap (cuMemAddressReserve, cuMemCreate, cuMemMap).
    #[default]
    Virtual,
    /// cuMemAlloc.
    Cuda,
}

/// `given`, or `default` when it is empty (the flag was not passed).
pub(super) fn or_default<T: Clone>(given: &[T], default: Vec<T>) -> Vec<T> {
    if given.is_empty() {
        default
    } else {
        given.to_vec()
    }
}
