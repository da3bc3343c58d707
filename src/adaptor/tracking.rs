//! Outstanding-allocation tracking, as RMM's `tracking_resource_adaptor`, plus double-free and
//! foreign-pointer detection that stops bad frees before they reach the upstream.

use std::backtrace::Backtrace;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt::Write as _;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::{MemoryResource, Properties};
use crate::snapshot::Action;
use crate::stream::{StreamId, StreamRef};
use crate::sync::lock;

#[path = "tracking_history.rs"]
mod history;

const NAME: &str = "TrackingResourceAdaptor";

/// How many freed addresses are remembered to tell a double free from a foreign pointer.
const FREED_MEMORY: usize = 1 << 16;

/// One outstanding block.
#[derive(Clone, Debug)]
pub struct Allocation {
    /// The block's address.
    pub ptr: usize,
    /// Its size as requested.
    pub bytes: usize,
    /// Its alignment as requested.
    pub align: usize,
    /// The stream it was allocated on.
    pub stream: StreamId,
    /// That stream's raw handle, as logs and snapshots show it
    /// ([`StreamRef::raw_value`]).
    pub stream_handle: usize,
    /// Where it was allocated, when the adaptor captures backtraces.
    pub backtrace: Option<Arc<Backtrace>>,
}

/// Records every outstanding block of its upstream.
///
/// A free of a pointer it does not hold is refused with [`Error::DoubleFree`] (the address was
/// freed recently: the last 65,536 freed addresses are remembered) or [`Error::UnknownPointer`],
/// and a free with the wrong size with [`Error::SizeMismatch`]; none of these reach the upstream.
#[derive(Debug)]
pub struct TrackingResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R> {
    upstream: R,
    capture_backtraces: bool,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    live: HashMap<usize, Allocation>,
    bytes: usize,
    freed: HashSet<usize>,
    freed_order: VecDeque<usize>,
    history: history::History,
}

impl State {
    fn remember_freed(&mut self, addr: usize) {
        if self.freed.insert(addr) {
            self.freed_order.push_back(addr);
            if self.freed_order.len() > FREED_MEMORY {
                if let Some(old) = self.freed_order.pop_front() {
                    self.freed.remove(&old);
                }
            }
        }
    }
}

impl<R> Clone for TrackingResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> TrackingResourceAdaptor<R> {
    /// Tracks `upstream`; with `capture_backtraces`, each block records where it was allocated
    /// (costly: use it to hunt a leak, not in production).
    pub fn new(upstream: R, capture_backtraces: bool) -> Self {
        Self {
            inner: Arc::new(Inner {
                upstream,
                capture_backtraces,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Bytes outstanding.
    pub fn allocated_bytes(&self) -> usize {
        lock(&self.inner.state).bytes
    }

    /// Number of outstanding blocks.
    pub fn allocation_count(&self) -> usize {
        lock(&self.inner.state).live.len()
    }

    /// The outstanding blocks, by address.
    pub fn outstanding(&self) -> Vec<Allocation> {
        let mut all: Vec<_> = lock(&self.inner.state).live.values().cloned().collect();
        all.sort_by_key(|a| a.ptr);
        all
    }

    /// A human-readable list of the outstanding blocks (empty string when there are none).
    pub fn leak_report(&self) -> String {
        let leaks = self.outstanding();
        if leaks.is_empty() {
            return String::new();
        }
        let total: usize = leaks.iter().map(|a| a.bytes).sum();
        let mut out = format!(
            "{} outstanding allocation(s), {total} bytes:\n",
            leaks.len()
        );
        for a in &leaks {
            let _ = writeln!(
                out,
                "  {:#x}: {} bytes (align {}) on {:?}",
                a.ptr, a.bytes, a.align, a.stream
            );
            if let Some(bt) = &a.backtrace {
                for line in bt.to_string().lines() {
                    let _ = writeln!(out, "      {line}");
                }
            }
        }
        out
    }
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract; frees reach the
// upstream only for blocks this adaptor holds as live.
unsafe impl<R: MemoryResource> MemoryResource for TrackingResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let ptr = match self.inner.upstream.allocate(stream, bytes, align) {
            Ok(ptr) => ptr,
            Err(e) => {
                if e.is_out_of_memory() {
                    let mut state = lock(&self.inner.state);
                    state
                        .history
                        .push(Action::Oom, 0, bytes, stream.raw_value(), None);
                }
                return Err(e);
            }
        };
        let backtrace = self
            .inner
            .capture_backtraces
            .then(|| Arc::new(Backtrace::force_capture()));
        let addr = ptr.as_ptr() as usize;
        let mut state = lock(&self.inner.state);
        state.freed.remove(&addr);
        state.bytes += bytes;
        state.history.push(
            Action::Alloc,
            addr,
            bytes,
            stream.raw_value(),
            backtrace.clone(),
        );
        state.live.insert(
            addr,
            Allocation {
                ptr: addr,
                bytes,
                align,
                stream: stream.id(),
                stream_handle: stream.raw_value(),
                backtrace,
            },
        );
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
        // Take the block out under the lock, so of two racing frees exactly one reaches the
        // upstream.
        let taken = {
            let mut state = lock(&self.inner.state);
            match state.live.get(&addr) {
                None if state.freed.contains(&addr) => {
                    return Err(Error::DoubleFree {
                        resource: NAME,
                        ptr: addr,
                    })
                }
                None => {
                    return Err(Error::UnknownPointer {
                        resource: NAME,
                        ptr: addr,
                    })
                }
                Some(a) if a.bytes != bytes => {
                    return Err(Error::SizeMismatch {
                        resource: NAME,
                        ptr: addr,
                        allocated: a.bytes,
                        freed: bytes,
                    })
                }
                Some(_) => {}
            }
            let taken = state.live.remove(&addr).expect("present: checked above");
            state.bytes -= bytes;
            state.remember_freed(addr);
            taken
        };
        // SAFETY: the block was live in our map, so it came from the upstream with these
        // arguments, and removing it means no other free of it passes.
        let result = unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) };
        let mut state = lock(&self.inner.state);
        if result.is_err() {
            // The upstream kept the block: it is still outstanding.
            state.freed.remove(&addr);
            state.bytes += bytes;
            state.live.insert(addr, taken);
        } else {
            let bt = taken.backtrace;
            state
                .history
                .push(Action::FreeCompleted, addr, bytes, stream.raw_value(), bt);
        }
        result
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        Ok(Some(crate::resource::MemoryStats::in_use(
            self.allocated_bytes(),
            self.allocation_count(),
        )))
    }
}
