//! [`ChunkExporter`]: the virtual-memory resources' chunk export and segment callback, kept
//! beside the type-erased resource of a registry entry.

use std::fmt::Debug;
use std::ptr::NonNull;

use carve::resource::{PhysicalBacking, SegmentCallback};
use carve::{ExpandableMemoryResource, VirtualMemoryResource};

/// A POSIX descriptor for a physical chunk, with the chunk's start address and size.
#[cfg(unix)]
pub type ExportedChunk = (std::os::fd::OwnedFd, usize, usize);

/// A resource whose physical chunks other processes can map, and whose mappings a callback
/// can follow.
pub trait ChunkExporter: Send + Sync + Debug {
    /// The chunk holding `ptr`, a live block's address.
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk>;

    /// See [`VirtualMemoryResource::set_segment_callback`].
    fn set_segment_callback(&self, callback: Option<SegmentCallback>);

    /// Segment callbacks that panicked.
    fn segment_callback_panics(&self) -> u64;
}

impl<B: PhysicalBacking> ChunkExporter for VirtualMemoryResource<B> {
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk> {
        VirtualMemoryResource::export_chunk(self, ptr)
    }
    fn set_segment_callback(&self, callback: Option<SegmentCallback>) {
        VirtualMemoryResource::set_segment_callback(self, callback)
    }
    fn segment_callback_panics(&self) -> u64 {
        VirtualMemoryResource::segment_callback_panics(self)
    }
}

impl<B: PhysicalBacking> ChunkExporter for ExpandableMemoryResource<B> {
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk> {
        ExpandableMemoryResource::export_chunk(self, ptr)
    }
    fn set_segment_callback(&self, callback: Option<SegmentCallback>) {
        ExpandableMemoryResource::set_segment_callback(self, callback)
    }
    fn segment_callback_panics(&self) -> u64 {
        ExpandableMemoryResource::segment_callback_panics(self)
    }
}
