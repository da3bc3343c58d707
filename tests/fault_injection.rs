//! Every suballocator and adaptor over a [`FaultInjectingResource`]: random allocate/free
//! sequences while the upstream fails the k-th, every k-th or a random fraction of requests, and
//! holds frees back. After any pattern of failures: failed requests are typed out-of-memory
//! errors, the resource's invariants and statistics stay consistent with a reference model,
//! later requests succeed once the faults stop, and after drop the upstream holds zero bytes.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use carve::adaptor::{
    AlignedResourceAdaptor, FailureCallbackResourceAdaptor, FaultInjectingResource, FaultOptions,
    FaultPattern, LimitingResourceAdaptor, LoggingResourceAdaptor, StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
};
use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, FixedSizeMemoryResource, HostMemoryResource,
    MemoryResource, PoolMemoryResource,
};
use common::{stream, Model, Op};
use proptest::prelude::*;

type Faulty = FaultInjectingResource<HostMemoryResource>;

fn faulty(options: FaultOptions) -> (HostMemoryResource, Faulty) {
    let host = HostMemoryResource::new();
    (host.clone(), FaultInjectingResource::new(host, options))
}

fn patterns() -> impl Strategy<Value = FaultPattern> {
    prop_oneof![
        (1u64..40).prop_map(FaultPattern::Nth),
        (1u64..6).prop_map(FaultPattern::EveryNth),
        (0.0f64..0.9, any::<u64>())
            .prop_map(|(fraction, seed)| FaultPattern::Random { fraction, seed }),
    ]
}

fn options() -> impl Strategy<Value = FaultOptions> {
    (patterns(), prop_oneof![Just(0usize), 1usize..6]).prop_map(|(allocations, delay_frees)| {
        FaultOptions {
            allocations,
            delay_frees,
            ..FaultOptions::default()
        }
    })
}

fn ops(max_bytes: usize, max_align_log: u32) -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => (1..=max_bytes, 0..=max_align_log, 0..3usize)
            .prop_map(|(bytes, a, stream)| Op::Alloc { bytes, align: 1 << a, stream }),
        2 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Op::Free { pick, stream }),
    ];
    prop::collection::vec(op, 1..100)
}

/// What the harness checks after each step, given the model's live blocks.
struct Checks<'a> {
    invariants: &'a dyn Fn() -> Result<(), String>,
    /// Blocks the resource says are live (compared with the model), when it can tell.
    live_blocks: Option<&'a dyn Fn() -> usize>,
}

/// Runs `ops` on `mr` while `faults` injects failures; failed allocations must be out-of-memory
/// and change nothing. Then stops the faults, checks that fresh requests of every size succeed,
/// and frees everything.
fn run(mr: &dyn MemoryResource, faults: &Faulty, ops: &[Op], checks: &Checks<'_>) {
    let mut model = Model::default();
    let mut failed = 0;
    let check = |model: &Model| {
        (checks.invariants)().unwrap();
        if let Some(live) = checks.live_blocks {
            assert_eq!(live(), model.live.len(), "live blocks");
        }
    };
    for op in ops {
        match *op {
            Op::Alloc {
                bytes,
                align,
                stream: s,
            } => match mr.allocate(stream(s), bytes, align) {
                Ok(p) => model.add(p, bytes, align, true),
                Err(e) => {
                    assert!(e.is_out_of_memory(), "not out-of-memory: {e}");
                    failed += 1;
                }
            },
            Op::Free { pick, stream: s } => {
                if let Some((p, bytes, align)) = model.take(pick, true) {
                    // SAFETY: a live block of `mr` with these arguments, freed once.
                    unsafe { mr.deallocate(stream(s), p, bytes, align) }.unwrap();
                }
            }
        }
        check(&model);
    }
    let injected = faults.stats().injected_allocation_failures;
    assert!(
        failed as u64 <= injected,
        "{failed} failures, only {injected} injected"
    );
    faults.set_options(FaultOptions {
        delay_frees: faults.options().delay_frees,
        ..FaultOptions::default()
    });
    for (i, &bytes) in [1usize, 256, 3000, 70_000].iter().enumerate() {
        let p = mr
            .allocate(stream(i % 3), bytes, 256)
            .unwrap_or_else(|e| panic!("{bytes} bytes after the faults stopped: {e}"));
        model.add(p, bytes, 256, true);
        check(&model);
    }
    while let Some((p, bytes, align)) = model.take(0, true) {
        // SAFETY: as above.
        unsafe { mr.deallocate(stream(0), p, bytes, align) }.unwrap();
        check(&model);
    }
}

/// Drops `mr` (and with it the fault injector, which passes held frees on) and checks that the
/// host upstream holds nothing.
fn assert_no_leak(host: &HostMemoryResource, mr: impl Sized) {
    drop(mr);
    assert_eq!(host.allocated_bytes(), 0, "upstream bytes after drop");
    assert_eq!(host.allocation_count(), 0);
}

const NO_INVARIANTS: &dyn Fn() -> Result<(), String> = &|| Ok(());

proptest! {
    #![proptest_config(ProptestConfig::with_cases(common::cases(40)))]

    #[test]
    fn pool_survives_faults(ops in ops(40_000, 12), opts in options(), initial in 0usize..100_000) {
        let (host, faults) = faulty(FaultOptions::default());
        let pool = PoolMemoryResource::new(faults.clone(), PoolOptions::new(initial)).unwrap();
        faults.set_options(opts);
        let live = || pool.stats().live_blocks;
        run(&pool, &faults, &ops, &Checks { invariants: &|| pool.check_invariants(), live_blocks: Some(&live) });
        prop_assert_eq!(pool.stats().bytes_in_use, 0);
        drop(faults);
        assert_no_leak(&host, pool);
    }

    #[test]
    fn fixed_size_survives_faults(ops in ops(70_000, 8), opts in options(), per_refill in 1u32..6) {
        let (host, faults) = faulty(opts);
        let mr = FixedSizeMemoryResource::new(
            faults.clone(),
            FixedSizeOptions::new(3000).blocks_per_refill(per_refill),
        ).unwrap();
        // Requests above the block size are refused (a typed error, not out of memory), so keep
        // the model's sizes within it.
        let ops: Vec<Op> = ops.into_iter().map(|op| match op {
            Op::Alloc { bytes, align, stream } => Op::Alloc { bytes: 1 + bytes % 3000, align, stream },
            free => free,
        }).collect();
        let live = || mr.stats().blocks_in_use;
        run_fixed(&mr, &faults, &ops, &|| mr.check_invariants(), &live);
        drop(faults);
        assert_no_leak(&host, mr);
    }

    #[test]
    fn binning_survives_faults(ops in ops(70_000, 8), opts in options()) {
        let (host, faults) = faulty(opts);
        let mr = BinningMemoryResource::new(faults.clone(), 8, 14).unwrap();
        run(&mr, &faults, &ops, &Checks { invariants: NO_INVARIANTS, live_blocks: None });
        drop(faults);
        assert_no_leak(&host, mr);
    }

    #[test]
    fn arena_survives_faults(ops in ops(300_000, 12), opts in options()) {
        let (host, faults) = faulty(opts);
        let mr = ArenaMemoryResource::new(
            faults.clone(),
            ArenaOptions { superblock_size: 1 << 20, arenas: 2, ..Default::default() },
        ).unwrap();
        run(&mr, &faults, &ops, &Checks { invariants: &|| mr.check_invariants(), live_blocks: None });
        prop_assert_eq!(mr.stats().bytes_in_use, 0);
        drop(faults);
        assert_no_leak(&host, mr);
    }

    #[test]
    fn adaptors_survive_faults(ops in ops(40_000, 12), opts in options()) {
        let (host, faults) = faulty(opts);
        let stats = StatisticsResourceAdaptor::new(faults.clone());
        let tracking = TrackingResourceAdaptor::new(stats.clone(), false);
        let limiting = LimitingResourceAdaptor::new(tracking.clone(), usize::MAX / 4);
        let aligned = AlignedResourceAdaptor::new(limiting.clone(), 4096, 8192).unwrap();
        let retries = Arc::new(AtomicUsize::new(0));
        let counted = retries.clone();
        // Retry once per failure: an injected fault of the retry itself is then reported.
        let last_retried = Arc::new(AtomicUsize::new(0));
        let callback = FailureCallbackResourceAdaptor::new(aligned, move |bytes| {
            counted.fetch_add(1, Ordering::Relaxed);
            last_retried.swap(bytes, Ordering::Relaxed) != bytes
        });
        let logging = LoggingResourceAdaptor::to_writer(callback, std::io::sink(), false).unwrap();
        let live = || tracking.allocation_count();
        let consistent = || {
            let bytes = stats.bytes_counter().value;
            let count = stats.allocations_counter().value;
            if bytes < 0 || count as usize != tracking.allocation_count() {
                return Err(format!("statistics {bytes} B / {count} blocks, tracking {} blocks", tracking.allocation_count()));
            }
            if limiting.allocated_bytes() < tracking.allocated_bytes() {
                return Err("limiting counts fewer bytes than tracking".into());
            }
            Ok(())
        };
        run(&logging, &faults, &ops, &Checks { invariants: &consistent, live_blocks: Some(&live) });
        prop_assert_eq!(stats.bytes_counter().value, 0);
        prop_assert_eq!(limiting.allocated_bytes(), 0);
        prop_assert_eq!(tracking.leak_report(), "");
        drop((faults, stats, tracking, limiting));
        assert_no_leak(&host, logging);
    }
}

/// [`run`] for the fixed-size resource, whose largest request is its block size.
fn run_fixed(
    mr: &dyn MemoryResource,
    faults: &Faulty,
    ops: &[Op],
    invariants: &dyn Fn() -> Result<(), String>,
    live: &dyn Fn() -> usize,
) {
    let ops: Vec<Op> = ops.to_vec();
    let checks = Checks {
        invariants,
        live_blocks: Some(live),
    };
    let mut model = Model::default();
    for op in &ops {
        match *op {
            Op::Alloc {
                bytes,
                align,
                stream: s,
            } => match mr.allocate(stream(s), bytes, align) {
                Ok(p) => model.add(p, bytes, align, true),
                Err(e) => assert!(e.is_out_of_memory(), "not out-of-memory: {e}"),
            },
            Op::Free { pick, stream: s } => {
                if let Some((p, bytes, align)) = model.take(pick, true) {
                    // SAFETY: a live block of `mr` with these arguments, freed once.
                    unsafe { mr.deallocate(stream(s), p, bytes, align) }.unwrap();
                }
            }
        }
        (checks.invariants)().unwrap();
        assert_eq!(live(), model.live.len());
    }
    faults.set_options(FaultOptions::default());
    let p = mr.allocate(stream(0), 3000, 256).expect("after the faults");
    model.add(p, 3000, 256, true);
    while let Some((p, bytes, align)) = model.take(0, true) {
        // SAFETY: as above.
        unsafe { mr.deallocate(stream(0), p, bytes, align) }.unwrap();
    }
    (checks.invariants)().unwrap();
    assert_eq!(live(), 0);
}

/// Faults during construction (a pool's initial chunk, a fixed-size resource's first slab) are
/// errors, and leave nothing behind.
#[test]
fn construction_failures_leak_nothing() {
    let (host, faults) = faulty(FaultOptions {
        allocations: FaultPattern::Nth(1),
        ..FaultOptions::default()
    });
    let e = PoolMemoryResource::new(faults.clone(), PoolOptions::new(1 << 20)).unwrap_err();
    assert!(e.is_out_of_memory(), "{e}");
    let pool = PoolMemoryResource::new(faults.clone(), PoolOptions::new(1 << 20)).unwrap();
    drop(faults);
    assert_no_leak(&host, pool);
}
