//! Over-alignment for large requests, as RMM's `aligned_resource_adaptor`.

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::{align_up, check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT};
use crate::stream::StreamRef;
use crate::sync::lock;

const NAME: &str = "AlignedResourceAdaptor";

/// Aligns every request of at least `threshold` bytes to `alignment`.
///
/// Upstreams only promise [`DEFAULT_ALIGNMENT`] (the driver refuses more), so a request that needs
/// more is padded by `alignment - 256` bytes, the pointer is rounded up inside the padded block,
/// and the adaptor remembers the block it came from (a free of it with another size is refused
/// with [`Error::SizeMismatch`]). Requests that need no more than 256 bytes of alignment pass
/// straight through.
#[derive(Debug)]
pub struct AlignedResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R> {
    upstream: R,
    alignment: usize,
    threshold: usize,
    /// Aligned address handed out -> its padded upstream block.
    padded: Mutex<HashMap<usize, Padded>>,
}

/// An over-aligned block: where its upstream block starts, that block's size, and the size the
/// caller asked for (a free must name it, as for any other block).
#[derive(Clone, Copy, Debug)]
struct Padded {
    base: usize,
    size: usize,
    requested: usize,
}

impl<R> Clone for AlignedResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> AlignedResourceAdaptor<R> {
    /// Aligns requests of `threshold` bytes or more to `alignment` (a power of two).
    pub fn new(upstream: R, alignment: usize, threshold: usize) -> Result<Self> {
        if !alignment.is_power_of_two() {
            return Err(Error::InvalidAlignment(alignment));
        }
        Ok(Self {
            inner: Arc::new(Inner {
                upstream,
                alignment,
                threshold,
                padded: Mutex::new(HashMap::new()),
            }),
        })
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// The alignment that large requests get.
    pub fn alignment(&self) -> usize {
        self.inner.alignment
    }

    /// The size from which requests are over-aligned.
    pub fn threshold(&self) -> usize {
        self.inner.threshold
    }

    /// The alignment a request of `bytes` aligned to `align` is served with.
    fn effective(&self, bytes: usize, align: usize) -> usize {
        if bytes >= self.inner.threshold {
            align.max(self.inner.alignment)
        } else {
            align
        }
    }
}

// SAFETY: a padded block holds `bytes` bytes from the rounded-up pointer (the padding covers the
// rounding), and distinct upstream blocks give distinct, non-overlapping sub-ranges.
unsafe impl<R: MemoryResource> MemoryResource for AlignedResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        check_request(bytes, align, 1)?;
        let align = self.effective(bytes, align);
        if align <= DEFAULT_ALIGNMENT {
            return self.inner.upstream.allocate(stream, bytes, align);
        }
        let padded = bytes
            .checked_add(align - DEFAULT_ALIGNMENT)
            .ok_or(Error::SizeOverflow { bytes, align })?;
        check_request(padded, align, 1)?;
        let base = self
            .inner
            .upstream
            .allocate(stream, padded, DEFAULT_ALIGNMENT)?;
        let addr = align_up(base.as_ptr() as usize, align).expect("fits: checked above");
        // The offset is below `align - 256`, inside the padding, so this stays in the block.
        let ptr = NonNull::new(base.as_ptr().wrapping_add(addr - base.as_ptr() as usize))
            .expect("inside a non-null block");
        let block = Padded {
            base: base.as_ptr() as usize,
            size: padded,
            requested: bytes,
        };
        lock(&self.inner.padded).insert(addr, block);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        let block = {
            let mut map = lock(&self.inner.padded);
            match map.get(&addr) {
                Some(b) if b.requested != bytes => {
                    // Refused before anything changes, as every resource refuses a wrong size.
                    return Err(Error::SizeMismatch {
                        resource: NAME,
                        ptr: addr,
                        allocated: b.requested,
                        freed: bytes,
                    });
                }
                Some(_) => map.remove(&addr),
                None => None,
            }
        };
        let Some(block) = block else {
            // SAFETY: not one of ours padded, so it went straight through with these arguments.
            return unsafe {
                self.inner
                    .upstream
                    .deallocate(stream, ptr, bytes, self.effective(bytes, align))
            };
        };
        // Derived from `ptr`, so it keeps the block's provenance.
        let base = NonNull::new(ptr.as_ptr().wrapping_sub(addr - block.base))
            .expect("the upstream block's start is non-null");
        // SAFETY: `base` came from the upstream as `block.size` bytes at 256 alignment, and
        // removing it from the map lets only this call free it.
        let result = unsafe {
            self.inner
                .upstream
                .deallocate(stream, base, block.size, DEFAULT_ALIGNMENT)
        };
        if result.is_err() {
            lock(&self.inner.padded).insert(addr, block);
        }
        result
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}
