//! [`ChunkExporter`]: the virtual-memory resources' chunk export, kept beside the type-erased
//! resource of a registry entry.

use std::fmt::Debug;
use std::ptr::NonNull;

use carve::resource::PhysicalBacking;
use carve::{ExpandableMemoryResource, VirtualMemoryResource};

/// A POSIX descriptor for a physical chunk, with the chunk's start address and size.
#[cfg(unix)]
pub type ExportedChunk = (std::os::fd::OwnedFd, usize, usize);

/// A resource whose physical chunks other processes can map.
pub trait ChunkExporter: Send + Sync + Debug {
    /// The chunk holding `ptr`, a live block's address.
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk>;
}

impl<B: PhysicalBacking> ChunkExporter for VirtualMemoryResource<B> {
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk> {
        VirtualMemoryResource::export_chunk(self, ptr)
    }
}

impl<B: PhysicalBacking> ChunkExporter for ExpandableMemoryResource<B> {
    #[cfg(unix)]
    fn export_chunk(&self, ptr: NonNull<u8>) -> carve::Result<ExportedChunk> {
        ExpandableMemoryResource::export_chunk(self, ptr)
    }
}
