//! # carve-lab
//!
//! What carve's team measures and tests with, apart from the library users build on: the
//! `carve` command line (`info`, `bench`, `replay`, `heap-ptx`, `heap-layout`), the benchmark
//! workloads, replay of allocation logs, SVG plots, the reader of PyTorch's memory snapshots,
//! and the test and benchmark kernels with their PTX module (`lab/ptx/carve_test.ptx`).
//!
//! | module | holds |
//! |---|---|
//! | [`bench`](mod@bench) | `carve bench`: one file per workload, each printing a Markdown table |
//! | [`replay`] | `carve replay`: replaying RMM allocation logs and PyTorch snapshots |
//! | [`plot`] | line charts as SVG for replay and bench plots |
//! | [`snapshot`] | reading pickled memory snapshots (PyTorch's or carve's) |
//! | [`heap`] | `carve heap-ptx` / `heap-layout`, and [`HeapKernels`](heap::HeapKernels) |
//! | [`kernels`] | the test PTX module and its smoke kernels |

pub mod bench;
pub mod heap;
pub mod kernels;
pub mod plot;
pub mod replay;
pub mod snapshot;
mod sync;

pub use kernels::{DeviceTestKernels, TestKernels, TEST_PTX};
