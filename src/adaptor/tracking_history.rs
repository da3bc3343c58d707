//! The tracking adaptor's event history (as `torch.cuda.memory._record_memory_history`) and its
//! snapshots in PyTorch's format.

use std::backtrace::Backtrace;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::TrackingResourceAdaptor;
use crate::error::Result;
use crate::resource::MemoryResource;
use crate::snapshot::{frames_of, Action, BlockSpan, SegmentSpan, Snapshot, TraceEntry};
use crate::sync::lock;

/// Orders events across trackers (a client-side one and the one on its upstream).
static SEQUENCE: AtomicU64 = AtomicU64::new(0);

/// What a tracker did, kept until a snapshot converts it.
#[derive(Clone, Debug)]
pub(super) struct Recorded {
    seq: u64,
    action: Action,
    addr: u64,
    size: u64,
    stream: u64,
    time_us: i64,
    backtrace: Option<Arc<Backtrace>>,
}

/// A bounded ring of events; `max == 0` records nothing.
#[derive(Debug, Default)]
pub(super) struct History {
    max: usize,
    events: VecDeque<Recorded>,
}

impl History {
    pub(super) fn push(
        &mut self,
        action: Action,
        addr: usize,
        size: usize,
        stream: usize,
        backtrace: Option<Arc<Backtrace>>,
    ) {
        if self.max == 0 {
            return;
        }
        if self.events.len() == self.max {
            self.events.pop_front();
        }
        self.events.push_back(Recorded {
            seq: SEQUENCE.fetch_add(1, Ordering::Relaxed),
            action,
            addr: addr as u64,
            size: size as u64,
            stream: stream as u64,
            time_us: crate::snapshot::now_us(),
            backtrace,
        });
    }
}

/// Converts events; as a segment tracker, client actions become segment actions.
fn entries(events: &[Recorded], as_segments: bool) -> Vec<(u64, TraceEntry)> {
    let mut out = Vec::with_capacity(events.len() * 2);
    for e in events {
        let frames = e.backtrace.as_deref().map(frames_of).unwrap_or_default();
        let mut push = |action: Action| {
            out.push((
                e.seq,
                TraceEntry {
                    action,
                    addr: e.addr,
                    size: e.size,
                    stream: e.stream,
                    time_us: e.time_us,
                    frames: frames.clone(),
                    device_free: None,
                },
            ))
        };
        match (&e.action, as_segments) {
            (Action::Alloc, true) => push(Action::SegmentAlloc),
            (Action::FreeCompleted, true) => push(Action::SegmentFree),
            (Action::Oom, true) => {}
            (Action::FreeCompleted, false) => {
                push(Action::FreeRequested);
                push(Action::FreeCompleted);
            }
            (a, _) => push(a.clone()),
        }
    }
    out
}

impl<R: MemoryResource> TrackingResourceAdaptor<R> {
    /// Starts recording allocations, frees and failed requests, keeping the last `max_entries`
    /// (as `torch.cuda.memory._record_memory_history(max_entries=...)`); 0 stops and forgets.
    /// Backtraces are attached when the adaptor captures them.
    pub fn record_history(&self, max_entries: usize) {
        let mut state = lock(&self.inner.state);
        state.history.max = max_entries;
        while state.history.events.len() > max_entries {
            state.history.events.pop_front();
        }
    }

    fn spans_and_events(&self) -> (Vec<BlockSpan>, Vec<Recorded>) {
        let (live, events) = {
            let state = lock(&self.inner.state);
            let live: Vec<_> = state.live.values().cloned().collect();
            (live, state.history.events.iter().cloned().collect())
        };
        let spans = live
            .into_iter()
            .map(|a| BlockSpan {
                address: a.ptr as u64,
                size: a.bytes as u64,
                stream: a.stream_handle as u64,
                frames: a.backtrace.as_deref().map(frames_of).unwrap_or_default(),
            })
            .collect();
        (spans, events)
    }

    /// A snapshot in PyTorch's format of device `device` (the ordinal the viewer shows), taking
    /// each outstanding block as memory reserved on its own, as for a tracker over a plain
    /// resource (`cuMemAlloc` per request). Events are those [`record_history`] kept.
    ///
    /// [`record_history`]: Self::record_history
    ///
    /// A device ordinal of [`MAX_DEVICES`](crate::snapshot::MAX_DEVICES) or more is an error.
    pub fn snapshot(&self, device: u64) -> Result<Snapshot> {
        let (blocks, events) = self.spans_and_events();
        let segments: Vec<SegmentSpan> = blocks
            .iter()
            .map(|b| SegmentSpan {
                address: b.address,
                size: b.size,
                stream: b.stream,
            })
            .collect();
        // Each block is its own segment: its events are segment events too.
        let mut trace = Vec::new();
        for (_, e) in entries(&events, false) {
            let mirror = match e.action {
                Action::Alloc => Some(Action::SegmentAlloc),
                Action::FreeCompleted => Some(Action::SegmentFree),
                _ => None,
            };
            match mirror {
                Some(Action::SegmentAlloc) => {
                    let seg = TraceEntry {
                        action: Action::SegmentAlloc,
                        ..e.clone()
                    };
                    trace.push(seg);
                    trace.push(e);
                }
                Some(m) => {
                    let seg = TraceEntry {
                        action: m,
                        ..e.clone()
                    };
                    trace.push(e);
                    trace.push(seg);
                }
                None => trace.push(e),
            }
        }
        Snapshot::from_spans(device, &segments, &blocks, trace)
    }

    /// A snapshot of device `device` where this adaptor tracks a suballocator's clients and
    /// `upstream` tracks the suballocator's upstream: segments are `upstream`'s outstanding
    /// blocks, tiled by this adaptor's, and the two histories merge in the order they happened.
    pub fn snapshot_over<U: MemoryResource>(
        &self,
        device: u64,
        upstream: &TrackingResourceAdaptor<U>,
    ) -> Result<Snapshot> {
        let (blocks, events) = self.spans_and_events();
        let (segment_blocks, segment_events) = upstream.spans_and_events();
        let segments: Vec<SegmentSpan> = segment_blocks
            .into_iter()
            .map(|b| SegmentSpan {
                address: b.address,
                size: b.size,
                stream: b.stream,
            })
            .collect();
        let mut merged = entries(&events, false);
        merged.extend(entries(&segment_events, true));
        // Stable: a free's requested/completed pair keeps its order.
        merged.sort_by_key(|(seq, _)| *seq);
        let trace = merged.into_iter().map(|(_, e)| e).collect();
        Snapshot::from_spans(device, &segments, &blocks, trace)
    }
}
