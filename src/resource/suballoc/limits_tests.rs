//! The bounds on option counts, through each resource that checks them.

use crate::error::{Error, Result};
use crate::resource::source::host::HostMemoryResource;
use crate::resource::suballoc::arena::ArenaMemoryResource;
use crate::resource::suballoc::arena::ArenaOptions;
use crate::resource::suballoc::fixed_size::FixedSizeMemoryResource;
use crate::resource::suballoc::fixed_size::FixedSizeOptions;
use crate::resource::suballoc::pool::PoolMemoryResource;
use crate::resource::suballoc::pool::PoolOptions;

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
