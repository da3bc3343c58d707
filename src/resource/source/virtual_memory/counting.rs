//! [`CountingBacking`]: a backing that counts the physical bytes in its chunks, and bounds them,
//! and counts the driver calls made through it.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use super::backing::{PhysicalBacking, PhysicalHandle};
use super::simulated::{BackingCounters, CallTimes};
use crate::error::{Error, Result};
use crate::resource::engine::call_clock::CallClock;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::Properties;
use crate::stream::{StreamId, StreamRef};

/// A backing that counts the physical bytes in chunks (created and not released) and their
/// peak, for resources that share one backing, and the calls that succeeded (so a replay can
/// say where its time went).
#[derive(Debug)]
pub struct CountingBacking<B> {
    inner: B,
    limit: usize,
    physical: AtomicUsize,
    peak: AtomicUsize,
    /// Successful creates, releases, maps, unmaps and access grants.
    calls: [AtomicU64; 5],
    /// Time in each kind of call, successful or not.
    clocks: [CallClock; 5],
}

const CREATE: usize = 0;
const RELEASE: usize = 1;
const MAP: usize = 2;
const UNMAP: usize = 3;
const ACCESS: usize = 4;

impl<B: PhysicalBacking> CountingBacking<B> {
    /// Counts `inner`'s chunks, refusing to create more than `limit` bytes of them.
    pub fn new(inner: B, limit: usize) -> Self {
        CountingBacking {
            inner,
            limit,
            physical: 0.into(),
            peak: 0.into(),
            calls: Default::default(),
            clocks: Default::default(),
        }
    }
    /// Calls that succeeded so far, and physical bytes in chunks.
    pub fn counters(&self) -> BackingCounters {
        let n = |i: usize| self.calls[i].load(Relaxed);
        BackingCounters {
            creates: n(CREATE),
            releases: n(RELEASE),
            maps: n(MAP),
            unmaps: n(UNMAP),
            access_grants: n(ACCESS),
            physical: self.physical(),
            peak_physical: self.peak_physical(),
            time: CallTimes {
                create: self.time(CREATE),
                release: self.time(RELEASE),
                map: self.time(MAP),
                unmap: self.time(UNMAP),
                access: self.time(ACCESS),
            },
        }
    }
    fn count(&self, call: usize) {
        self.calls[call].fetch_add(1, Relaxed);
    }
    fn time(&self, call: usize) -> Duration {
        self.clocks[call].total()
    }
    /// Runs `f`, adding its wall time to `call`'s.
    fn timed<T>(&self, call: usize, f: impl FnOnce() -> T) -> T {
        self.clocks[call].time(f)
    }
    /// The backing counted.
    pub fn inner(&self) -> &B {
        &self.inner
    }
    /// The most physical bytes it lets chunks hold.
    pub fn limit(&self) -> usize {
        self.limit
    }
    /// Physical bytes in chunks now.
    pub fn physical(&self) -> usize {
        self.physical.load(Relaxed)
    }
    /// The most physical bytes in chunks at once.
    pub fn peak_physical(&self) -> usize {
        self.peak.load(Relaxed)
    }
}

// SAFETY: pure delegation, plus counters.
unsafe impl<B: PhysicalBacking> PhysicalBacking for CountingBacking<B> {
    fn granularity(&self) -> usize {
        self.inner.granularity()
    }
    fn properties(&self) -> Properties {
        self.inner.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.device()
    }
    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.inner.reserve(size, align)
    }
    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.free_reservation(va, size) }
    }
    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        let now = self.physical.fetch_add(size, Relaxed) + size;
        let created = if now > self.limit {
            Err(Error::OutOfMemory {
                bytes: size,
                resource: "CountingBacking",
                detail: format!(
                    "{} bytes are in chunks, the limit is {}",
                    now - size,
                    self.limit
                ),
            })
        } else {
            self.timed(CREATE, || self.inner.create(size))
        };
        match created {
            Ok(h) => {
                self.peak.fetch_max(now, Relaxed);
                self.count(CREATE);
                Ok(h)
            }
            Err(e) => {
                self.physical.fetch_sub(size, Relaxed);
                Err(e)
            }
        }
    }
    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        self.timed(RELEASE, || unsafe { self.inner.release(handle, size) })?;
        self.physical.fetch_sub(size, Relaxed);
        self.count(RELEASE);
        Ok(())
    }
    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        // SAFETY: forwarded caller contract.
        self.timed(MAP, || unsafe { self.inner.map(va, size, handle) })?;
        self.count(MAP);
        Ok(())
    }
    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        self.timed(ACCESS, || unsafe { self.inner.set_access(va, size) })?;
        self.count(ACCESS);
        Ok(())
    }
    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        // SAFETY: forwarded caller contract.
        self.timed(UNMAP, || unsafe { self.inner.unmap(va, size) })?;
        self.count(UNMAP);
        Ok(())
    }
    #[cfg(unix)]
    fn export_fd(&self, handle: PhysicalHandle) -> Result<std::os::fd::OwnedFd> {
        self.inner.export_fd(handle)
    }
}

/// A resource's stream order, counting its synchronisations (the costly calls), and its marks
/// and queries (frequent, with [`VirtualOptions::mark_every_free`](super::VirtualOptions)).
#[derive(Debug)]
pub(crate) struct SyncCounter {
    inner: std::sync::Arc<dyn StreamOrder>,
    syncs: AtomicU64,
    stream_syncs: AtomicU64,
    marks: AtomicU64,
    queries: AtomicU64,
    /// Time in either kind of synchronisation.
    clock: CallClock,
    /// Time in marks and queries.
    mark_clock: CallClock,
}

impl SyncCounter {
    pub fn new(inner: std::sync::Arc<dyn StreamOrder>) -> Self {
        SyncCounter {
            inner,
            syncs: 0.into(),
            stream_syncs: 0.into(),
            marks: 0.into(),
            queries: 0.into(),
            clock: CallClock::default(),
            mark_clock: CallClock::default(),
        }
    }
    /// Successful [`StreamOrder::mark`] calls so far.
    pub fn marks(&self) -> u64 {
        self.marks.load(Relaxed)
    }
    /// [`StreamOrder::mark_complete`] calls so far.
    pub fn queries(&self) -> u64 {
        self.queries.load(Relaxed)
    }
    /// Time spent in marks and queries.
    pub fn mark_time(&self) -> Duration {
        self.mark_clock.total()
    }
    /// Successful [`StreamOrder::synchronize_all`] calls so far.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Relaxed)
    }
    /// Successful [`StreamOrder::synchronize`] calls so far.
    pub fn stream_syncs(&self) -> u64 {
        self.stream_syncs.load(Relaxed)
    }
    /// Time spent in synchronisations of either kind.
    pub fn sync_time(&self) -> Duration {
        self.clock.total()
    }
}

impl StreamOrder for SyncCounter {
    fn mark(&self, stream: StreamRef<'_>) -> Result<()> {
        self.mark_clock.time(|| self.inner.mark(stream))?;
        self.marks.fetch_add(1, Relaxed);
        Ok(())
    }
    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()> {
        self.inner.wait_for_mark(waiter, signaller)
    }
    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        self.queries.fetch_add(1, Relaxed);
        self.mark_clock.time(|| self.inner.mark_complete(signaller))
    }
    fn synchronize_all(&self) -> Result<()> {
        self.clock.time(|| self.inner.synchronize_all())?;
        self.syncs.fetch_add(1, Relaxed);
        Ok(())
    }
    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        self.clock.time(|| self.inner.synchronize(stream))?;
        self.stream_syncs.fetch_add(1, Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::SimulatedBacking;
    use super::*;

    /// Simulated memory whose access grants take 2 ms each, as a slow driver's would.
    #[derive(Debug)]
    struct SlowAccess(SimulatedBacking);

    // SAFETY: delegates to the simulated backing.
    unsafe impl PhysicalBacking for SlowAccess {
        fn granularity(&self) -> usize {
            self.0.granularity()
        }
        fn properties(&self) -> Properties {
            self.0.properties()
        }
        fn reserve(&self, size: usize, align: usize) -> Result<usize> {
            self.0.reserve(size, align)
        }
        unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.0.free_reservation(va, size) }
        }
        fn create(&self, size: usize) -> Result<PhysicalHandle> {
            self.0.create(size)
        }
        unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.0.release(handle, size) }
        }
        unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.0.map(va, size, handle) }
        }
        unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
            std::thread::sleep(Duration::from_millis(2));
            // SAFETY: forwarded caller contract.
            unsafe { self.0.set_access(va, size) }
        }
        unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
            // SAFETY: forwarded caller contract.
            unsafe { self.0.unmap(va, size) }
        }
    }

    #[test]
    fn each_kind_of_call_is_counted_and_timed_on_its_own() {
        let g = 2 << 20;
        let b = CountingBacking::new(SlowAccess(SimulatedBacking::new(16 * g, g).unwrap()), 4 * g);
        let va = b.reserve(4 * g, g).unwrap();
        let h = b.create(2 * g).unwrap();
        // Over the limit: refused before the driver is asked, so neither counted nor held.
        assert!(b.create(3 * g).unwrap_err().is_out_of_memory());
        // SAFETY: `va` is reserved and unmapped, `h` a live chunk of 2 granules, mapped nowhere;
        // both are taken down again in order.
        unsafe {
            b.map(va, 2 * g, h).unwrap();
            b.set_access(va, 2 * g).unwrap();
            b.set_access(va, 2 * g).unwrap();
            b.unmap(va, 2 * g).unwrap();
            b.release(h, 2 * g).unwrap();
            b.free_reservation(va, 4 * g).unwrap();
        }
        let c = b.counters();
        let calls = (c.creates, c.maps, c.access_grants, c.unmaps, c.releases);
        assert_eq!(calls, (1, 1, 2, 1, 1));
        assert_eq!((c.physical, c.peak_physical), (0, 2 * g));
        assert!(c.time.access >= Duration::from_millis(4), "{:?}", c.time);
        assert!(c.time.total() >= c.time.access);
    }
}
