//! [`TimedUpstream`]: the wall time a suballocator spends in its upstream's calls, so a replay
//! can say how much of its time went to the driver.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use carve::driver::Device;
use carve::error::Result;
use carve::resource::{MemoryResource, Properties, SharedResource};
use carve::stream::StreamRef;

/// A running total of the wall time of the calls made through [`CallClock::time`].
#[derive(Debug, Default)]
struct CallClock {
    nanos: AtomicU64,
}

impl CallClock {
    /// Runs `f`, adding its wall time to the total (whatever `f` returns).
    fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.nanos.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        r
    }

    /// The total so far.
    fn total(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Relaxed))
    }
}

/// Passes every call on to the upstream, adding its wall time to a shared total.
#[derive(Debug, Clone)]
pub(crate) struct TimedUpstream {
    inner: SharedResource,
    clock: Arc<CallClock>,
}

impl TimedUpstream {
    pub fn new(inner: SharedResource) -> Self {
        TimedUpstream {
            inner,
            clock: Arc::default(),
        }
    }

    /// Time spent in the upstream's allocate and deallocate so far.
    pub fn time(&self) -> Duration {
        self.clock.total()
    }
}

// SAFETY: pure delegation to a resource that upholds the contract.
unsafe impl MemoryResource for TimedUpstream {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        self.clock
            .time(|| self.inner.allocate(stream, bytes, align))
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on unchanged.
        self.clock
            .time(|| unsafe { self.inner.deallocate(stream, ptr, bytes, align) })
    }

    fn properties(&self) -> Properties {
        self.inner.properties()
    }

    fn device(&self) -> Option<Device> {
        self.inner.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve::resource::HostMemoryResource;

    /// Host memory whose allocations take 2 ms each.
    #[derive(Debug)]
    struct Slow(HostMemoryResource);

    // SAFETY: delegates to host memory.
    unsafe impl MemoryResource for Slow {
        fn allocate(&self, s: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
            std::thread::sleep(Duration::from_millis(2));
            self.0.allocate(s, bytes, align)
        }
        unsafe fn deallocate(
            &self,
            s: StreamRef<'_>,
            p: NonNull<u8>,
            bytes: usize,
            align: usize,
        ) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.0.deallocate(s, p, bytes, align) }
        }
        fn properties(&self) -> Properties {
            self.0.properties()
        }
        fn device(&self) -> Option<Device> {
            None
        }
    }

    #[test]
    fn the_upstreams_calls_are_passed_on_and_timed() {
        let timed = TimedUpstream::new(Arc::new(Slow(HostMemoryResource::new())));
        let clone = timed.clone();
        assert_eq!(timed.time(), Duration::ZERO);
        let p = timed.allocate(StreamRef::DEFAULT, 4096, 256).unwrap();
        assert_eq!(p.as_ptr() as usize % 256, 0);
        // SAFETY: allocated above with these arguments, freed once.
        unsafe { timed.deallocate(StreamRef::DEFAULT, p, 4096, 256) }.unwrap();
        // Clones share the total: the replay reads it through the one it kept.
        assert!(
            clone.time() >= Duration::from_millis(2),
            "{:?}",
            clone.time()
        );
        assert!(timed.allocate(StreamRef::DEFAULT, 0, 256).is_err());
    }
}
