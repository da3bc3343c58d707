//! The device heap: a region reserved from any [`MemoryResource`], from which kernel threads
//! allocate blocks (the slab), byte ranges (the bump arena), or any size up to 16 MiB (the
//! general heap, [`DeviceHeap::general`]: `carve_malloc(heap, bytes)` / `carve_free(heap, p)`
//! over one slab per size class, laid out as `carve_kernels::heap_layout::GeneralHeader` says). The algorithms are in
//! `carve_kernels::{slab, bump}`; this module reserves, formats, reads back and grows heaps.
//!
//! - **Format** is a memset of the metadata and one 128-byte copy of the [`HeapHandle`]: no kernel.
//! - **Kernels** get the heap's device address ([`DeviceHeap::device_ptr`]), which is the address
//!   of its handle, and call `carve_slab_alloc(heap)` / `carve_slab_free(heap, p)` /
//!   `carve_bump_alloc(heap, bytes, align)` (see `kernels/carve_heap.h`). Rust kernels can also
//!   allocate through `alloc` (`Box`, `Vec`) with `carve_kernels::global_alloc::CarveAlloc`.
//! - **Statistics** are one copy of each segment's metadata prefix ([`DeviceHeap::stats`]).
//! - **Other processes** (Numba, CuPy) format heaps in their own memory with
//!   [`ForeignHeapPlan`], or `carve heap-layout` from the command line.
//! - **Growth** appends a segment and links it from the last one's `next`; blocks already handed
//!   out never move (see below).
//!
//! # Growth
//!
//! - A heap is a chain of segments. Kernels get the first segment's address
//!   ([`DeviceHeap::device_ptr`]), which is fixed for the heap's life, and walk `next` to the
//!   later segments when the earlier ones are full.
//! - The host changes the chain only **between launches** (the methods take `&mut self` and must
//!   not run while a kernel uses the heap): it appends a segment and links it from the last one's
//!   `next` ([`DeviceHeap::grow`], [`DeviceHeap::ensure_free`], [`DeviceHeap::after_launch`]
//!   with a [`GrowthPolicy`]), or unlinks segments that hold no allocation
//!   ([`DeviceHeap::trim`]).
//! - **Addresses never move.** A segment stays where it was placed until trim unlinks it, and
//!   trim takes only segments with nothing allocated, never the first.
//! - A [`DeviceHeap::growable`] heap's segments come from a private
//!   [`VirtualMemoryResource`](crate::VirtualMemoryResource) that reserves address space for the
//!   heap's maximum once, maps physical chunks as segments are added, and unmaps them on trim.
//!   Growth past the maximum is an [`Error::OutOfMemory`].
//! - A heap over a plain resource ([`DeviceHeap::slab`], [`DeviceHeap::bump`]) grows the same
//!   way from that resource, bounded only by it, and trim gives segments back to it.
//! - Segment sizes double (each new segment holds at least the capacity of all earlier ones), so
//!   a heap that grew from `c` to `n × c` has about `log2(n) + 1` segments.
//! - A growable general heap grows class by class ([`DeviceHeap::ensure_free_class`], or the
//!   policy per class): each class has a stride of address space as large as the heap's maximum,
//!   and its new segments are mapped inside it, so that the kernels still find a pointer's class
//!   from its address. [`DeviceHeap::general`] heaps do not grow.

mod foreign;
mod general_growth;
mod growth;
mod mapped;
mod stats;

pub use foreign::ForeignHeapPlan;
pub use growth::{GrowOptions, GrowthPolicy, GrowthReport, TrimReport};
pub use stats::HeapStats;

mod device_heap;
mod general_range;
mod growable;
mod region;

pub use device_heap::DeviceHeap;
pub use region::HeapKind;

#[cfg(doc)]
use crate::{error::Error, resource::MemoryResource};
#[cfg(doc)]
use carve_kernels::heap_layout::HeapHandle;
