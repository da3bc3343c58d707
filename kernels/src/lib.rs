//! carve's device-side code: allocators that CUDA kernels call, written once in `no_std` Rust.
//!
//! The same source compiles three ways:
//! - for `nvptx64-nvidia-cuda`, where `build.rs` of the `carve` crate turns it into the PTX
//!   modules that carve embeds (entry points and intrinsics live behind
//!   `cfg(target_arch = "nvptx64")`): the shipped module, which exports exactly the device-heap
//!   ABI of `kernels/carve_heap.h`, and, with the `test-kernels` feature, the module that only
//!   carve's tests and benchmarks load;
//! - for the host, where CPU threads stress the same algorithms;
//! - for the host under `--cfg carve_loom`, where [`sync`] swaps in loom's atomics and loom
//!   model-checks every interleaving.
//!
//! Layouts shared with the host are `#[repr(C)]`, derive `bytemuck::Pod`, and are pinned with
//! `static_assertions`.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", feature(stdarch_nvptx, asm_experimental_arch))]
// Only the test module defines kernels (`extern "ptx-kernel"`).
#![cfg_attr(
    all(target_arch = "nvptx64", feature = "test-kernels"),
    feature(abi_ptx)
)]

#[cfg(test)]
extern crate std;
// Only the test module's kernels use `alloc` (through `global_alloc::CarveAlloc`); the shipped
// module links no `alloc` code.
#[cfg(all(target_arch = "nvptx64", feature = "test-kernels"))]
extern crate alloc;

pub mod blocks;
pub mod bump;
pub mod bump_block;
mod chain;
pub mod entry;
mod exact_div;
pub mod general;
pub mod global_alloc;
pub mod heap_layout;
pub mod size_class;
pub mod slab;
pub mod smoke;
pub mod sync;
pub mod warp;

#[cfg(target_arch = "nvptx64")]
mod global_mem;
#[cfg(target_arch = "nvptx64")]
mod heap_entry;
#[cfg(target_arch = "nvptx64")]
mod numba_abi;
#[cfg(target_arch = "nvptx64")]
mod nvptx;
// Kernels for carve's tests and benchmarks: a second PTX module, never the shipped one.
#[cfg(all(target_arch = "nvptx64", feature = "test-kernels"))]
mod test_entry;
// Kernels for carve's benchmarks: the same module.
#[cfg(all(target_arch = "nvptx64", feature = "test-kernels"))]
mod test_bench;
// A kernel whose lanes pass different heaps and pointers: the same module.
#[cfg(all(target_arch = "nvptx64", feature = "test-kernels"))]
mod test_divergent;
// Floors for the mixed-size benchmark: the same module.
#[cfg(all(target_arch = "nvptx64", feature = "test-kernels"))]
mod test_floor;
