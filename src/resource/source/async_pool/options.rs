//! How an [`AsyncMemoryResource`](super::AsyncMemoryResource) creates its driver pool.

use crate::error::{Error, Result};

/// The driver's allocation granularity on current GPUs; the pool's own cap (`maxSize`) is the
/// hard limit rounded up to it.
pub(crate) const POOL_GRANULARITY: usize = 2 << 20;

/// Options for a new driver pool, as RMM's `cuda_async_memory_resource` takes them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AsyncPoolOptions {
    /// Bytes allocated and freed at creation, so the pool starts with that much reserved.
    pub initial_size: usize,
    /// Reserved bytes the pool keeps across synchronisations; above it, freed memory goes back
    /// to the driver at the next synchronisation. `None` keeps everything (until
    /// [`trim_to`](super::AsyncMemoryResource::trim_to)).
    pub release_threshold: Option<usize>,
    /// Bytes in use through this resource never exceed this: a request over it fails with
    /// [`Error::OutOfMemory`] naming the limit. The pool's own reservation is capped too.
    pub hard_limit: Option<usize>,
    /// Create the pool exportable as a POSIX file descriptor, for IPC.
    pub ipc_export: bool,
}

impl AsyncPoolOptions {
    /// Options with everything at its default: empty pool, keep what it reserves, no limit.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`initial_size`](Self::initial_size).
    pub fn initial_size(mut self, bytes: usize) -> Self {
        self.initial_size = bytes;
        self
    }

    /// Sets [`release_threshold`](Self::release_threshold).
    pub fn release_threshold(mut self, bytes: usize) -> Self {
        self.release_threshold = Some(bytes);
        self
    }

    /// Sets [`hard_limit`](Self::hard_limit).
    pub fn hard_limit(mut self, bytes: usize) -> Self {
        self.hard_limit = Some(bytes);
        self
    }

    /// Sets [`ipc_export`](Self::ipc_export).
    pub fn ipc_export(mut self, on: bool) -> Self {
        self.ipc_export = on;
        self
    }

    /// Refuses contradictory options ([`Error::InvalidArgument`]).
    pub fn validate(&self) -> Result<()> {
        if let Some(limit) = self.hard_limit {
            if limit == 0 {
                return Err(Error::InvalidArgument("a hard limit of 0 bytes".into()));
            }
            if self.initial_size > limit {
                return Err(Error::InvalidArgument(format!(
                    "initial size {} exceeds the hard limit {limit}",
                    self.initial_size
                )));
            }
            if max_size_for(limit).is_none() {
                return Err(Error::InvalidArgument(format!(
                    "hard limit {limit} overflows once rounded to the pool granularity"
                )));
            }
        }
        Ok(())
    }

    /// The release threshold to set: everything when unset.
    pub(crate) fn threshold(&self) -> u64 {
        self.release_threshold.map_or(u64::MAX, |t| t as u64)
    }
}

/// The pool's `maxSize` for a hard limit: the limit rounded up to the granularity.
pub(crate) fn max_size_for(limit: usize) -> Option<usize> {
    crate::resource::memory_resource::align_up(limit, POOL_GRANULARITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(AsyncPoolOptions::new().validate().is_ok());
        let ok = AsyncPoolOptions::new()
            .initial_size(1 << 20)
            .hard_limit(1 << 20)
            .release_threshold(0);
        assert!(ok.validate().is_ok());
        for bad in [
            AsyncPoolOptions::new().hard_limit(0),
            AsyncPoolOptions::new()
                .initial_size(2 << 20)
                .hard_limit(1 << 20),
            AsyncPoolOptions::new().hard_limit(usize::MAX),
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidArgument(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn driver_cap_rounds_up_to_granularity() {
        assert_eq!(max_size_for(1), Some(POOL_GRANULARITY));
        assert_eq!(max_size_for(POOL_GRANULARITY), Some(POOL_GRANULARITY));
        assert_eq!(
            max_size_for(POOL_GRANULARITY + 1),
            Some(2 * POOL_GRANULARITY)
        );
        assert_eq!(max_size_for(usize::MAX), None);
    }

    #[test]
    fn unset_threshold_keeps_everything() {
        assert_eq!(AsyncPoolOptions::new().threshold(), u64::MAX);
        assert_eq!(AsyncPoolOptions::new().release_threshold(5).threshold(), 5);
    }
}
