//! carve's C ABI, declared in `include/carve.h`.
//!
//! - [`registry`]: resources behind opaque handles. A handle is a registry id with a generation,
//!   so a destroyed or forged handle is an error, never a dangling pointer.
//! - [`make`]: building and composing resources, shared by the C functions and the Python
//!   package.
//! - [`make_vm`], [`make_adapt`]: the virtual-memory resources, the graph-safe resource, and
//!   the aligning, prefetching and failure-callback adaptors.
//! - [`slots`]: generation-checked handle tables (resources, imported chunks).
//! - [`vm_export`], [`vm_share`]: exporting a virtual-memory resource's chunks as POSIX file
//!   descriptors and mapping them in another process.
//! - [`vm_segments`]: a C callback told of every chunk a virtual-memory resource maps and
//!   unmaps (for NCCL registration).
//! - [`stats`]: each resource's statistics as name/value pairs.
//! - [`ffi`]: the `extern "C"` functions; each catches panics, returns an error code and keeps
//!   a thread-local last-error string.
//! - [`ffi_more`]: the `extern "C"` constructors of those.
//! - [`frameworks`]: the exact symbols PyTorch's `CUDAPluggableAllocator`, CuPy's
//!   `CFunctionAllocator` and ONNX Runtime's CUDA execution provider call.
//!
//! Built as `libcarve_capi.so`; the Python extension module links this crate and exports the
//! same symbols, so `carve.lib_path()` names a library that frameworks can load.

pub mod current;
pub mod error;
pub mod ffi;
pub mod ffi_more;
pub mod frameworks;
pub mod make;
pub mod make_adapt;
pub mod make_vm;
pub mod registry;
pub mod slots;
pub mod stats;
#[cfg(doctest)]
mod unsafe_calls;
pub mod vm_export;
pub mod vm_segments;
#[cfg(unix)]
pub mod vm_share;

pub use error::{Code, FfiError};
pub use registry::{Entry, Handle};
