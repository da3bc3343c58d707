//! An owned array of `T: Pod` in host-accessible memory (managed, pinned or plain host), with
//! safe host views. [`ManagedBuffer`](crate::resource::ManagedBuffer) and
//! [`PinnedBuffer`](crate::resource::PinnedBuffer) are this type over their resources, plus what each kind
//! of memory adds (prefetch and advice; the mapped device pointer).

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use bytemuck::Pod;

use crate::error::{Error, Result};
use crate::resource::engine::release::{release_in_drop, release_once};
use crate::resource::memory_resource::MemoryResource;
use crate::stream::StreamRef;

/// `len` elements of `T` that the host may read and write through [`as_slice`](Self::as_slice).
///
/// Host views must not overlap device work on the same memory: synchronise the streams whose
/// kernels or copies touch it before borrowing a slice (kernel launches are `unsafe` and promise
/// that). Dropping it frees through its resource.
pub struct HostBuffer<T: Pod, R: MemoryResource> {
    ptr: Option<NonNull<u8>>,
    len: usize,
    resource: R,
    _marker: PhantomData<T>,
}

// SAFETY: the buffer uniquely owns its block and its `T`s, which may move to another thread
// (`T: Send`); R is Send.
unsafe impl<T: Pod + Send, R: MemoryResource> Send for HostBuffer<T, R> {}
// SAFETY: `&self` gives shared reads of `T`s only, which `T: Sync` allows from any thread; R is
// Sync.
unsafe impl<T: Pod + Sync, R: MemoryResource> Sync for HostBuffer<T, R> {}

impl<T: Pod, R: MemoryResource + Clone> HostBuffer<T, R> {
    /// `len` zeroed elements (zeroed by the host, so managed pages start on the CPU).
    ///
    /// The block is allocated with [`allocate_sync`](MemoryResource::allocate_sync): a pool may
    /// hand out a block that another stream's queued work still uses, and the host writes it at
    /// once.
    ///
    /// [`Error::InvalidArgument`] if `resource` does not give host-accessible memory.
    pub fn zeroed(resource: &R, len: usize) -> Result<Self> {
        if !resource.properties().host_accessible {
            return Err(Error::InvalidArgument(format!(
                "{resource:?} does not give host-accessible memory"
            )));
        }
        let bytes = len.checked_mul(size_of::<T>()).ok_or(Error::SizeOverflow {
            bytes: usize::MAX,
            align: align_of::<T>(),
        })?;
        let ptr = match bytes {
            0 => None,
            _ => {
                let p = resource.allocate_sync(bytes, align_of::<T>())?;
                // SAFETY: `bytes` host-accessible bytes, allocated synchronously: no queued work
                // uses them any more.
                unsafe { p.as_ptr().write_bytes(0, bytes) };
                Some(p)
            }
        };
        Ok(HostBuffer {
            ptr,
            len,
            resource: resource.clone(),
            _marker: PhantomData,
        })
    }

    /// A copy of `data`.
    pub fn from_slice(resource: &R, data: &[T]) -> Result<Self> {
        let mut b = Self::zeroed(resource, data.len())?;
        b.as_mut_slice().copy_from_slice(data);
        Ok(b)
    }
}

impl<T: Pod, R: MemoryResource> HostBuffer<T, R> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The resource it frees through.
    pub fn resource(&self) -> &R {
        &self.resource
    }

    /// The host address of element 0 (`None` when empty).
    pub fn host_ptr(&self) -> Option<NonNull<u8>> {
        self.ptr
    }

    /// The host view.
    pub fn as_slice(&self) -> &[T] {
        match self.ptr {
            // SAFETY: `len` initialised `T`s (zeroed at creation; Pod admits any bytes), aligned
            // to `align_of::<T>()`, host-accessible (checked at creation), owned by `self`.
            Some(p) => unsafe { std::slice::from_raw_parts(p.as_ptr().cast::<T>(), self.len) },
            None => &[],
        }
    }

    /// The mutable host view.
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        match self.ptr {
            // SAFETY: as for `as_slice`, and `&mut self` makes the borrow unique.
            Some(p) => unsafe { std::slice::from_raw_parts_mut(p.as_ptr().cast::<T>(), self.len) },
            None => &mut [],
        }
    }

    /// Frees now, reporting what dropping would have to swallow.
    ///
    /// As [`deallocate_sync`](MemoryResource::deallocate_sync): the device's default stream is
    /// synchronised, then the block freed on it. If that synchronisation fails the block is not
    /// freed: dropping the buffer (which this does on return) tries once more, and leaks it if
    /// that fails too (see [`crate::take_deferred_error`]).
    pub fn free(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        let (resource, bytes) = (&self.resource, self.len * size_of::<T>());
        release_once(
            &mut self.ptr,
            || match resource.device() {
                Some(device) => device.synchronize_default_stream(),
                None => Ok(()),
            },
            // SAFETY: allocated by this resource with this size and alignment; `release_once`
            // frees it once, after the default stream is synchronised (`deallocate_sync`).
            |p| unsafe { resource.deallocate(StreamRef::DEFAULT, p, bytes, align_of::<T>()) },
        )
    }
}

impl<T: Pod, R: MemoryResource> Drop for HostBuffer<T, R> {
    fn drop(&mut self) {
        // Drop cannot report (callers who care use `free`): record it for `take_deferred_error`.
        release_in_drop("HostBuffer drop", || self.release());
    }
}

impl<T: Pod, R: MemoryResource> fmt::Debug for HostBuffer<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("resource", &self.resource)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::source::cuda::CudaMemoryResource;
    use crate::resource::source::host::HostMemoryResource;

    #[test]
    fn views_round_trip_and_free_through_the_resource() {
        let mr = HostMemoryResource::new();
        let mut b = HostBuffer::<u64, _>::from_slice(&mr, &[1, 2, 3]).unwrap();
        assert_eq!(b.as_slice(), &[1, 2, 3]);
        b.as_mut_slice()[1] = 7;
        assert_eq!(b.as_slice(), &[1, 7, 3]);
        assert_eq!(mr.allocated_bytes(), 24);
        b.free().unwrap();
        assert_eq!(mr.allocation_count(), 0);

        let empty = HostBuffer::<u32, _>::zeroed(&mr, 0).unwrap();
        assert!(empty.is_empty() && empty.as_slice().is_empty());
        assert_eq!(mr.allocation_count(), 0);
        assert!(matches!(
            HostBuffer::<u64, _>::zeroed(&mr, usize::MAX / 4),
            Err(Error::SizeOverflow { .. })
        ));
    }

    // `T: Pod` admits types that must not cross threads (`PhantomData<Rc<_>>`, `PhantomData<Cell<_>>`
    // fields): the buffer is `Send` and `Sync` only where `T` is.
    static_assertions::assert_not_impl_any!(
        HostBuffer<PhantomData<std::rc::Rc<u8>>, HostMemoryResource>: Send, Sync
    );
    static_assertions::assert_not_impl_any!(
        HostBuffer<PhantomData<std::cell::Cell<u8>>, HostMemoryResource>: Sync
    );
    static_assertions::assert_impl_all!(
        HostBuffer<PhantomData<std::cell::Cell<u8>>, HostMemoryResource>: Send
    );
    static_assertions::assert_impl_all!(HostBuffer<u64, HostMemoryResource>: Send, Sync);

    /// Host memory whose blocks have a write queued by a stream that the allocation did not wait
    /// for, as a pool of managed memory gives a block freed on a stream still running: the write
    /// lands when that stream is synchronised ([`allocate_sync`](MemoryResource::allocate_sync))
    /// or, without one, whenever the test runs it ([`run_queued`](Self::run_queued)).
    #[derive(Clone, Debug, Default)]
    struct QueuedWrites {
        host: HostMemoryResource,
        queued: std::sync::Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
    }

    const LATE: u8 = 0xAB;

    impl QueuedWrites {
        fn run_queued(&self) {
            for (p, bytes) in self.queued.lock().unwrap().drain(..) {
                // SAFETY: a live block of `bytes` bytes of this resource (the tests free only
                // after running the queue).
                unsafe { (p as *mut u8).write_bytes(LATE, bytes) };
            }
        }
    }

    // SAFETY: delegates to `HostMemoryResource`; the queue only writes into live blocks.
    unsafe impl MemoryResource for QueuedWrites {
        fn allocate(
            &self,
            stream: StreamRef<'_>,
            bytes: usize,
            align: usize,
        ) -> Result<NonNull<u8>> {
            let p = self.host.allocate(stream, bytes, align)?;
            self.queued
                .lock()
                .unwrap()
                .push((p.as_ptr() as usize, bytes));
            Ok(p)
        }
        fn allocate_sync(&self, bytes: usize, align: usize) -> Result<NonNull<u8>> {
            let p = self.allocate(StreamRef::DEFAULT, bytes, align)?;
            self.run_queued();
            Ok(p)
        }
        unsafe fn deallocate(
            &self,
            stream: StreamRef<'_>,
            ptr: NonNull<u8>,
            bytes: usize,
            align: usize,
        ) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.host.deallocate(stream, ptr, bytes, align) }
        }
        fn properties(&self) -> crate::resource::memory_resource::Properties {
            self.host.properties()
        }
        fn device(&self) -> Option<crate::driver::Device> {
            None
        }
    }

    #[test]
    fn host_writes_wait_for_work_queued_on_the_block() {
        let mr = QueuedWrites::default();
        let zeroed = HostBuffer::<u32, _>::zeroed(&mr, 1000).unwrap();
        let copied = HostBuffer::<u32, _>::from_slice(&mr, &[7; 1000]).unwrap();
        mr.run_queued();
        assert!(
            zeroed.as_slice().iter().all(|&x| x == 0),
            "zeroed was overwritten"
        );
        assert!(
            copied.as_slice().iter().all(|&x| x == 7),
            "from_slice was overwritten"
        );
    }

    #[test]
    #[cfg_attr(miri, ignore = "Miri cannot dlopen libcuda")]
    fn device_only_memory_is_refused() {
        // Without a driver there is no device to build a cuda resource on: nothing to check.
        let Ok(cuda) = CudaMemoryResource::on(0) else {
            return;
        };
        assert!(matches!(
            HostBuffer::<u8, _>::zeroed(&cuda, 16),
            Err(Error::InvalidArgument(_))
        ));
    }
}
