//! Pageable host memory as a resource: the upstream for suballocator tests on machines without
//! a GPU, and a baseline. It records every block it hands out, so foreign pointers, double frees
//! and size mismatches are caught rather than passed to the system allocator.

use std::alloc::Layout;
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::memory_resource::{check_request, MemoryResource, Properties};
use crate::stream::StreamRef;
use crate::sync::lock;

const NAME: &str = "HostMemoryResource";

/// Aligned pageable host memory (host-accessible only). Streams are ignored: host memory has
/// no stream order.
#[derive(Clone, Debug, Default)]
pub struct HostMemoryResource {
    live: Arc<Mutex<HashMap<usize, Layout>>>,
}

impl HostMemoryResource {
    /// A new resource with no blocks.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes currently allocated through this handle and its clones.
    pub fn allocated_bytes(&self) -> usize {
        lock(&self.live).values().map(Layout::size).sum()
    }

    /// Number of live blocks.
    pub fn allocation_count(&self) -> usize {
        lock(&self.live).len()
    }
}

// SAFETY: blocks come from the global allocator with the checked layout, so they are aligned,
// sized and disjoint; a block is released only once, after the map confirms we own it.
unsafe impl MemoryResource for HostMemoryResource {
    fn allocate(&self, _stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, 1)?;
        let layout = Layout::from_size_align(bytes, align)
            .map_err(|_| Error::SizeOverflow { bytes, align })?;
        // SAFETY: layout has a non-zero size (checked above).
        let ptr = NonNull::new(unsafe { std::alloc::alloc(layout) }).ok_or_else(|| {
            Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: "the system allocator returned null".into(),
            }
        })?;
        lock(&self.live).insert(ptr.as_ptr() as usize, layout);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        _stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        let layout = {
            let mut live = lock(&self.live);
            let layout = *live.get(&addr).ok_or(Error::UnknownPointer {
                resource: NAME,
                ptr: addr,
            })?;
            if layout.size() != bytes {
                return Err(Error::SizeMismatch {
                    resource: NAME,
                    ptr: addr,
                    allocated: layout.size(),
                    freed: bytes,
                });
            }
            live.remove(&addr);
            layout
        };
        // SAFETY: the map held this exact pointer with this layout, and we just removed it, so
        // it was allocated by us and is released exactly once.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
        Ok(())
    }

    fn properties(&self) -> Properties {
        Properties::HOST
    }
    fn device(&self) -> Option<crate::driver::Device> {
        None
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        Ok(Some(crate::resource::MemoryStats::in_use(
            self.allocated_bytes(),
            self.allocation_count(),
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_aligned_writable_memory_and_frees_it() {
        let mr = HostMemoryResource::new();
        let p = mr.allocate(StreamRef::DEFAULT, 1000, 4096).unwrap();
        assert_eq!(p.as_ptr() as usize % 4096, 0);
        // SAFETY: 1000 host bytes were just allocated.
        unsafe { p.as_ptr().write_bytes(0xAB, 1000) };
        assert_eq!(mr.allocated_bytes(), 1000);
        // SAFETY: from this resource, same size.
        unsafe { mr.deallocate(StreamRef::DEFAULT, p, 1000, 4096) }.unwrap();
        assert_eq!(mr.allocation_count(), 0);
    }

    #[test]
    fn rejects_bad_requests_and_bad_frees() {
        let mr = HostMemoryResource::new();
        let s = StreamRef::DEFAULT;
        assert!(matches!(mr.allocate(s, 0, 8), Err(Error::ZeroSize)));
        assert!(matches!(
            mr.allocate(s, 8, 3),
            Err(Error::InvalidAlignment(3))
        ));
        assert!(matches!(
            mr.allocate(s, usize::MAX, 8),
            Err(Error::SizeOverflow { .. })
        ));
        // Miri aborts on an impossible allocation instead of returning null.
        #[cfg(not(miri))]
        assert!(mr
            .allocate(s, isize::MAX as usize - 4096, 8)
            .unwrap_err()
            .is_out_of_memory());

        let p = mr.allocate(s, 64, 8).unwrap();
        let mut local = 0u8;
        // SAFETY: foreign pointer on purpose; the resource must refuse it before touching it.
        let foreign = unsafe { mr.deallocate(s, NonNull::from(&mut local), 64, 8) };
        assert!(matches!(foreign, Err(Error::UnknownPointer { .. })));
        // SAFETY: wrong size on purpose; refused without freeing.
        let wrong = unsafe { mr.deallocate(s, p, 32, 8) };
        assert!(matches!(
            wrong,
            Err(Error::SizeMismatch {
                allocated: 64,
                freed: 32,
                ..
            })
        ));
        // SAFETY: the block's one correct free.
        unsafe { mr.deallocate(s, p, 64, 8) }.unwrap();
        // SAFETY: a double free on purpose; refused before the system allocator sees it.
        let twice = unsafe { mr.deallocate(s, p, 64, 8) };
        assert!(matches!(twice, Err(Error::UnknownPointer { .. })));
        assert_eq!(mr.allocation_count(), 0);
    }
}
