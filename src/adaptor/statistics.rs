//! Allocation statistics, as RMM's `statistics_resource_adaptor`: current, peak and total bytes
//! and counts, in a stack of nested scopes.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::{MemoryResource, Properties};
use crate::stream::StreamRef;
use crate::sync::lock;

/// One statistic: its current value, the highest it reached, and the sum of everything added.
///
/// Signed, because inside a scope a free of a block allocated before the scope takes the value
/// below zero.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter {
    /// The current value.
    pub value: i64,
    /// The highest value seen.
    pub peak: i64,
    /// The sum of all increments.
    pub total: i64,
}

impl Counter {
    fn add(&mut self, n: i64) {
        self.value += n;
        self.total += n;
        self.peak = self.peak.max(self.value);
    }

    fn sub(&mut self, n: i64) {
        self.value -= n;
    }

    /// Folds a finished inner scope into this one: its peak happened on top of our value.
    fn absorb(&mut self, inner: &Counter) {
        self.peak = self.peak.max(self.value + inner.peak);
        self.value += inner.value;
        self.total += inner.total;
    }
}

/// (bytes, allocations) of one scope.
type Frame = (Counter, Counter);

/// Counts the bytes and blocks that pass through it.
///
/// [`push_counters`](Self::push_counters) opens a scope with zeroed counters; the getters then
/// report that scope. [`pop_counters`](Self::pop_counters) closes it and folds it into the scope
/// below, so the outer peak still covers what happened inside. One uncontended lock per call;
/// only the top scope is updated.
#[derive(Debug)]
pub struct StatisticsResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R> {
    upstream: R,
    stack: Mutex<Vec<Frame>>,
}

impl<R> Clone for StatisticsResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> StatisticsResourceAdaptor<R> {
    /// Counts what passes to `upstream`.
    pub fn new(upstream: R) -> Self {
        Self {
            inner: Arc::new(Inner {
                upstream,
                stack: Mutex::new(vec![Frame::default()]),
            }),
        }
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Bytes of the current scope.
    pub fn bytes_counter(&self) -> Counter {
        self.top().0
    }

    /// Allocations of the current scope.
    pub fn allocations_counter(&self) -> Counter {
        self.top().1
    }

    /// Opens a scope with zeroed counters; returns the counters of the scope it covers.
    pub fn push_counters(&self) -> (Counter, Counter) {
        let mut stack = lock(&self.inner.stack);
        let below = *stack.last().expect("the base scope is never popped");
        stack.push(Frame::default());
        below
    }

    /// Closes the current scope and returns its (bytes, allocations) counters; the scope below
    /// absorbs them. The base scope cannot be popped.
    pub fn pop_counters(&self) -> Result<(Counter, Counter)> {
        let mut stack = lock(&self.inner.stack);
        if stack.len() == 1 {
            return Err(Error::InvalidArgument(
                "pop_counters without a matching push_counters".to_owned(),
            ));
        }
        let popped = stack.pop().expect("length checked above");
        let below = stack.last_mut().expect("the base scope remains");
        below.0.absorb(&popped.0);
        below.1.absorb(&popped.1);
        Ok(popped)
    }

    /// The number of open scopes above the base one.
    pub fn depth(&self) -> usize {
        lock(&self.inner.stack).len() - 1
    }

    fn top(&self) -> Frame {
        *lock(&self.inner.stack)
            .last()
            .expect("the base scope is never popped")
    }
}

fn as_i64(bytes: usize) -> i64 {
    // Sizes that reached an upstream fit in isize (check_request), hence in i64.
    bytes as i64
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract.
unsafe impl<R: MemoryResource> MemoryResource for StatisticsResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let ptr = self.inner.upstream.allocate(stream, bytes, align)?;
        let mut stack = lock(&self.inner.stack);
        let top = stack.last_mut().expect("the base scope is never popped");
        top.0.add(as_i64(bytes));
        top.1.add(1);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) }?;
        let mut stack = lock(&self.inner.stack);
        let top = stack.last_mut().expect("the base scope is never popped");
        top.0.sub(as_i64(bytes));
        top.1.sub(1);
        Ok(())
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let (b, c) = self.top();
        let n = |v: i64| usize::try_from(v).unwrap_or(0);
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: n(b.value),
            bytes_reserved: None,
            peak_bytes: Some(n(b.peak)),
            live_blocks: Some(n(c.value)),
            detail: vec![
                (c"current_bytes", b.value as f64),
                (c"peak_bytes", b.peak as f64),
                (c"total_bytes", b.total as f64),
                (c"current_count", c.value as f64),
                (c"peak_count", c.peak as f64),
                (c"total_count", c.total as f64),
            ],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn absorb_keeps_the_outer_peak_on_top_of_the_outer_value() {
        let mut outer = Counter::default();
        outer.add(100);
        let mut inner = Counter::default();
        inner.add(50);
        inner.sub(50);
        inner.add(10);
        outer.absorb(&inner);
        assert_eq!(
            outer,
            Counter {
                value: 110,
                peak: 150,
                total: 160
            }
        );
    }
}
