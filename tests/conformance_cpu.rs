//! The conformance suite on the CPU: host and simulated memory, every suballocator over host or
//! simulated memory, and every adaptor that needs no GPU. Suballocators order streams through a
//! [`RecordingOrder`], so the stream-order check reads what they asked for.
//!
//! To test a new resource, write a factory below and add one line to the list at the end.

mod common;
#[macro_use]
mod conformance;

use std::sync::Arc;

use carve::adaptor::{
    AlignedResourceAdaptor, FailureCallbackResourceAdaptor, FaultInjectingResource, FaultOptions,
    LimitingResourceAdaptor, LoggingResourceAdaptor, StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
};
use carve::resource::{
    ArenaOptions, Bin, ExpandableOptions, FixedSizeOptions, HostBacking, PoolOptions,
    RecordingOrder, StreamOrder, VirtualOptions,
};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, ExpandableMemoryResource, FixedSizeMemoryResource,
    HostMemoryResource, MemoryResource, PoolMemoryResource, SimulatedMemoryResource, StreamRef,
    VirtualMemoryResource,
};
use conformance::{recorded_stream_order, Env, Subject, Usage};

/// Bytes every resource of one test may take from the host, so that "run out" comes quickly.
const LIMIT: usize = 4 << 20;
/// What one fixed-size bin may hold at most, in [`binning`].
const BIN_CAP: usize = 128 << 10;

/// Host memory capped at [`LIMIT`], shared by the resources of one test.
type Up = LimitingResourceAdaptor<HostMemoryResource>;

/// One test's world: simulated streams, one order log, one capped upstream, one simulated
/// memory (so that resources over it never hand out the same fake address).
struct Cpu {
    order: Arc<RecordingOrder>,
    upstream: Up,
    simulated: SimulatedMemoryResource,
}

fn cpu() -> Option<Cpu> {
    Some(Cpu {
        order: Arc::new(RecordingOrder::new()),
        upstream: LimitingResourceAdaptor::new(HostMemoryResource::new(), LIMIT),
        simulated: SimulatedMemoryResource::new(LIMIT).unwrap(),
    })
}

impl Cpu {
    fn order(&self) -> Arc<dyn StreamOrder> {
        self.order.clone()
    }

    fn pool(&self) -> PoolMemoryResource<Up> {
        PoolMemoryResource::new(
            self.upstream.clone(),
            PoolOptions::new(0).order(self.order()),
        )
        .unwrap()
    }
}

impl Env for Cpu {
    fn stream(&self, i: usize) -> StreamRef<'_> {
        StreamRef::simulated(1 + i)
    }

    fn synchronize(&self) {}

    fn stream_order<R: MemoryResource>(&self, name: &str, make: &dyn Fn() -> Subject<R>) {
        recorded_stream_order(name, self, make);
    }

    fn finish(&self, name: &str) {
        assert_eq!(
            (self.upstream.allocated_bytes(), self.simulated.usage().used),
            (0, 0),
            "{name}: bytes still held from the upstream once every resource was dropped"
        );
    }
}

fn pool_usage<R: MemoryResource>(p: &PoolMemoryResource<R>) -> Usage {
    let s = p.stats();
    Usage::new(s.bytes_in_use, s.live_blocks)
}

// The plain resources.

fn host(_: &Cpu) -> Subject<HostMemoryResource> {
    Subject::new(HostMemoryResource::new())
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
        .frees_at_once("pageable host memory: no stream work to wait for")
}

fn simulated(_: &Cpu) -> Subject<SimulatedMemoryResource> {
    Subject::new(SimulatedMemoryResource::new(LIMIT).unwrap())
        .usage(|r| {
            let u = r.usage();
            Usage::new(u.used, u.live_blocks)
        })
        .frees_at_once("address-only memory: nothing runs on its streams")
        .sibling_unchecked("every simulated resource hands out the same fake address range")
}

// The suballocators.

fn pool(env: &Cpu) -> Subject<PoolMemoryResource<Up>> {
    Subject::new(env.pool())
        .usage(pool_usage)
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

fn pool_primed_and_bounded(env: &Cpu) -> Subject<PoolMemoryResource<Up>> {
    let opts = PoolOptions::new(LIMIT / 4)
        .maximum(LIMIT / 2)
        .order(env.order());
    Subject::new(PoolMemoryResource::new(env.upstream.clone(), opts).unwrap())
        .usage(pool_usage)
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

fn pool_over_simulated(env: &Cpu) -> Subject<PoolMemoryResource<SimulatedMemoryResource>> {
    let opts = PoolOptions::new(0).order(env.order());
    Subject::new(PoolMemoryResource::new(env.simulated.clone(), opts).unwrap())
        .usage(pool_usage)
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

fn fixed_size(env: &Cpu) -> Subject<FixedSizeMemoryResource<Up>> {
    let opts = FixedSizeOptions::new(4096)
        .blocks_per_refill(16)
        .max_refills(64)
        .order(env.order());
    Subject::new(FixedSizeMemoryResource::new(env.upstream.clone(), opts).unwrap())
        .max_bytes(4096)
        .max_align(256)
        .usage(|r| {
            let s = r.stats();
            Usage::new(s.blocks_in_use * s.block_size, s.blocks_in_use)
        })
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
        .size_mismatch_accepted("blocks are one size: any size up to the block's frees it")
}

fn binning(env: &Cpu) -> Subject<BinningMemoryResource<Up>> {
    // Fixed-size bins keep what they refill (as RMM's do), so their caps together must leave
    // room under LIMIT for a bin that has nothing yet: at most 128 KiB a bin, or one refill
    // (2.5 MiB in all). Uncapped, bins that the concurrency check filled could starve a bin it
    // never touched.
    let bins = (8..=16)
        .map(|e| {
            let refill = 16usize << e;
            let opts = FixedSizeOptions::new(1 << e)
                .blocks_per_refill(16)
                .max_refills((BIN_CAP / refill).max(1))
                .order(env.order());
            let fixed = FixedSizeMemoryResource::new(env.upstream.clone(), opts).unwrap();
            Bin {
                size: 1 << e,
                resource: Arc::new(fixed),
            }
        })
        .collect();
    Subject::new(BinningMemoryResource::with_bins(env.upstream.clone(), bins).unwrap())
        .no_usage("its bins are type-erased resources; count with a StatisticsResourceAdaptor")
        .recorded(&env.order)
        .size_mismatch_unchecked("a size in the same bin frees the block: bins hold one size")
        .sibling_unchecked(
            "requests above the largest bin go to the upstream, which siblings share",
        )
}

/// Power-of-two bins as `BinningMemoryResource::new` makes them: fixed-size resources with 4 MiB
/// refills (so over uncapped host memory), ordered by their upstream's default (host memory:
/// nothing to order).
fn binning_default(_: &Cpu) -> Subject<BinningMemoryResource<HostMemoryResource>> {
    Subject::new(BinningMemoryResource::new(HostMemoryResource::new(), 8, 16).unwrap())
        .no_usage("its bins are type-erased resources; count with a StatisticsResourceAdaptor")
        .frees_at_once("bins over host memory use host ordering: no stream work to wait for")
        .size_mismatch_unchecked("a size in the same bin frees the block: bins hold one size")
        .sibling_unchecked(
            "requests above the largest bin go to the upstream, which siblings share",
        )
}

/// Bins as `BinningMemoryResource::over_pool` builds them (4 MiB refills, so over uncapped host
/// memory): requests above the largest bin go to a pool over the same upstream, not to the
/// upstream one by one.
fn binning_over_pool(
    _: &Cpu,
) -> Subject<BinningMemoryResource<PoolMemoryResource<HostMemoryResource>>> {
    let mr =
        BinningMemoryResource::over_pool(HostMemoryResource::new(), 8, 12, PoolOptions::new(0))
            .unwrap();
    Subject::new(mr)
        .no_usage("its bins are type-erased resources; count with a StatisticsResourceAdaptor")
        .frees_at_once("bins and pool over host memory use host ordering: nothing to wait for")
        .size_mismatch_unchecked("a size in the same bin frees the block: bins hold one size")
}

fn arena(env: &Cpu) -> Subject<ArenaMemoryResource<Up>> {
    let opts = ArenaOptions {
        superblock_size: 64 << 10,
        arenas: 4,
        global: PoolOptions::new(0).order(env.order()),
    };
    Subject::new(ArenaMemoryResource::new(env.upstream.clone(), opts).unwrap())
        .usage(|r| Usage::bytes(r.stats().bytes_in_use))
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

// The virtual-memory resources, over host memory files mapped into a host reservation (real,
// writable memory) with 16 KiB chunks, bounded by [`LIMIT`].

fn virtual_usage(r: &VirtualMemoryResource<HostBacking>) -> Usage {
    let s = r.stats();
    Usage::new(s.bytes_in_use, s.live_blocks)
}

fn virtual_whole_chunks(env: &Cpu) -> Subject<VirtualMemoryResource<HostBacking>> {
    let opts = VirtualOptions::new()
        .maximum(LIMIT)
        .chunk_size(16 << 10)
        .order(env.order());
    Subject::new(VirtualMemoryResource::new(HostBacking::new(4096).unwrap(), opts).unwrap())
        .usage(virtual_usage)
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
        .size_mismatch_unchecked("blocks are whole chunks: a size of the same chunk count frees it")
}

fn virtual_expandable(env: &Cpu) -> Subject<VirtualMemoryResource<HostBacking>> {
    let opts = VirtualOptions::expandable()
        .maximum(LIMIT)
        .chunk_size(16 << 10)
        .order(env.order());
    Subject::new(VirtualMemoryResource::new(HostBacking::new(4096).unwrap(), opts).unwrap())
        .usage(virtual_usage)
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

fn expandable(env: &Cpu) -> Subject<ExpandableMemoryResource<HostBacking>> {
    let opts = ExpandableOptions {
        maximum: Some(LIMIT),
        small_limit: Some(64 << 10),
        small_chunk: Some(16 << 10),
        large_chunk: Some(128 << 10),
        order: Some(env.order()),
        ..ExpandableOptions::default()
    };
    Subject::new(ExpandableMemoryResource::new(HostBacking::new(4096).unwrap(), opts).unwrap())
        .usage(|r| {
            let s = r.stats();
            Usage::new(s.bytes_in_use(), s.live_blocks())
        })
        .invariants(|r| r.check_invariants())
        .recorded(&env.order)
}

// The adaptors, each over its own pool, so that they must pass streams on unchanged for the
// stream-order check to hold.

fn limiting(env: &Cpu) -> Subject<LimitingResourceAdaptor<PoolMemoryResource<Up>>> {
    Subject::new(LimitingResourceAdaptor::new(env.pool(), 1 << 30))
        .usage(|r| Usage::bytes(r.allocated_bytes()))
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

fn statistics(env: &Cpu) -> Subject<StatisticsResourceAdaptor<PoolMemoryResource<Up>>> {
    Subject::new(StatisticsResourceAdaptor::new(env.pool()))
        .usage(|r| {
            let (bytes, blocks) = (r.bytes_counter().value, r.allocations_counter().value);
            Usage::new(bytes as usize, blocks as usize)
        })
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

fn tracking(env: &Cpu) -> Subject<TrackingResourceAdaptor<PoolMemoryResource<Up>>> {
    Subject::new(TrackingResourceAdaptor::new(env.pool(), false))
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

fn logging(env: &Cpu) -> Subject<LoggingResourceAdaptor<PoolMemoryResource<Up>>> {
    let mr = LoggingResourceAdaptor::to_writer(env.pool(), std::io::sink(), false).unwrap();
    Subject::new(mr)
        .usage(|r| pool_usage(r.upstream()))
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

type NeverRetry = fn(usize) -> bool;

fn failure_callback(
    env: &Cpu,
) -> Subject<FailureCallbackResourceAdaptor<PoolMemoryResource<Up>, NeverRetry>> {
    let never: NeverRetry = |_| false;
    Subject::new(FailureCallbackResourceAdaptor::new(env.pool(), never))
        .usage(|r| pool_usage(r.upstream()))
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

/// With no faults and no delayed frees it must be a transparent adaptor (tests/fault_injection.rs
/// checks what happens with them).
fn fault_injection(env: &Cpu) -> Subject<FaultInjectingResource<PoolMemoryResource<Up>>> {
    Subject::new(FaultInjectingResource::new(
        env.pool(),
        FaultOptions::default(),
    ))
    .usage(|r| pool_usage(r.upstream()))
    .invariants(|r| r.upstream().check_invariants())
    .recorded(&env.order)
}

fn aligned(env: &Cpu) -> Subject<AlignedResourceAdaptor<PoolMemoryResource<Up>>> {
    Subject::new(AlignedResourceAdaptor::new(env.pool(), 4096, 64 << 10).unwrap())
        .usage(|r| pool_usage(r.upstream()))
        .invariants(|r| r.upstream().check_invariants())
        .recorded(&env.order)
}

conformance_suite! { cpu;
    host => host,
    simulated => simulated,
    pool => pool,
    pool_primed_and_bounded => pool_primed_and_bounded,
    pool_over_simulated => pool_over_simulated,
    fixed_size => fixed_size,
    binning => binning,
    binning_default => binning_default,
    binning_over_pool => binning_over_pool,
    arena => arena,
    virtual_whole_chunks => virtual_whole_chunks,
    virtual_expandable => virtual_expandable,
    expandable => expandable,
    limiting => limiting,
    statistics => statistics,
    tracking => tracking,
    logging => logging,
    failure_callback => failure_callback,
    aligned => aligned,
    fault_injection => fault_injection,
}

/// The checks can fail: resources that break a promise are caught.
mod the_suite_catches {
    use carve::resource::HostOrder;

    use super::*;
    use crate::common::ScriptedUpstream;

    /// Host memory that reports success for every free, even of pointers it never handed out.
    #[test]
    #[should_panic(expected = "free of a stack address: expected UnknownPointer, got Ok(())")]
    fn a_resource_that_accepts_foreign_frees() {
        let env = cpu().unwrap();
        conformance::bad_frees("lenient", &env, &|| {
            Subject::new(ScriptedUpstream::new().lenient()).frees_at_once("host memory")
        });
    }

    #[test]
    #[should_panic(expected = "with no ordering after the free")]
    fn a_pool_that_hands_blocks_across_streams_unordered() {
        let env = cpu().unwrap();
        // The pool orders nothing (host ordering), yet claims to order through the log.
        conformance::stream_order("unordered pool", &env, &|| {
            let opts = PoolOptions::new(0).order(Arc::new(HostOrder));
            Subject::new(PoolMemoryResource::new(env.upstream.clone(), opts).unwrap())
                .usage(pool_usage)
                .recorded(&env.order)
        });
    }

    #[test]
    #[should_panic(expected = "bytes in use went")]
    fn statistics_that_do_not_move() {
        let env = cpu().unwrap();
        conformance::statistics("frozen", &env, &|| {
            Subject::new(HostMemoryResource::new())
                .usage(|_| Usage::new(0, 0))
                .frees_at_once("host memory")
        });
    }

    #[test]
    #[should_panic(expected = "does not say how the resource orders streams")]
    fn an_entry_that_does_not_state_its_stream_order() {
        let env = cpu().unwrap();
        conformance::stream_order(
            "unstated",
            &env,
            &|| Subject::new(HostMemoryResource::new()),
        );
    }
}
