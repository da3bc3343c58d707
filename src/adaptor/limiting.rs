//! A byte limit in front of any resource, as RMM's `limiting_resource_adaptor`.

use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::resource::{align_up, check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::Arc;

const NAME: &str = "LimitingResourceAdaptor";

/// Refuses any request that would take the bytes in use past `limit`.
///
/// Sizes are counted rounded up to a granularity (256 bytes by default, as RMM), so the limit
/// bounds what the upstream really hands out. Accounting is one atomic compare-exchange: a request
/// reserves its bytes before it reaches the upstream and gives them back if the upstream fails,
/// so concurrent requests never overshoot the limit together. Adaptors built with
/// [`with_budget`](Self::with_budget) over one [`LimitBudget`] share its limit and count.
#[derive(Debug)]
pub struct LimitingResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

#[derive(Debug)]
struct Inner<R> {
    upstream: R,
    budget: LimitBudget,
}

/// A byte limit and the bytes counted against it, shared by every [`LimitingResourceAdaptor`]
/// built over it: one limit over several resources, as PyTorch's per-process memory fraction
/// covers every pool of a device. Cheap to clone (clones share the count).
#[derive(Clone, Debug)]
pub struct LimitBudget {
    inner: Arc<Budget>,
}

#[derive(Debug)]
struct Budget {
    limit: AtomicUsize,
    granularity: usize,
    used: AtomicUsize,
}

impl LimitBudget {
    /// A budget of `limit` bytes, counting each request rounded up to `granularity` (a power of
    /// two).
    pub fn new(limit: usize, granularity: usize) -> Result<Self> {
        if !granularity.is_power_of_two() {
            return Err(Error::InvalidAlignment(granularity));
        }
        Ok(LimitBudget {
            inner: Arc::new(Budget {
                limit: AtomicUsize::new(limit),
                granularity,
                used: AtomicUsize::new(0),
            }),
        })
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.inner.limit.load(Ordering::Relaxed)
    }

    /// Changes the limit. Blocks already live stay; while they exceed the new limit, requests
    /// fail until enough are freed.
    pub fn set_limit(&self, limit: usize) {
        self.inner.limit.store(limit, Ordering::Relaxed);
    }

    /// Bytes counted (rounded to the granularity), including requests in flight.
    pub fn allocated_bytes(&self) -> usize {
        self.inner.used.load(Ordering::Relaxed)
    }

    fn counted(&self, bytes: usize) -> Result<usize> {
        align_up(bytes, self.inner.granularity).ok_or(Error::SizeOverflow {
            bytes,
            align: self.inner.granularity,
        })
    }
}

impl<R> Clone for LimitingResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource> LimitingResourceAdaptor<R> {
    /// Limits `upstream` to `limit` bytes, counted in 256-byte units.
    pub fn new(upstream: R, limit: usize) -> Self {
        Self::with_granularity(upstream, limit, DEFAULT_ALIGNMENT)
            .expect("DEFAULT_ALIGNMENT is a power of two")
    }

    /// Limits `upstream` to `limit` bytes, counting each request rounded up to `granularity`
    /// (a power of two).
    pub fn with_granularity(upstream: R, limit: usize, granularity: usize) -> Result<Self> {
        Ok(Self::with_budget(
            upstream,
            LimitBudget::new(limit, granularity)?,
        ))
    }

    /// Counts what `upstream` hands out against `budget`, which other adaptors may share.
    pub fn with_budget(upstream: R, budget: LimitBudget) -> Self {
        Self {
            inner: Arc::new(Inner { upstream, budget }),
        }
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.inner.budget.limit()
    }

    /// Bytes in use (rounded to the granularity), including requests in flight; with a shared
    /// budget, those of every adaptor sharing it.
    pub fn allocated_bytes(&self) -> usize {
        self.inner.budget.allocated_bytes()
    }

    /// The budget this adaptor counts against.
    pub fn budget(&self) -> &LimitBudget {
        &self.inner.budget
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract.
unsafe impl<R: MemoryResource> MemoryResource for LimitingResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        check_request(bytes, align, 1)?;
        let budget = &*self.inner.budget.inner;
        let counted = self.inner.budget.counted(bytes)?;
        let limit = budget.limit.load(Ordering::Relaxed);
        let reserved = budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(counted).filter(|&n| n <= limit)
            });
        if let Err(in_use) = reserved {
            return Err(Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: format!(
                    "limit is {limit} bytes and {in_use} are in use ({counted} counted for this request)"
                ),
            });
        }
        self.inner
            .upstream
            .allocate(stream, bytes, align)
            .inspect_err(|_| {
                budget.used.fetch_sub(counted, Ordering::Relaxed);
            })
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let counted = self.inner.budget.counted(bytes)?;
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) }?;
        // Only a block the upstream accepted gives its bytes back, so a bad free cannot drive the
        // count below what is really in use. Release: whoever reserves these bytes next sees the
        // upstream's free as done.
        self.inner
            .budget
            .inner
            .used
            .fetch_sub(counted, Ordering::Release);
        Ok(())
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: self.allocated_bytes(),
            detail: vec![
                (c"limit", self.limit() as f64),
                (c"allocated_bytes", self.allocated_bytes() as f64),
            ],
            ..Default::default()
        }))
    }
}

#[cfg(all(test, carve_loom))]
mod loom_tests {
    use super::*;

    /// A counting upstream with no locks, so loom sees every interleaving.
    #[derive(Debug, Default)]
    struct Fake {
        live: AtomicUsize,
    }

    // SAFETY: test double; the addresses are never dereferenced.
    unsafe impl MemoryResource for Fake {
        fn allocate(&self, _: StreamRef<'_>, _bytes: usize, align: usize) -> Result<NonNull<u8>> {
            let n = self.live.fetch_add(1, Ordering::Relaxed) + 1;
            Ok(NonNull::new((n * align.max(256)) as *mut u8).unwrap())
        }
        unsafe fn deallocate(
            &self,
            _: StreamRef<'_>,
            _: NonNull<u8>,
            _: usize,
            _: usize,
        ) -> Result<()> {
            self.live.fetch_sub(1, Ordering::Relaxed);
            Ok(())
        }
        fn properties(&self) -> Properties {
            Properties::HOST
        }
        fn device(&self) -> Option<crate::driver::Device> {
            None
        }
    }

    /// Two threads race for a limit that fits one request: at least one wins, no two blocks are
    /// ever live together, and the count returns to zero.
    #[test]
    fn concurrent_requests_never_overshoot() {
        loom::model(|| {
            let mr = LimitingResourceAdaptor::new(Fake::default(), 256);
            let handles: Vec<_> = (0..2)
                .map(|_| {
                    let mr = mr.clone();
                    loom::thread::spawn(move || {
                        let got = mr.allocate(StreamRef::DEFAULT, 200, 8);
                        if let Ok(p) = got {
                            assert!(mr.allocated_bytes() <= 256);
                            assert_eq!(mr.upstream().live.load(Ordering::Relaxed), 1);
                            // SAFETY: from `mr`, freed once.
                            unsafe { mr.deallocate(StreamRef::DEFAULT, p, 200, 8) }.unwrap();
                            true
                        } else {
                            assert!(got.unwrap_err().is_out_of_memory());
                            false
                        }
                    })
                })
                .collect();
            let wins = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&w| w)
                .count();
            assert!(wins >= 1);
            assert_eq!(mr.allocated_bytes(), 0);
            assert_eq!(mr.upstream().live.load(Ordering::Relaxed), 0);
        });
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;
    use crate::resource::HostMemoryResource;

    #[test]
    fn adaptors_over_one_budget_share_its_limit_and_count() {
        let budget = LimitBudget::new(1024, 1).unwrap();
        let a = LimitingResourceAdaptor::with_budget(HostMemoryResource::new(), budget.clone());
        let b = LimitingResourceAdaptor::with_budget(HostMemoryResource::new(), budget.clone());
        let p = a.allocate_sync(800, 8).unwrap();
        assert_eq!(b.allocated_bytes(), 800);
        assert!(b.allocate_sync(300, 8).unwrap_err().is_out_of_memory());
        budget.set_limit(2048);
        assert_eq!(b.limit(), 2048);
        let q = b.allocate_sync(300, 8).unwrap();
        assert_eq!(budget.allocated_bytes(), 1100);
        // SAFETY: each block freed once, through the adaptor that allocated it.
        unsafe {
            a.deallocate_sync(p, 800, 8).unwrap();
            b.deallocate_sync(q, 300, 8).unwrap();
        }
        assert_eq!(budget.allocated_bytes(), 0);
        assert!(matches!(
            LimitBudget::new(1, 3),
            Err(Error::InvalidAlignment(3))
        ));
    }
}
