//! Model-based property tests: random allocate/free sequences on several streams, against a
//! reference model, over the host-memory upstream. Each step checks alignment, that no two live
//! blocks overlap (and that every block keeps the bytes written to it), and the resource's own
//! invariants; at the end, bytes in use return to zero.

mod common;

use std::sync::Arc;

use carve::resource::{
    ArenaOptions, ExpandableOptions, FixedSizeOptions, HostBacking, PoolOptions, VirtualOptions,
};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, ExpandableMemoryResource, FixedSizeMemoryResource,
    HostMemoryResource, MemoryResource, PoolMemoryResource, VirtualMemoryResource,
};
use common::{run_ops, Op};
use proptest::prelude::*;

fn ops(max_bytes: usize, max_align_log: u32) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => (1..=max_bytes, 0..=max_align_log, 0..3usize)
            .prop_map(|(bytes, a, stream)| Op::Alloc { bytes, align: 1 << a, stream }),
        2 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Op::Free { pick, stream }),
    ];
    prop::collection::vec(op, 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn pool_matches_the_model(ops in ops(40_000, 12), initial in 0usize..200_000) {
        let pool = PoolMemoryResource::new(HostMemoryResource::new(), PoolOptions::new(initial)).unwrap();
        run_ops(&pool, &ops, true, &|| pool.check_invariants(), &|| pool.stats().bytes_in_use);
        prop_assert_eq!(pool.stats().live_blocks, 0);
    }

    #[test]
    fn fixed_size_matches_the_model(ops in ops(3000, 8), per_refill in 1u32..8) {
        let opts = FixedSizeOptions::new(3000).blocks_per_refill(per_refill);
        let mr = FixedSizeMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
        run_ops(&mr, &ops, true, &|| mr.check_invariants(), &|| mr.stats().blocks_in_use);
    }

    #[test]
    fn binning_matches_the_model(ops in ops(70_000, 8)) {
        let host = HostMemoryResource::new();
        let mr = BinningMemoryResource::new(host.clone(), 8, 14).unwrap();
        let large_live = || {
            // Bin slabs are 4 MiB or a multiple of their block; large blocks are neither.
            host.allocated_bytes() % 256
        };
        run_ops(&mr, &ops, true, &|| Ok(()), &large_live);
    }

    /// Over real host pages (memory files mapped into a reservation), so the data checks see
    /// any page unmapped or moved under a live block.
    #[test]
    fn virtual_matches_the_model(ops in ops(60_000, 14), expandable: bool) {
        let options = if expandable { VirtualOptions::expandable() } else { VirtualOptions::new() };
        let mr = VirtualMemoryResource::new(
            HostBacking::new(4096).unwrap(),
            options.maximum(16 << 20).chunk_size(16 << 10),
        )
        .unwrap();
        run_ops(&mr, &ops, true, &|| mr.check_invariants(), &|| mr.stats().bytes_in_use);
        prop_assert_eq!(mr.stats().live_blocks, 0);
    }

    #[test]
    fn expandable_matches_the_model(ops in ops(40_000, 12)) {
        let options = ExpandableOptions {
            maximum: Some(64 << 20),
            small_limit: Some(8 << 10),
            ..ExpandableOptions::default()
        };
        let mr = ExpandableMemoryResource::new(HostBacking::new(4096).unwrap(), options).unwrap();
        run_ops(&mr, &ops, true, &|| mr.check_invariants(), &|| {
            let s = mr.stats();
            s.bytes_in_use()
        });
    }

    #[test]
    fn arena_matches_the_model(ops in ops(300_000, 12)) {
        let opts = ArenaOptions { superblock_size: 1 << 20, arenas: 2, ..Default::default() };
        let mr = ArenaMemoryResource::new(HostMemoryResource::new(), opts).unwrap();
        run_ops(&mr, &ops, true, &|| mr.check_invariants(), &|| mr.stats().bytes_in_use);
    }
}

#[test]
fn binning_sends_only_large_requests_upstream() {
    let host = HostMemoryResource::new();
    let mr = BinningMemoryResource::new(host.clone(), 8, 12).unwrap();
    let s = common::stream(0);
    let small = mr.allocate(s, 3000, 256).unwrap();
    let slabs = host.allocation_count();
    assert_eq!(slabs, 1, "one refill of the 4 KiB bin");
    let again = mr.allocate(s, 4096, 256).unwrap();
    assert_eq!(host.allocation_count(), slabs, "served from the same slab");
    let large = mr.allocate(s, 5000, 256).unwrap();
    assert_eq!(host.allocation_count(), slabs + 1);
    assert_eq!(host.allocated_bytes() - 4096 * 1024, 5000);
    // SAFETY: each from `mr` with these arguments, freed once.
    unsafe {
        mr.deallocate(s, large, 5000, 256).unwrap();
        mr.deallocate(s, again, 4096, 256).unwrap();
        mr.deallocate(s, small, 3000, 256).unwrap();
    }
    assert_eq!(host.allocation_count(), slabs);
}

#[test]
fn binning_with_a_custom_bin_routes_by_size() {
    let host = HostMemoryResource::new();
    let pool = Arc::new(PoolMemoryResource::new(host.clone(), PoolOptions::new(1 << 20)).unwrap());
    let bins = vec![carve::resource::Bin {
        size: 4096,
        resource: pool.clone(),
    }];
    let mr = BinningMemoryResource::with_bins(host.clone(), bins).unwrap();
    let ops: Vec<Op> = (0..50)
        .map(|i| match i % 3 {
            2 => Op::Free {
                pick: i * 7,
                stream: i % 2,
            },
            _ => Op::Alloc {
                bytes: 1 + (i * 997) % 9000,
                align: 256,
                stream: i % 2,
            },
        })
        .collect();
    run_ops(&mr, &ops, true, &|| pool.check_invariants(), &|| {
        pool.stats().bytes_in_use
    });
    assert_eq!(
        host.allocation_count(),
        1,
        "only the pool's initial chunk stays upstream"
    );
}

/// `over_pool`: requests above the largest bin go to a pool, so a run of large requests takes
/// a few chunks from the upstream, not one allocation each.
#[test]
fn binning_over_a_pool_sends_large_requests_to_the_pool() {
    let host = HostMemoryResource::new();
    let mr = BinningMemoryResource::over_pool(host.clone(), 8, 12, PoolOptions::new(0)).unwrap();
    let s = common::stream(0);
    let large: Vec<_> = (0..64)
        .map(|_| mr.allocate(s, 100_000, 256).unwrap())
        .collect();
    assert!(
        host.allocation_count() <= 8,
        "{} upstream allocations for 64 large requests",
        host.allocation_count()
    );
    assert_eq!(mr.upstream().stats().live_blocks, 64);
    for p in large {
        // SAFETY: from `mr` with these arguments, freed once.
        unsafe { mr.deallocate(s, p, 100_000, 256) }.unwrap();
    }
    mr.upstream().check_invariants().unwrap();
    assert_eq!(mr.upstream().stats().bytes_in_use, 0);
}

/// `over_pool`: bins refill from the same pool, so a request in every bin costs the upstream
/// no allocation once the pool holds memory, and each refill is a block of the pool.
#[test]
fn binning_over_a_pool_refills_its_bins_from_the_pool() {
    let host = HostMemoryResource::new();
    let opts = PoolOptions::new(64 << 20);
    let mr = BinningMemoryResource::over_pool(host.clone(), 8, 12, opts).unwrap();
    assert_eq!(host.allocation_count(), 1, "the pool's initial chunk");
    let s = common::stream(0);
    let sizes = [200, 300, 700, 2000, 4000];
    let small: Vec<_> = sizes
        .iter()
        .map(|&b| (mr.allocate(s, b, 256).unwrap(), b))
        .collect();
    assert_eq!(
        host.allocation_count(),
        1,
        "bins refilled from the upstream"
    );
    assert_eq!(
        mr.upstream().stats().live_blocks,
        sizes.len(),
        "one refill per bin, each a block of the pool"
    );
    for (p, b) in small {
        // SAFETY: from `mr` with these arguments, freed once.
        unsafe { mr.deallocate(s, p, b, 256) }.unwrap();
    }
    mr.upstream().check_invariants().unwrap();
}
