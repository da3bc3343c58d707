//! [`FaultInjectingResource`]: makes an upstream fail on purpose (the k-th allocation, every k-th,
//! or a seeded random fraction) and can hold frees back, so tests can check that everything
//! above it survives failures without leaking, corrupting its state or losing a block.

use std::collections::VecDeque;
use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::{FaultPattern, MemoryResource, Properties};
use crate::stream::StreamRef;
use crate::sync::lock;

const NAME: &str = "FaultInjectingResource";

/// What [`FaultInjectingResource`] does.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FaultOptions {
    /// Allocations that fail with [`Error::OutOfMemory`] without reaching the upstream.
    pub allocations: FaultPattern,
    /// Frees that fail with [`Error::Unsupported`] without reaching the upstream (the upstream keeps the block, as a resource that refuses a free must).
    pub frees: FaultPattern,
    /// Frees held back before reaching the upstream: the oldest goes once more than this many
    /// wait. Held frees are passed on by [`flush`](FaultInjectingResource::flush) and on drop.
    ///
    /// A held free outlives the call that made it, and so may its stream; it is passed on with
    /// the stream of the call that evicts it (the default stream for `flush` and drop), after
    /// the upstream's device is synchronised, so no work on the freeing stream can still use
    /// the block.
    pub delay_frees: usize,
}

/// Counts of what a [`FaultInjectingResource`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Allocation calls seen.
    pub allocations: u64,
    /// Of those, failed on purpose.
    pub injected_allocation_failures: u64,
    /// Free calls seen.
    pub frees: u64,
    /// Of those, failed on purpose.
    pub injected_free_failures: u64,
    /// Frees held back right now.
    pub delayed_frees: usize,
}

/// Fails allocations and frees of its upstream on purpose, and can delay frees. For tests.
///
/// An injected allocation failure is [`Error::OutOfMemory`] (what a real upstream says), so
/// retry logic above it runs too. Clones share the counters and options.
pub struct FaultInjectingResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

struct Inner<R: MemoryResource> {
    upstream: R,
    options: Mutex<FaultOptions>,
    allocations: AtomicU64,
    alloc_failures: AtomicU64,
    frees: AtomicU64,
    free_failures: AtomicU64,
    held: Mutex<VecDeque<Held>>,
}

/// A free not yet passed on.
struct Held {
    addr: usize,
    bytes: usize,
    align: usize,
}

impl<R: MemoryResource> Clone for FaultInjectingResource<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> FaultInjectingResource<R> {
    /// Wraps `upstream`, failing as `options` says.
    pub fn new(upstream: R, options: FaultOptions) -> Self {
        Self {
            inner: Arc::new(Inner {
                upstream,
                options: Mutex::new(options),
                allocations: AtomicU64::new(0),
                alloc_failures: AtomicU64::new(0),
                frees: AtomicU64::new(0),
                free_failures: AtomicU64::new(0),
                held: Mutex::new(VecDeque::new()),
            }),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// The options in force.
    pub fn options(&self) -> FaultOptions {
        *lock(&self.inner.options)
    }

    /// Changes the options (call numbering goes on). Lowering `delay_frees` does not release
    /// held frees: [`flush`](Self::flush) does.
    pub fn set_options(&self, options: FaultOptions) {
        *lock(&self.inner.options) = options;
    }

    /// What it did so far.
    pub fn stats(&self) -> FaultStats {
        FaultStats {
            allocations: self.inner.allocations.load(Ordering::Relaxed),
            injected_allocation_failures: self.inner.alloc_failures.load(Ordering::Relaxed),
            frees: self.inner.frees.load(Ordering::Relaxed),
            injected_free_failures: self.inner.free_failures.load(Ordering::Relaxed),
            delayed_frees: lock(&self.inner.held).len(),
        }
    }

    /// Passes every held free on to the upstream; returns the first upstream error (the others
    /// are still attempted).
    pub fn flush(&self) -> Result<()> {
        let held: Vec<Held> = lock(&self.inner.held).drain(..).collect();
        self.inner.release(held, StreamRef::DEFAULT)
    }
}

impl<R: MemoryResource> Inner<R> {
    fn release(&self, held: Vec<Held>, stream: StreamRef<'_>) -> Result<()> {
        if held.is_empty() {
            return Ok(());
        }
        if let Some(device) = self.upstream.device() {
            device.synchronize()?;
        }
        let mut first = Ok(());
        for h in held {
            let ptr = NonNull::new(h.addr as *mut u8).expect("held frees are non-null");
            // SAFETY: the caller freed this block (from our upstream, with these arguments) once;
            // we held it back and pass it on exactly once, having taken it out of the queue.
            let r = unsafe { self.upstream.deallocate(stream, ptr, h.bytes, h.align) };
            if first.is_ok() {
                first = r;
            }
        }
        first
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        let held: Vec<Held> = self
            .held
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        let r = self.release(held, StreamRef::DEFAULT);
        crate::deferred::record("FaultInjectingResource drop: passing on held frees", r);
    }
}

// SAFETY: blocks come unchanged from the upstream; a free reaches the upstream at most once
// (now, or later from the queue), and a held block is not handed out again by anyone: the
// upstream still owns it until the held free reaches it.
unsafe impl<R: MemoryResource> MemoryResource for FaultInjectingResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let n = self.inner.allocations.fetch_add(1, Ordering::Relaxed) + 1;
        if self.options().allocations.fails(n) {
            self.inner.alloc_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: format!("injected failure of allocation #{n}"),
            });
        }
        self.inner.upstream.allocate(stream, bytes, align)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let n = self.inner.frees.fetch_add(1, Ordering::Relaxed) + 1;
        let options = self.options();
        if options.frees.fails(n) {
            self.inner.free_failures.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Unsupported(format!(
                "{NAME}: injected failure of free #{n} ({:#x})",
                ptr.as_ptr() as usize
            )));
        }
        if options.delay_frees == 0 {
            // SAFETY: forwarded caller contract.
            return unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) };
        }
        let overflow: Vec<Held> = {
            let mut held = lock(&self.inner.held);
            held.push_back(Held {
                addr: ptr.as_ptr() as usize,
                bytes,
                align,
            });
            let excess = held.len().saturating_sub(options.delay_frees);
            held.drain(..excess).collect()
        };
        self.inner.release(overflow, stream)
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }

    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}

impl<R: MemoryResource> fmt::Debug for FaultInjectingResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("options", &self.options())
            .field("stats", &self.stats())
            .field("upstream", &self.inner.upstream)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostMemoryResource;

    fn failures(p: FaultPattern, n: u64) -> Vec<u64> {
        (1..=n).filter(|&i| p.fails(i)).collect()
    }

    #[test]
    fn patterns_pick_the_calls_they_name() {
        assert_eq!(failures(FaultPattern::Never, 50), Vec::<u64>::new());
        assert_eq!(failures(FaultPattern::Nth(7), 50), vec![7]);
        assert_eq!(failures(FaultPattern::EveryNth(20), 50), vec![20, 40]);
        assert_eq!(failures(FaultPattern::EveryNth(0), 50), Vec::<u64>::new());
        let r = FaultPattern::Random {
            fraction: 0.25,
            seed: 42,
        };
        let hits = failures(r, 10_000).len();
        assert!((2_000..3_000).contains(&hits), "{hits} of 10000 at 0.25");
        assert_eq!(failures(r, 500), failures(r, 500), "same seed, same calls");
        let other = FaultPattern::Random {
            fraction: 0.25,
            seed: 43,
        };
        assert_ne!(failures(r, 500), failures(other, 500));
        let all = FaultPattern::Random {
            fraction: 1.0,
            seed: 1,
        };
        assert_eq!(failures(all, 100).len(), 100);
    }

    #[test]
    fn injected_failures_are_out_of_memory_and_delayed_frees_arrive() {
        let host = HostMemoryResource::new();
        let mr = FaultInjectingResource::new(
            host.clone(),
            FaultOptions {
                allocations: FaultPattern::Nth(2),
                delay_frees: 2,
                ..FaultOptions::default()
            },
        );
        let s = StreamRef::DEFAULT;
        let a = mr.allocate(s, 64, 8).unwrap();
        let e = mr.allocate(s, 64, 8).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        let b = mr.allocate(s, 64, 8).unwrap();
        let c = mr.allocate(s, 64, 8).unwrap();
        // SAFETY: each from `mr` with these arguments, freed once.
        unsafe {
            mr.deallocate(s, a, 64, 8).unwrap();
            mr.deallocate(s, b, 64, 8).unwrap();
            assert_eq!(host.allocation_count(), 3, "two frees held");
            mr.deallocate(s, c, 64, 8).unwrap();
        }
        assert_eq!(host.allocation_count(), 2, "the oldest went on");
        assert_eq!(mr.stats().delayed_frees, 2);
        mr.flush().unwrap();
        assert_eq!(host.allocation_count(), 0);
        let st = mr.stats();
        assert_eq!(
            (st.allocations, st.injected_allocation_failures, st.frees),
            (4, 1, 3)
        );
    }

    #[test]
    fn drop_passes_held_frees_on() {
        let host = HostMemoryResource::new();
        let mr = FaultInjectingResource::new(
            host.clone(),
            FaultOptions {
                delay_frees: 10,
                ..FaultOptions::default()
            },
        );
        let p = mr.allocate(StreamRef::DEFAULT, 100, 8).unwrap();
        // SAFETY: from `mr` with these arguments, freed once.
        unsafe { mr.deallocate(StreamRef::DEFAULT, p, 100, 8).unwrap() };
        assert_eq!(host.allocation_count(), 1);
        drop(mr);
        assert_eq!(host.allocation_count(), 0);
    }

    #[test]
    fn refused_frees_leave_the_block_upstream() {
        let host = HostMemoryResource::new();
        let mr = FaultInjectingResource::new(
            host.clone(),
            FaultOptions {
                frees: FaultPattern::Nth(1),
                ..FaultOptions::default()
            },
        );
        let p = mr.allocate(StreamRef::DEFAULT, 100, 8).unwrap();
        // SAFETY: from `mr` with these arguments; the first free is refused, so the second is
        // the only one that reaches the upstream.
        unsafe {
            assert!(mr.deallocate(StreamRef::DEFAULT, p, 100, 8).is_err());
            assert_eq!(host.allocation_count(), 1);
            mr.deallocate(StreamRef::DEFAULT, p, 100, 8).unwrap();
        }
        assert_eq!(host.allocation_count(), 0);
        assert_eq!(mr.stats().injected_free_failures, 1);
    }
}
