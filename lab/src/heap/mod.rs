//! The device heap's lab side: its command line (`carve heap-ptx`, `carve heap-layout`) and
//! [`HeapKernels`], the launchers of the heap's test and benchmark kernels.

pub mod cli;
mod launch;

pub use launch::{HeapKernels, BLOCK};
