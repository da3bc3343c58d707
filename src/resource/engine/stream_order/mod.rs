//! What the suballocators need from streams and events, behind a trait, so their stream logic
//! runs (and is tested) without a GPU.
//!
//! A block freed on stream A is reused on A at once. Handing it to stream B needs B to wait for
//! A's work up to that free. The suballocators record nothing on a free; while streams run
//! short, every [`MARK_EVERY`] frees on A they [`mark`](StreamOrder::mark) A (capture its work
//! so far), and B waits on A's last mark for blocks it covers. Blocks freed since are reached only through
//! [`synchronize_all`](StreamOrder::synchronize_all). So a suballocator names a stream to the
//! driver only inside a call on that stream: a stream may be destroyed while blocks freed on
//! it sit in a pool.

mod checked;
mod cuda;

pub use checked::{CheckedCounts, CheckedOrder, CheckedResource, OrderFaults};
pub use cuda::CudaOrder;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::driver::Device;
use crate::error::Error;
use crate::error::Result;
use crate::resource::memory_resource::MemoryResource;
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

/// A suballocator marks a stream at most once per this many frees on it, and only if some
/// stream ran short of its own blocks since the stream's last mark (RMM records an event on
/// every free). Only blocks freed before a stream's last mark cross to another stream with one
/// wait; the rest, after a device-wide synchronisation.
pub const MARK_EVERY: u32 = 64;

/// Orders work between streams on behalf of a suballocator.
pub trait StreamOrder: Send + Sync + fmt::Debug {
    /// Captures the work queued so far on `stream`, for later
    /// [`wait_for_mark`](Self::wait_for_mark)s. Called only while the caller uses `stream`.
    fn mark(&self, stream: StreamRef<'_>) -> Result<()>;

    /// Makes work queued on `waiter` from now on wait for the work `signaller` had queued at its
    /// last [`mark`](Self::mark) (for all of it, if it was never marked). `waiter` is in use by
    /// the caller; `signaller` may have been destroyed, so only its id is given.
    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()>;

    /// Whether the work `signaller` had queued at its last [`mark`](Self::mark) is done, without
    /// blocking (`cuEventQuery`); false if it was never marked. Then blocks freed on
    /// `signaller` before that mark may go to any stream with no wait. The default never
    /// knows, which is always safe.
    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        let _ = signaller;
        Ok(false)
    }

    /// Blocks the calling thread until all work queued so far on every stream of the device is
    /// done, naming no stream.
    fn synchronize_all(&self) -> Result<()>;

    /// Blocks the calling thread until the work queued so far on `stream` (in use by the
    /// caller) is done.
    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()>;
}

/// Ordering for memory that no device work touches (host memory, simulated streams): there is
/// never anything to wait for.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOrder;

impl StreamOrder for HostOrder {
    fn mark(&self, _stream: StreamRef<'_>) -> Result<()> {
        Ok(())
    }
    fn wait_for_mark(&self, _waiter: StreamRef<'_>, _signaller: StreamId) -> Result<()> {
        Ok(())
    }
    fn mark_complete(&self, _signaller: StreamId) -> Result<bool> {
        Ok(true)
    }
    fn synchronize_all(&self) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self, _stream: StreamRef<'_>) -> Result<()> {
        Ok(())
    }
}

/// Host ordering that logs every request, so tests can check when a suballocator orders streams
/// (and that it does not on plain frees).
#[derive(Debug, Default)]
pub struct RecordingOrder {
    log: Mutex<Vec<OrderEvent>>,
    /// Marks are never complete (see [`RecordingOrder::pending`]).
    pending: bool,
}

/// One request seen by [`RecordingOrder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderEvent {
    /// `mark(stream)`.
    Mark(StreamId),
    /// `wait_for_mark(waiter, signaller)` with distinct streams.
    Wait {
        /// The stream made to wait.
        waiter: StreamId,
        /// The stream whose mark it waits on.
        signaller: StreamId,
    },
    /// `mark_complete(signaller)`.
    Query(StreamId),
    /// `synchronize_all()`.
    SyncAll,
    /// `synchronize(stream)`.
    Sync(StreamId),
}

impl RecordingOrder {
    /// An empty log; every mark is complete, as on a device with no work queued.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty log; no mark is ever complete, as on a device far behind the host.
    pub fn pending() -> Self {
        RecordingOrder {
            pending: true,
            ..Self::default()
        }
    }

    /// Everything requested so far.
    pub fn events(&self) -> Vec<OrderEvent> {
        lock(&self.log).clone()
    }

    fn push(&self, e: OrderEvent) {
        lock(&self.log).push(e);
    }
}

impl StreamOrder for RecordingOrder {
    fn mark(&self, stream: StreamRef<'_>) -> Result<()> {
        self.push(OrderEvent::Mark(stream.id()));
        Ok(())
    }
    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()> {
        if waiter.id() != signaller {
            self.push(OrderEvent::Wait {
                waiter: waiter.id(),
                signaller,
            });
        }
        Ok(())
    }
    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        self.push(OrderEvent::Query(signaller));
        Ok(!self.pending)
    }
    fn synchronize_all(&self) -> Result<()> {
        self.push(OrderEvent::SyncAll);
        Ok(())
    }
    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        self.push(OrderEvent::Sync(stream.id()));
        Ok(())
    }
}

/// An ordering that forwards every request to another and counts them, so that a report can
/// say how often a suballocator made the device order its streams (`carve replay` does).
#[derive(Debug)]
pub struct CountingOrder {
    inner: Arc<dyn StreamOrder>,
    marks: AtomicU64,
    queries: AtomicU64,
    waits: AtomicU64,
    device_syncs: AtomicU64,
    stream_syncs: AtomicU64,
    clock: crate::resource::engine::call_clock::CallClock,
}

/// What a [`CountingOrder`] was asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OrderCounts {
    /// `mark`s (an event record each, on a GPU).
    pub marks: u64,
    /// `mark_complete`s (an event query each, on a GPU).
    pub queries: u64,
    /// `wait_for_mark`s between distinct streams (a `cuStreamWaitEvent` each, or a device
    /// synchronisation for a stream never marked).
    pub waits: u64,
    /// `synchronize_all`s (device-wide synchronisations).
    pub device_synchronizations: u64,
    /// `synchronize`s of one stream.
    pub stream_synchronizations: u64,
    /// Wall time in all of these calls.
    pub time: std::time::Duration,
}

impl CountingOrder {
    /// Counts the requests passed on to `inner`.
    pub fn new(inner: Arc<dyn StreamOrder>) -> Self {
        CountingOrder {
            inner,
            marks: AtomicU64::new(0),
            queries: AtomicU64::new(0),
            waits: AtomicU64::new(0),
            device_syncs: AtomicU64::new(0),
            stream_syncs: AtomicU64::new(0),
            clock: crate::resource::engine::call_clock::CallClock::default(),
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> OrderCounts {
        OrderCounts {
            marks: self.marks.load(Ordering::Relaxed),
            queries: self.queries.load(Ordering::Relaxed),
            waits: self.waits.load(Ordering::Relaxed),
            device_synchronizations: self.device_syncs.load(Ordering::Relaxed),
            stream_synchronizations: self.stream_syncs.load(Ordering::Relaxed),
            time: self.clock.total(),
        }
    }
}

impl StreamOrder for CountingOrder {
    fn mark(&self, stream: StreamRef<'_>) -> Result<()> {
        self.marks.fetch_add(1, Ordering::Relaxed);
        self.clock.time(|| self.inner.mark(stream))
    }
    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()> {
        if waiter.id() != signaller {
            self.waits.fetch_add(1, Ordering::Relaxed);
        }
        self.clock
            .time(|| self.inner.wait_for_mark(waiter, signaller))
    }
    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        self.queries.fetch_add(1, Ordering::Relaxed);
        self.clock.time(|| self.inner.mark_complete(signaller))
    }
    fn synchronize_all(&self) -> Result<()> {
        self.device_syncs.fetch_add(1, Ordering::Relaxed);
        self.clock.time(|| self.inner.synchronize_all())
    }
    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        self.stream_syncs.fetch_add(1, Ordering::Relaxed);
        self.clock.time(|| self.inner.synchronize(stream))
    }
}

/// The ordering a suballocator over `upstream` needs: none for host memory, events on the
/// upstream's own device for memory that kernels touch (never the thread's current device).
pub(crate) fn default_order<R: MemoryResource + ?Sized>(
    upstream: &R,
) -> Result<Arc<dyn StreamOrder>> {
    order_for(upstream.properties(), upstream.device(), &upstream)
}

/// The ordering memory with `properties` on `device` needs (see [`default_order`]); `source`
/// names where it comes from in the error.
pub(crate) fn order_for(
    properties: crate::resource::memory_resource::Properties,
    device: Option<Device>,
    source: &dyn fmt::Debug,
) -> Result<Arc<dyn StreamOrder>> {
    match (properties.device_accessible, device) {
        (true, Some(device)) => Ok(Arc::new(CudaOrder::new(&device))),
        (true, None) => Err(Error::InvalidArgument(format!(
            "{source:?} gives device-accessible memory but names no device; pass a stream \
             order explicitly"
        ))),
        (false, _) => Ok(Arc::new(HostOrder)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Device;
    use crate::resource::memory_resource::Properties;
    use crate::resource::source::host::HostMemoryResource;
    use crate::resource::suballoc::pool::{PoolMemoryResource, PoolOptions};
    use std::ptr::NonNull;

    /// Claims device-accessible memory but names no device.
    #[derive(Debug)]
    struct Nameless(HostMemoryResource);

    // SAFETY: delegates to host memory.
    unsafe impl MemoryResource for Nameless {
        fn allocate(&self, s: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
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
            Properties::DEVICE
        }
        fn device(&self) -> Option<Device> {
            None
        }
    }

    /// Host ordering whose device-wide synchronisation takes 2 ms.
    #[derive(Debug)]
    struct SlowSync;

    impl StreamOrder for SlowSync {
        fn mark(&self, _: StreamRef<'_>) -> Result<()> {
            Ok(())
        }
        fn wait_for_mark(&self, _: StreamRef<'_>, _: StreamId) -> Result<()> {
            Ok(())
        }
        fn synchronize_all(&self) -> Result<()> {
            std::thread::sleep(std::time::Duration::from_millis(2));
            Ok(())
        }
        fn synchronize(&self, _: StreamRef<'_>) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn counting_order_adds_up_the_time_of_the_calls_it_passes_on() {
        let order = CountingOrder::new(Arc::new(SlowSync));
        order.mark(StreamRef::simulated(1)).unwrap();
        assert!(order.counts().time < std::time::Duration::from_millis(2));
        order.synchronize_all().unwrap();
        order.synchronize_all().unwrap();
        let c = order.counts();
        assert_eq!((c.marks, c.device_synchronizations), (1, 2));
        assert!(c.time >= std::time::Duration::from_millis(4), "{c:?}");
    }

    #[test]
    fn ordering_follows_the_upstreams_device_never_the_current_one() {
        // Host memory: no device, no ordering.
        assert!(HostMemoryResource::new().device().is_none());
        assert!(
            format!("{:?}", default_order(&HostMemoryResource::new()).unwrap())
                .contains("HostOrder")
        );
        // Device memory with no device to order on is refused, not ordered on whatever
        // device is current.
        let err = PoolMemoryResource::new(Nameless(HostMemoryResource::new()), PoolOptions::new(0))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
        // An explicit order is always accepted.
        let ok = PoolMemoryResource::new(
            Nameless(HostMemoryResource::new()),
            PoolOptions::new(0).order(Arc::new(HostOrder)),
        );
        assert!(ok.is_ok());
    }

    #[test]
    fn recording_order_logs_marks_cross_stream_waits_and_syncs() {
        let o = RecordingOrder::new();
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        o.mark(b).unwrap();
        o.wait_for_mark(a, a.id()).unwrap();
        o.wait_for_mark(a, b.id()).unwrap();
        o.synchronize_all().unwrap();
        o.synchronize(b).unwrap();
        let (a, b) = (a.id(), b.id());
        assert_eq!(
            o.events(),
            vec![
                OrderEvent::Mark(b),
                OrderEvent::Wait {
                    waiter: a,
                    signaller: b
                },
                OrderEvent::SyncAll,
                OrderEvent::Sync(b)
            ]
        );
    }

    /// Counts what a pool asks for and passes every request on: a block freed on one stream
    /// and wanted on another costs a mark and a wait, and both reach the inner order.
    #[test]
    fn counting_order_counts_and_forwards_what_a_pool_asks() {
        let log = Arc::new(RecordingOrder::new());
        let counting = Arc::new(CountingOrder::new(log.clone()));
        let pool = PoolMemoryResource::new(
            HostMemoryResource::new(),
            PoolOptions::new(1 << 20).order(counting.clone()).shards(1),
        )
        .unwrap();
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let mut blocks = Vec::new();
        for _ in 0..4 {
            blocks.push(pool.allocate(a, 256 << 10, 256).unwrap());
        }
        for p in blocks {
            // SAFETY: allocated above from this pool with these arguments, freed once.
            unsafe { pool.deallocate(a, p, 256 << 10, 256) }.unwrap();
        }
        // All of the pool's memory was freed on `a`; `b` can have it only through ordering.
        let p = pool.allocate(b, 1 << 20, 256).unwrap();
        // SAFETY: as above.
        unsafe { pool.deallocate(b, p, 1 << 20, 256) }.unwrap();
        let events = log.events();
        let count = |f: fn(&OrderEvent) -> bool| events.iter().filter(|e| f(e)).count() as u64;
        let counts = counting.counts();
        assert_eq!(
            counts,
            OrderCounts {
                marks: count(|e| matches!(e, OrderEvent::Mark(_))),
                queries: count(|e| matches!(e, OrderEvent::Query(_))),
                waits: count(|e| matches!(e, OrderEvent::Wait { .. })),
                device_synchronizations: count(|e| matches!(e, OrderEvent::SyncAll)),
                stream_synchronizations: count(|e| matches!(e, OrderEvent::Sync(_))),
                // Times vary; they are checked against a slow order elsewhere.
                time: counts.time,
            }
        );
        assert!(
            counts.waits + counts.device_synchronizations > 0,
            "{counts:?}: the second stream took memory freed on the first without ordering"
        );
    }
}
