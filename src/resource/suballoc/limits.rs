//! Upper bounds on the counts in resource options. Each count sizes a table that is built up
//! front, so a count that no machine could hold (a C or Python caller passing `SIZE_MAX`) is
//! refused as [`Error::InvalidArgument`] instead of aborting on a failed allocation.

use crate::error::{Error, Result};
use crate::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};

impl PoolOptions {
    /// The most shards a pool takes (`shards` above this is [`Error::InvalidArgument`]).
    pub const MAX_SHARDS: usize = 4096;
}

impl ArenaOptions {
    /// The most per-thread arenas (`arenas` above this is [`Error::InvalidArgument`]).
    pub const MAX_ARENAS: usize = 4096;
}

impl FixedSizeOptions {
    /// The largest `max_refills` (above this is [`Error::InvalidArgument`]): the slab table
    /// is allocated up front, one entry per refill.
    pub const MAX_REFILLS: usize = 1 << 20;
}

/// `n`, or [`Error::InvalidArgument`] naming `resource` and `what` when `n` exceeds `max`.
pub(crate) fn count(resource: &str, what: &str, n: usize, max: usize) -> Result<usize> {
    if n > max {
        return Err(Error::InvalidArgument(format!(
            "{resource}: {what} = {n} exceeds the maximum {max}"
        )));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::{
        ArenaMemoryResource, FixedSizeMemoryResource, HostMemoryResource, PoolMemoryResource,
    };

    fn refused<T: std::fmt::Debug>(r: Result<T>, what: &str) {
        match r {
            Err(Error::InvalidArgument(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }

    // Counts above the maximum, including ones whose tables fit no address space (these
    // aborted on a failed allocation or panicked on a capacity overflow before the bound).
    const HUGE: [usize; 3] = [usize::MAX, 1 << 40, 1 << 30];

    #[test]
    fn huge_pool_shards_are_invalid_arguments() {
        let host = HostMemoryResource::new();
        for n in HUGE.into_iter().chain([PoolOptions::MAX_SHARDS + 1]) {
            let r = PoolMemoryResource::new(host.clone(), PoolOptions::new(0).shards(n));
            refused(r, "shards");
        }
    }

    #[test]
    fn huge_arena_counts_are_invalid_arguments() {
        let host = HostMemoryResource::new();
        for n in HUGE.into_iter().chain([ArenaOptions::MAX_ARENAS + 1]) {
            let options = ArenaOptions {
                arenas: n,
                ..Default::default()
            };
            refused(ArenaMemoryResource::new(host.clone(), options), "arenas");
        }
        let options = ArenaOptions {
            arenas: 1,
            global: PoolOptions::new(0).shards(usize::MAX),
            ..Default::default()
        };
        refused(ArenaMemoryResource::new(host, options), "shards");
    }

    #[test]
    fn huge_fixed_size_refill_bounds_are_invalid_arguments() {
        let host = HostMemoryResource::new();
        for n in HUGE.into_iter().chain([FixedSizeOptions::MAX_REFILLS + 1]) {
            let options = FixedSizeOptions::new(256)
                .blocks_per_refill(1)
                .max_refills(n);
            refused(
                FixedSizeMemoryResource::new(host.clone(), options),
                "max_refills",
            );
        }
    }

    #[test]
    #[cfg_attr(miri, ignore = "builds tables of the largest sizes allowed")]
    fn the_largest_counts_allowed_build() {
        let host = HostMemoryResource::new();
        let pool = PoolOptions::new(0).shards(PoolOptions::MAX_SHARDS);
        PoolMemoryResource::new(host.clone(), pool).unwrap();
        let arena = ArenaOptions {
            arenas: ArenaOptions::MAX_ARENAS,
            ..Default::default()
        };
        ArenaMemoryResource::new(host.clone(), arena).unwrap();
        let fixed = FixedSizeOptions::new(256)
            .blocks_per_refill(1)
            .max_refills(FixedSizeOptions::MAX_REFILLS);
        FixedSizeMemoryResource::new(host, fixed).unwrap();
    }
}
