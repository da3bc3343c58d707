//! Segment events: a callback told of each chunk a virtual-memory resource maps and unmaps, so
//! that a caller can register memory with a communication library (NCCL's `ncclCommRegister`,
//! NIXL) as it appears and deregister it as it goes.
//!
//! Changes are queued under the resource's lock, in the order they happen, and handed to the
//! callback after the lock is released, one thread at a time: the callback may call back into
//! the resource. A call that queued a change, or found one queued, returns only once it was
//! delivered, so no pointer is handed out on a chunk the callback has not yet heard of.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::Error;
use crate::sync::lock;

/// What happened to a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SegmentChange {
    /// The chunk is mapped, with the backing's access granted: register it now.
    Mapped,
    /// The chunk is no longer mapped there: no live block and no queued work uses it. Deregister
    /// it.
    Unmapped,
}

/// One physical chunk of a virtual-memory resource, mapped or unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SegmentEvent {
    /// Its first byte.
    pub addr: usize,
    /// Its bytes (the resource's chunk size).
    pub size: usize,
    /// Mapped or unmapped.
    pub change: SegmentChange,
}

/// A callback for [`SegmentEvent`]s. It runs outside the resource's lock, on the thread whose
/// call caused the change (or on one that waits for it), one event at a time, and may call back
/// into the resource. A panic is caught and counted, and recorded as a deferred error
/// ([`crate::take_deferred_error`]).
pub type SegmentCallback = Arc<dyn Fn(SegmentEvent) + Send + Sync>;

/// The queue between a resource's lock and its callback.
#[derive(Default)]
pub(crate) struct Segments {
    queue: Mutex<Queue>,
    /// Events queued and not yet delivered (or dropped).
    pending: AtomicUsize,
    /// Held while delivering: one thread at a time, in order.
    deliver: Mutex<()>,
    panics: AtomicU64,
}

#[derive(Default)]
struct Queue {
    events: VecDeque<SegmentEvent>,
    callback: Option<SegmentCallback>,
}

thread_local! {
    /// The queues this thread is delivering from (a callback that calls back into its resource
    /// leaves its own events to the delivery loop that runs it).
    static DELIVERING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

impl Segments {
    /// Queues `events` (drained) in order; the caller holds the resource's lock, so the queue
    /// keeps the order of changes. Without a callback they are dropped.
    pub fn push(&self, events: &mut Vec<SegmentEvent>) {
        if events.is_empty() {
            return;
        }
        let mut q = lock(&self.queue);
        if q.callback.is_none() {
            events.clear();
            return;
        }
        self.pending.fetch_add(events.len(), Ordering::AcqRel);
        q.events.extend(events.drain(..));
    }

    /// Replaces the callback (the caller holds the resource's lock): events not yet delivered
    /// are dropped, and the new callback first hears of every chunk in `mapped`. Returns the
    /// callback replaced, for the caller to drop once the lock is released.
    #[must_use]
    pub fn set(
        &self,
        callback: Option<SegmentCallback>,
        mapped: impl Iterator<Item = SegmentEvent>,
    ) -> Option<SegmentCallback> {
        let mut q = lock(&self.queue);
        let dropped = q.events.len();
        q.events.clear();
        self.pending.fetch_sub(dropped, Ordering::AcqRel);
        if callback.is_some() {
            q.events.extend(mapped);
            self.pending.fetch_add(q.events.len(), Ordering::AcqRel);
        }
        std::mem::replace(&mut q.callback, callback)
    }

    /// Callbacks that panicked so far.
    pub fn panics(&self) -> u64 {
        self.panics.load(Ordering::Relaxed)
    }

    /// Hands every queued event to the callback, outside the resource's lock. Returns once the
    /// queue is empty, unless this thread is already delivering from it (a callback calling
    /// back into the resource): that loop delivers the rest.
    pub fn deliver(&self) {
        if self.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let me = self as *const Self as usize;
        if DELIVERING.with(|d| d.borrow().contains(&me)) {
            return;
        }
        let _one = lock(&self.deliver);
        DELIVERING.with(|d| d.borrow_mut().push(me));
        loop {
            let next = {
                let mut q = lock(&self.queue);
                q.events.pop_front().map(|e| (e, q.callback.clone()))
            };
            let Some((event, callback)) = next else { break };
            if let Some(cb) = callback {
                if std::panic::catch_unwind(AssertUnwindSafe(|| cb(event))).is_err() {
                    self.panics.fetch_add(1, Ordering::Relaxed);
                    crate::deferred::record::<()>(
                        "VirtualMemoryResource: the segment callback panicked",
                        Err(Error::InvalidArgument(format!(
                            "segment callback panicked on {:?} of {:#x} ({} bytes)",
                            event.change, event.addr, event.size
                        ))),
                    );
                }
            }
            // Counted down only once delivered: a thread that finds events pending waits here.
            self.pending.fetch_sub(1, Ordering::AcqRel);
        }
        DELIVERING.with(|d| d.borrow_mut().retain(|&x| x != me));
    }
}
