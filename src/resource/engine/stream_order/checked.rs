//! [`CheckedOrder`]: a stream order for tests. It fails or panics on the calls a
//! [`FaultPattern`] picks, and, through [`CheckedResource`], checks the stream-ordering rule
//! itself: a block freed on stream A reaches stream B only after an ordering call that covers
//! that free has succeeded.
//!
//! The model: every successful call gets a time. A free on A at time `t` is covered for B by a
//! device-wide synchronisation after `t`, a synchronisation of A after `t`, a mark of A after
//! `t` that B waited on or that a query found complete. A wait on a stream never marked counts
//! as a device-wide synchronisation, as [`CudaOrder`](super::CudaOrder) makes it one.
//!
//! Ordering is transitive, as with CUDA events: a mark of A captures the marks A had waited on,
//! so B waiting on it is ordered after them too (and a synchronisation of A, or a query that
//! finds A's mark complete, covers them as well).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

use super::StreamOrder;
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::memory_resource::{MemoryResource, Properties};
use crate::resource::FaultPattern;
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

/// Which ordering calls fail or panic. Calls are numbered from 1 across all kinds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct OrderFaults {
    /// Calls that return a driver error (`CUDA_ERROR_LAUNCH_FAILED`) and order nothing.
    pub fail: FaultPattern,
    /// Calls that panic and order nothing (checked after `fail`).
    pub panic: FaultPattern,
    /// Queries never find a mark complete, as on a device far behind the host.
    pub pending: bool,
}

/// What a [`CheckedOrder`] saw.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CheckedCounts {
    /// Ordering calls made.
    pub calls: u64,
    /// Of those, failed on purpose.
    pub failed: u64,
    /// Of those, panicked on purpose.
    pub panicked: u64,
    /// Blocks handed to a stream other than the one that freed them, with a covering call.
    pub crossings: u64,
}

/// A stream order that injects faults and records what it ordered; see the module docs.
pub struct CheckedOrder {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    faults: OrderFaults,
    now: u64,
    counts: CheckedCounts,
    last_mark: HashMap<StreamId, u64>,
    /// (waiter, signaller) -> the latest time of the signaller's work the waiter is ordered
    /// after (directly, or through marks of streams that were).
    waited: HashMap<(StreamId, StreamId), u64>,
    /// What each stream was ordered after at its last mark: (signaller, time).
    mark_knows: HashMap<StreamId, Vec<(StreamId, u64)>>,
    /// The latest mark of a stream that a query found complete.
    complete: HashMap<StreamId, u64>,
    synced: HashMap<StreamId, u64>,
    device_synced: u64,
    /// Freed ranges not yet handed out again: start -> (end, stream, time).
    freed: BTreeMap<usize, (usize, StreamId, u64)>,
    violations: Vec<String>,
}

impl State {
    fn tick(&mut self) -> u64 {
        self.now += 1;
        self.now
    }

    /// What `stream` is ordered after now: (signaller, time).
    fn knows(&self, stream: StreamId) -> Vec<(StreamId, u64)> {
        self.waited
            .iter()
            .filter(|((w, _), _)| *w == stream)
            .map(|(&(_, from), &at)| (from, at))
            .collect()
    }

    /// Whether a free on `from` at `t` may go to `to` now.
    fn covered(&self, from: StreamId, t: u64, to: StreamId) -> bool {
        let after = |v: Option<&u64>| v.is_some_and(|&m| m > t);
        from == to
            || self.device_synced > t
            || after(self.synced.get(&from))
            || after(self.complete.get(&from))
            || after(self.waited.get(&(to, from)))
    }

    /// Removes `[start, end)` from the freed ranges, keeping the parts outside it, and returns
    /// the records that overlapped.
    fn take(&mut self, start: usize, end: usize) -> Vec<(StreamId, u64)> {
        let first = self
            .freed
            .range(..start)
            .next_back()
            .filter(|(_, &(e, _, _))| e > start)
            .map(|(&s, _)| s)
            .unwrap_or(start);
        let hits: Vec<usize> = self.freed.range(first..end).map(|(&s, _)| s).collect();
        let mut taken = Vec::with_capacity(hits.len());
        for s in hits {
            let (e, stream, t) = self.freed.remove(&s).expect("listed above");
            if s < start {
                self.freed.insert(s, (start, stream, t));
            }
            if e > end {
                self.freed.insert(end, (e, stream, t));
            }
            taken.push((stream, t));
        }
        taken
    }
}

impl CheckedOrder {
    /// A checker with these faults.
    pub fn new(faults: OrderFaults) -> Arc<CheckedOrder> {
        Arc::new(CheckedOrder {
            state: Mutex::new(State {
                faults,
                ..State::default()
            }),
        })
    }

    /// Replaces the faults (call numbering goes on).
    pub fn set_faults(&self, faults: OrderFaults) {
        lock(&self.state).faults = faults;
    }

    /// Wraps the resource under test: blocks freed through it are tracked, and a block it hands
    /// to another stream without a covering ordering call is a violation.
    pub fn check<R: MemoryResource>(self: &Arc<Self>, resource: R) -> CheckedResource<R> {
        CheckedResource {
            inner: resource,
            order: self.clone(),
            upstream: false,
        }
    }

    /// Wraps the upstream of the resource under test. Its frees wait for the device, as
    /// `cuMemFree` does, so a range returned to it is no longer tracked.
    pub fn upstream<R: MemoryResource>(self: &Arc<Self>, resource: R) -> CheckedResource<R> {
        CheckedResource {
            inner: resource,
            order: self.clone(),
            upstream: true,
        }
    }

    /// Every block handed to a stream before its free was ordered, described.
    pub fn violations(&self) -> Vec<String> {
        lock(&self.state).violations.clone()
    }

    /// What was asked and injected so far.
    pub fn counts(&self) -> CheckedCounts {
        lock(&self.state).counts
    }

    /// Numbers a call and injects its fault; `Ok(state)` lets it take effect.
    fn call(&self, what: &'static str) -> Result<MutexGuard<'_, State>> {
        let mut s = lock(&self.state);
        s.counts.calls += 1;
        let n = s.counts.calls;
        if s.faults.fail.fails(n) {
            s.counts.failed += 1;
            return Err(Error::driver(
                what,
                DriverError(CUresult::CUDA_ERROR_LAUNCH_FAILED),
            ));
        }
        if s.faults.panic.fails(n) {
            s.counts.panicked += 1;
            drop(s);
            panic!("injected panic in {what}");
        }
        Ok(s)
    }
}

impl fmt::Debug for CheckedOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = lock(&self.state);
        f.debug_struct("CheckedOrder")
            .field("faults", &s.faults)
            .field("counts", &s.counts)
            .field("violations", &s.violations.len())
            .finish()
    }
}

impl StreamOrder for CheckedOrder {
    fn mark(&self, stream: StreamRef<'_>) -> Result<()> {
        let mut s = self.call("mark")?;
        let t = s.tick();
        s.last_mark.insert(stream.id(), t);
        let knows = s.knows(stream.id());
        s.mark_knows.insert(stream.id(), knows);
        Ok(())
    }

    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()> {
        if waiter.id() == signaller {
            return Ok(());
        }
        let mut s = self.call("wait_for_mark")?;
        let t = s.tick();
        match s.last_mark.get(&signaller).copied() {
            Some(m) => {
                let inherited = s.mark_knows.get(&signaller).cloned().unwrap_or_default();
                for (from, at) in inherited.into_iter().chain([(signaller, m)]) {
                    let w = s.waited.entry((waiter.id(), from)).or_default();
                    *w = (*w).max(at);
                }
            }
            None => s.device_synced = t,
        }
        Ok(())
    }

    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        let mut s = self.call("mark_complete")?;
        s.tick();
        match s.last_mark.get(&signaller).copied() {
            Some(m) if !s.faults.pending => {
                s.complete.insert(signaller, m);
                let inherited = s.mark_knows.get(&signaller).cloned().unwrap_or_default();
                for (from, at) in inherited {
                    let c = s.complete.entry(from).or_default();
                    *c = (*c).max(at);
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn synchronize_all(&self) -> Result<()> {
        let mut s = self.call("synchronize_all")?;
        s.device_synced = s.tick();
        Ok(())
    }

    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        let mut s = self.call("synchronize")?;
        let t = s.tick();
        s.synced.insert(stream.id(), t);
        for (from, at) in s.knows(stream.id()) {
            let c = s.synced.entry(from).or_default();
            *c = (*c).max(at);
        }
        Ok(())
    }
}

/// A resource whose frees and allocations a [`CheckedOrder`] watches; see
/// [`CheckedOrder::check`] and [`CheckedOrder::upstream`].
pub struct CheckedResource<R> {
    inner: R,
    order: Arc<CheckedOrder>,
    upstream: bool,
}

impl<R: fmt::Debug> fmt::Debug for CheckedResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CheckedResource")
            .field("inner", &self.inner)
            .field("upstream", &self.upstream)
            .finish()
    }
}

impl<R> CheckedResource<R> {
    /// The wrapped resource.
    pub fn inner(&self) -> &R {
        &self.inner
    }
}

// SAFETY: pure delegation, with bookkeeping on the side; the inner resource upholds the
// contract.
unsafe impl<R: MemoryResource> MemoryResource for CheckedResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let p = self.inner.allocate(stream, bytes, align)?;
        if !self.upstream {
            let mut s = lock(&self.order.state);
            let start = p.as_ptr() as usize;
            for (from, t) in s.take(start, start.saturating_add(bytes)) {
                if s.covered(from, t, stream.id()) {
                    s.counts.crossings += u64::from(from != stream.id());
                } else {
                    let v = format!(
                        "{start:#x} (+{bytes}) freed on {from:?} at {t} went to {:?} at {} \
                         with no ordering call covering the free",
                        stream.id(),
                        s.now
                    );
                    s.violations.push(v);
                }
            }
        }
        Ok(p)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let start = ptr.as_ptr() as usize;
        let end = start.saturating_add(bytes);
        if self.upstream {
            // SAFETY: forwarded caller contract.
            unsafe { self.inner.deallocate(stream, ptr, bytes, align) }?;
            lock(&self.order.state).take(start, end);
            return Ok(());
        }
        // The free is timed before the inner resource sees it: from then on another thread's
        // ordering call may cover it, and must count as later.
        let t = {
            let mut s = lock(&self.order.state);
            s.take(start, end);
            let t = s.tick();
            s.freed.insert(start, (end, stream.id(), t));
            t
        };
        // SAFETY: forwarded caller contract.
        let r = unsafe { self.inner.deallocate(stream, ptr, bytes, align) };
        if r.is_err() {
            // Still live: no free to track.
            let mut s = lock(&self.order.state);
            if s.freed.get(&start).is_some_and(|&(_, _, at)| at == t) {
                s.freed.remove(&start);
            }
        }
        r
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
    use crate::resource::source::host::HostMemoryResource;

    fn setup() -> (Arc<CheckedOrder>, CheckedResource<HostMemoryResource>) {
        let order = CheckedOrder::new(OrderFaults::default());
        let r = order.check(HostMemoryResource::new());
        (order, r)
    }

    /// The host resource may hand a freed address straight back; the checker must see it.
    fn realloc_until_same(
        r: &CheckedResource<HostMemoryResource>,
        s: StreamRef<'_>,
        want: NonNull<u8>,
    ) -> bool {
        let p = r.allocate(s, 64, 64).unwrap();
        p == want
    }

    #[test]
    fn a_block_that_changes_streams_unordered_is_a_violation_and_ordered_is_not() {
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let (order, r) = setup();
        let p = r.allocate(a, 64, 64).unwrap();
        // SAFETY: allocated above, freed once.
        unsafe { r.deallocate(a, p, 64, 64) }.unwrap();
        if realloc_until_same(&r, b, p) {
            assert_eq!(order.violations().len(), 1, "{:?}", order.violations());
        }
        // Directly: a range freed on `a` and then taken on `b`, unordered and then ordered.
        let mut s = lock(&order.state);
        s.freed.clear();
        let t = s.tick();
        s.freed.insert(0x1000, (0x1100, a.id(), t));
        assert!(!s.covered(a.id(), t, b.id()));
        assert!(s.covered(a.id(), t, a.id()));
        drop(s);
        order.mark(a).unwrap();
        assert!(
            !lock(&order.state).covered(a.id(), t, b.id()),
            "a mark alone"
        );
        order.wait_for_mark(b, a.id()).unwrap();
        assert!(
            lock(&order.state).covered(a.id(), t, b.id()),
            "b waited on a's mark"
        );
        assert!(!lock(&order.state).covered(a.id(), t, StreamRef::simulated(3).id()));
    }

    #[test]
    fn a_failed_call_orders_nothing_and_a_mark_before_the_free_does_not_cover_it() {
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        let order = CheckedOrder::new(OrderFaults {
            fail: FaultPattern::Nth(2),
            ..OrderFaults::default()
        });
        order.mark(a).unwrap();
        let t = lock(&order.state).tick();
        order.synchronize_all().unwrap_err();
        assert!(!lock(&order.state).covered(a.id(), t, b.id()));
        order.wait_for_mark(b, a.id()).unwrap();
        assert!(
            !lock(&order.state).covered(a.id(), t, b.id()),
            "the mark predates the free"
        );
        order.synchronize(a).unwrap();
        assert!(lock(&order.state).covered(a.id(), t, b.id()));
        assert_eq!(order.counts().failed, 1);
    }

    #[test]
    fn a_mark_carries_the_marks_its_stream_waited_on() {
        let (a, b, c) = (
            StreamRef::simulated(1),
            StreamRef::simulated(2),
            StreamRef::simulated(3),
        );
        let order = CheckedOrder::new(OrderFaults::default());
        let t = lock(&order.state).tick();
        order.mark(b).unwrap();
        order.mark(a).unwrap();
        order.wait_for_mark(c, a.id()).unwrap();
        assert!(
            !lock(&order.state).covered(b.id(), t, c.id()),
            "a never waited on b"
        );
        order.wait_for_mark(a, b.id()).unwrap();
        assert!(
            !lock(&order.state).covered(b.id(), t, c.id()),
            "c waited on a's mark from before a waited on b"
        );
        order.mark(a).unwrap();
        order.wait_for_mark(c, a.id()).unwrap();
        assert!(
            lock(&order.state).covered(b.id(), t, c.id()),
            "through a's new mark"
        );
        let d = StreamRef::simulated(4);
        assert!(!lock(&order.state).covered(b.id(), t, d.id()));
        order.synchronize(a).unwrap();
        assert!(
            lock(&order.state).covered(b.id(), t, d.id()),
            "a's sync covers what a waited on"
        );
    }

    #[test]
    fn taking_part_of_a_freed_range_keeps_the_rest_tracked() {
        let order = CheckedOrder::new(OrderFaults::default());
        let mut s = lock(&order.state);
        let id = StreamRef::simulated(1).id();
        s.freed.insert(0x1000, (0x2000, id, 1));
        assert_eq!(s.take(0x1400, 0x1800), vec![(id, 1)]);
        let left: Vec<_> = s.freed.iter().map(|(&a, &(b, _, _))| (a, b)).collect();
        assert_eq!(left, vec![(0x1000, 0x1400), (0x1800, 0x2000)]);
    }

    #[test]
    fn injected_panics_unwind_out_of_the_call() {
        let order = CheckedOrder::new(OrderFaults {
            panic: FaultPattern::Nth(1),
            ..OrderFaults::default()
        });
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| order.synchronize_all()));
        assert!(r.is_err());
        assert_eq!(order.counts().panicked, 1);
        order.synchronize_all().unwrap();
    }
}
