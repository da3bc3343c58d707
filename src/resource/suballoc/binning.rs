//! [`BinningMemoryResource`]: requests rounded up to a bin, each bin its own resource (by default
//! a [`FixedSizeMemoryResource`] over the shared upstream); larger requests go to a configurable
//! upstream, by default ([`BinningMemoryResource::over_pool`]) a coalescing pool that the bins
//! refill from too.
//!
//! **Bounded memory.** Each fixed-size bin keeps its bound whichever streams free what (see
//! [`FixedSizeMemoryResource`]): the bins hold at most the sum, over bins, of
//! `(2 × peak blocks + 2 × blocks per refill) × bin size` from their upstream; larger requests
//! hold what the large upstream gives them.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{
    check_request, MemoryResource, Properties, SharedResource, DEFAULT_ALIGNMENT,
};
use crate::resource::suballoc::fixed_size::{FixedSizeMemoryResource, FixedSizeOptions};
use crate::resource::suballoc::pool::{PoolMemoryResource, PoolOptions};
use crate::stream::StreamRef;

const NAME: &str = "BinningMemoryResource";

/// One bin: requests up to `size` bytes go to `resource`.
#[derive(Clone, Debug)]
pub struct Bin {
    /// The largest request this bin serves.
    pub size: usize,
    /// The resource that serves it.
    pub resource: SharedResource,
}

/// Size-class bins over an upstream `R`. Cheap to clone.
pub struct BinningMemoryResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

struct Inner<R> {
    upstream: R,
    /// Sorted by size, distinct sizes.
    bins: Vec<Bin>,
}

impl<R: MemoryResource> Clone for BinningMemoryResource<R> {
    fn clone(&self) -> Self {
        BinningMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

impl<R: MemoryResource + Clone + 'static> BinningMemoryResource<R> {
    /// Power-of-two bins `2^min_exp ..= 2^max_exp`, each a fixed-size resource over `upstream`.
    ///
    /// Requests above the largest bin go to `upstream` itself, one by one: over a slow upstream
    /// (cuMemAlloc) prefer [`over_pool`](BinningMemoryResource::over_pool).
    pub fn new(upstream: R, min_exp: u32, max_exp: u32) -> Result<Self> {
        Self::with_large_upstream(upstream.clone(), upstream, min_exp, max_exp)
    }
}

impl<R: MemoryResource> BinningMemoryResource<R> {
    /// Power-of-two bins `2^min_exp ..= 2^max_exp`, each a fixed-size resource over
    /// `bin_upstream`; larger requests go to `large`. Both must give the same kind of memory on
    /// the same device ([`Error::InvalidArgument`] otherwise; see [`with_bins`](Self::with_bins)).
    pub fn with_large_upstream<U: MemoryResource + Clone + 'static>(
        bin_upstream: U,
        large: R,
        min_exp: u32,
        max_exp: u32,
    ) -> Result<Self> {
        Self::with_ordered_bins(bin_upstream, large, min_exp, max_exp, None)
    }

    /// [`with_large_upstream`](Self::with_large_upstream) with bins ordered by `order` (`None`:
    /// as their upstream needs).
    fn with_ordered_bins<U: MemoryResource + Clone + 'static>(
        bin_upstream: U,
        large: R,
        min_exp: u32,
        max_exp: u32,
        order: Option<Arc<dyn StreamOrder>>,
    ) -> Result<Self> {
        if min_exp > max_exp || max_exp >= usize::BITS - 2 {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: bin exponents {min_exp}..={max_exp}"
            )));
        }
        let mut bins = Vec::new();
        for e in min_exp..=max_exp {
            let size = 1usize << e;
            let mut options = FixedSizeOptions::new(size);
            options.order = order.clone();
            let fixed = FixedSizeMemoryResource::new(bin_upstream.clone(), options)?;
            bins.push(Bin {
                size,
                resource: Arc::new(fixed),
            });
        }
        Self::with_bins(large, bins)
    }
}

impl<U: MemoryResource + 'static> BinningMemoryResource<PoolMemoryResource<U>> {
    /// Power-of-two bins `2^min_exp ..= 2^max_exp` and larger requests, all served from one
    /// coalescing pool over `upstream` (sized by `pool`): the default shape. Neither a bin's
    /// refill nor a large request reaches a slow upstream on its own (fifteen bins refilling
    /// 4 MiB each from cuMemAlloc made a 3,460-operation trace cost 2.9 µs per operation), and
    /// the bins and the large requests share the pool's memory. An order in `pool` orders the
    /// bins too.
    pub fn over_pool(upstream: U, min_exp: u32, max_exp: u32, pool: PoolOptions) -> Result<Self> {
        let order = pool.order.clone();
        let pool = PoolMemoryResource::new(upstream, pool)?;
        Self::with_ordered_bins(pool.clone(), pool, min_exp, max_exp, order)
    }
}

impl<R: MemoryResource> BinningMemoryResource<R> {
    /// Custom bins, each with a resource of its own. Bin resources must accept any request up
    /// to their size at 256-byte alignment.
    ///
    /// Every bin must give the upstream's kind of memory (the same [`Properties`]) on the same
    /// [`device`](MemoryResource::device), since the resource reports the upstream's for all of
    /// its blocks: [`Error::InvalidArgument`] otherwise.
    pub fn with_bins(upstream: R, mut bins: Vec<Bin>) -> Result<Self> {
        bins.sort_by_key(|b| b.size);
        if bins.iter().any(|b| b.size == 0) || bins.windows(2).any(|w| w[0].size == w[1].size) {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: bin sizes must be distinct and non-zero"
            )));
        }
        let (props, device) = (upstream.properties(), upstream.device());
        if let Some(b) = bins
            .iter()
            .find(|b| b.resource.properties() != props || b.resource.device() != device)
        {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: the {}-byte bin's {:?} gives {:?} on device {:?}, the upstream {:?} on \
                 device {:?}",
                b.size,
                b.resource,
                b.resource.properties(),
                b.resource.device().map(|d| d.ordinal()),
                props,
                device.as_ref().map(|d| d.ordinal()),
            )));
        }
        Ok(BinningMemoryResource {
            inner: Arc::new(Inner { upstream, bins }),
        })
    }

    /// The bins, smallest first.
    pub fn bins(&self) -> &[Bin] {
        &self.inner.bins
    }

    /// The upstream that serves requests larger than every bin.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Where a request goes: the same answer for its free, so frees need no lookup.
    fn route(&self, bytes: usize, align: usize) -> &dyn MemoryResource {
        if align <= DEFAULT_ALIGNMENT {
            let i = self.inner.bins.partition_point(|b| b.size < bytes);
            if let Some(bin) = self.inner.bins.get(i) {
                return &*bin.resource;
            }
        }
        &self.inner.upstream
    }
}

// SAFETY: pure routing; every block comes from a bin or the upstream, each of which upholds the
// contract, and is returned to the same one (routing depends only on size and alignment).
unsafe impl<R: MemoryResource> MemoryResource for BinningMemoryResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, DEFAULT_ALIGNMENT)?;
        self.route(bytes, align).allocate(stream, bytes, align)
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        let align = check_request(bytes, align, DEFAULT_ALIGNMENT)?;
        // SAFETY: the caller's contract; `route` picks the resource that allocated it.
        unsafe {
            self.route(bytes, align)
                .deallocate(stream, ptr, bytes, align)
        }
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}

impl<R: MemoryResource> fmt::Debug for BinningMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field(
                "bins",
                &self.inner.bins.iter().map(|b| b.size).collect::<Vec<_>>(),
            )
            .field("upstream", &self.inner.upstream)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::source::host::HostMemoryResource;
    use crate::resource::source::simulated::SimulatedMemoryResource;

    fn bin(size: usize, resource: SharedResource) -> Bin {
        Bin { size, resource }
    }

    #[test]
    fn bins_whose_memory_differs_from_the_upstream_are_refused() {
        let host = HostMemoryResource::new();
        let other: SharedResource = Arc::new(SimulatedMemoryResource::new(1 << 20).unwrap());
        assert_ne!(other.properties(), host.properties());
        let r = BinningMemoryResource::with_bins(host.clone(), vec![bin(4096, other.clone())]);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");

        // The same through the fixed-size bins `with_large_upstream` builds.
        let sim = SimulatedMemoryResource::new(1 << 24).unwrap();
        let r = BinningMemoryResource::with_large_upstream(sim, host.clone(), 8, 12);
        assert!(matches!(r, Err(Error::InvalidArgument(_))), "{r:?}");

        // Bins of the upstream's kind of memory are still fine.
        let same: SharedResource = Arc::new(host.clone());
        let mr = BinningMemoryResource::with_bins(host.clone(), vec![bin(4096, same)]).unwrap();
        assert_eq!(mr.properties(), Properties::HOST);
    }
}
