//! Soak tests: many threads, each with its own stream, allocate and free at random from several
//! resources at once (device and host), hand blocks to each other to free on other streams, and
//! check as they go:
//! - **none handed out twice**: a shared registry of live address ranges refuses any block that
//!   overlaps a live one, whatever resource it came from;
//! - **contents survive**: each block is tagged when allocated (host write, or `cuMemsetD8Async`
//!   on its stream) and the tag is read back before some frees; a block reused before the
//!   previous owner's queued work finished would show the wrong tag;
//! - **zero lost blocks**: at the end every resource reports no live block, and after drop every
//!   upstream (tracked) holds nothing and no teardown error was deferred;
//! - **bounded memory**: what each suballocator holds from its upstream stays within its stated
//!   multiple of the peak of its live blocks (counted per size class, by the bytes each block
//!   occupies) plus its granularity, checked at every report and at the end ([`Bound`]).
//!
//! Every `CARVE_SOAK_SECS / 20` seconds (1 to 30) it prints the bytes each resource holds from its
//! upstream, so a resource that grows without bound shows while it runs.
//!
//! `host_soak` runs everywhere (host memory, simulated streams; `CARVE_SOAK_SECS`, default 3).
//! `CARVE_SOAK_THREADS` sets the workers (default one per core, 4 to 16).
//! `gpu_soak` is ignored by default; on the GPU machine run it with
//! `CARVE_SOAK_SECS=600 .gpu/bin/soak-* --ignored --nocapture` (default 600 s; skips without a
//! GPU unless `CARVE_REQUIRE_GPU=1`).

#[path = "soak/blocks.rs"]
mod blocks;
#[path = "soak/bound.rs"]
mod bound;
mod common;

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blocks::{check_tag, tag, Access, Live, Registry};
use carve::adaptor::TrackingResourceAdaptor;
use carve::cudarc::driver::result;
use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::{
    ArenaMemoryResource, AsyncMemoryResource, BinningMemoryResource, CudaMemoryResource, Device,
    FixedSizeMemoryResource, HostMemoryResource, MemoryResource, PinnedFlags,
    PinnedHostMemoryResource, PoolMemoryResource, SharedResource, Stream, StreamRef,
};
use common::rng::{seeded, RngExt};

fn soak_duration(default_secs: u64) -> Duration {
    let secs = std::env::var("CARVE_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_secs);
    Duration::from_secs(secs)
}

/// Worker threads: `CARVE_SOAK_THREADS`, else one per core, 4 to 16.
fn soak_threads() -> usize {
    std::env::var("CARVE_SOAK_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(4, |n| n.get().clamp(4, 16)))
}

/// One resource under soak.
struct Res {
    name: &'static str,
    mr: SharedResource,
    access: Access,
    max_bytes: usize,
    /// `Err` while the resource still counts live blocks, or breaks an invariant that can only
    /// be checked while no thread uses it (checked at the end).
    idle: Box<dyn Fn() -> Result<(), String> + Send + Sync>,
    /// Invariants that hold at any time, checkable while other threads use the resource.
    invariants: Box<dyn Fn() -> Result<(), String> + Send + Sync>,
    /// Bytes the resource holds from its upstream now (for plain resources: bytes live).
    reserved: Box<dyn Fn() -> usize + Send + Sync>,
    /// The held-memory bound it promises (suballocators only).
    bound: Option<bound::Bound>,
}

#[derive(Default)]
struct Counters {
    allocs: AtomicU64,
    frees: AtomicU64,
    handoffs: AtomicU64,
    checks: AtomicU64,
    refused: AtomicU64,
}

/// Blocks one worker holds at most (bounds memory: about 0.3 MiB a block on average).
const MAX_HELD: usize = 500;

/// Blocks handed from one worker to another, already waited for on the giver's stream.
type Mailbox = Mutex<VecDeque<Live>>;

struct Soak<'a> {
    resources: &'a [Res],
    names: Vec<&'static str>,
    registry: Registry,
    counters: Counters,
    mailbox: Mailbox,
    deadline: Instant,
    /// Synchronises a worker's stream (no-op for simulated streams).
    sync: &'a (dyn Fn(StreamRef<'_>) + Sync),
    bind: &'a (dyn Fn() + Sync),
}

impl Soak<'_> {
    fn worker(&self, seed: u64, stream: StreamRef<'_>) {
        (self.bind)();
        let mut rng = seeded(seed);
        let mut mine: Vec<Live> = Vec::new();
        let mut tag_seed = seed as u8;
        while Instant::now() < self.deadline {
            for _ in 0..64 {
                let r = rng.random_range(0..100u32);
                if r < 48 || mine.is_empty() {
                    let res = rng.random_range(0..self.resources.len());
                    let rs = &self.resources[res];
                    let bytes = if rng.random_bool(0.8) {
                        rng.random_range(1..=4096)
                    } else {
                        rng.random_range(1..=rs.max_bytes)
                    };
                    if let Some(b) = &rs.bound {
                        b.count(bytes);
                    }
                    let got = rs.mr.allocate(stream, bytes, 256);
                    if let (Err(_), Some(b)) = (&got, &rs.bound) {
                        b.uncount(bytes);
                    }
                    match got {
                        Ok(p) => {
                            tag_seed = tag_seed.wrapping_add(1).max(1);
                            let b = Live {
                                addr: p.as_ptr() as usize,
                                bytes,
                                res,
                                tag: tag_seed,
                            };
                            assert_eq!(b.addr % 256, 0, "{}: misaligned", rs.name);
                            self.registry.claim(&b, &self.names);
                            tag(&b, rs.access, stream);
                            mine.push(b);
                            self.counters.allocs.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) if e.is_out_of_memory() => {
                            self.counters.refused.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => panic!("{}: allocate({bytes}): {e}", rs.name),
                    }
                } else if r < 92 {
                    let b = mine.swap_remove(rng.random_range(0..mine.len()));
                    let check = rng.random_range(0..8) == 0;
                    self.free(b, stream, check);
                } else if r < 96 && self.mailbox.lock().unwrap().len() < MAX_HELD {
                    // Hand a block to whoever looks next: it will free it on its own stream.
                    // (Bounded, as what workers hold: hand-offs and pick-ups are a random walk.)
                    let b = mine.swap_remove(rng.random_range(0..mine.len()));
                    (self.sync)(stream);
                    self.mailbox.lock().unwrap().push_back(b);
                    self.counters.handoffs.fetch_add(1, Ordering::Relaxed);
                } else {
                    let got = self.mailbox.lock().unwrap().pop_front();
                    if let Some(b) = got {
                        self.free(b, stream, true);
                    }
                }
                if mine.len() > MAX_HELD {
                    let b = mine.swap_remove(0);
                    self.free(b, stream, false);
                }
            }
            let i = rng.random_range(0..self.resources.len());
            (self.resources[i].invariants)().unwrap_or_else(|e| panic!("{}: {e}", self.names[i]));
        }
        for b in mine {
            self.free(b, stream, false);
        }
        (self.sync)(stream);
    }

    fn free(&self, b: Live, stream: StreamRef<'_>, check: bool) {
        let rs = &self.resources[b.res];
        if check {
            check_tag(&b, rs.access, stream, rs.name);
            self.counters.checks.fetch_add(1, Ordering::Relaxed);
        }
        self.registry.release(&b);
        let p = NonNull::new(b.addr as *mut u8).unwrap();
        // SAFETY: a live block of this resource with these arguments, freed once; its work is
        // ordered on `stream` (its own, or synchronised before the hand-off).
        unsafe { rs.mr.deallocate(stream, p, b.bytes, 256) }
            .unwrap_or_else(|e| panic!("{}: free of {b:?}: {e}", rs.name));
        if let Some(bound) = &rs.bound {
            bound.uncount(b.bytes);
        }
        self.counters.frees.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs `threads` workers for `duration`, then frees the mailbox and checks that nothing is
/// live anywhere.
fn run_soak(
    resources: &[Res],
    streams: &[StreamRef<'_>],
    duration: Duration,
    sync: &(dyn Fn(StreamRef<'_>) + Sync),
    bind: &(dyn Fn() + Sync),
) {
    let soak = Soak {
        resources,
        names: resources.iter().map(|r| r.name).collect(),
        registry: Registry::default(),
        counters: Counters::default(),
        mailbox: Mutex::new(VecDeque::new()),
        deadline: Instant::now() + duration,
        sync,
        bind,
    };
    let started = Instant::now();
    std::thread::scope(|s| {
        for (i, &stream) in streams.iter().enumerate() {
            let soak = &soak;
            s.spawn(move || soak.worker(0x50a4 + i as u64, stream));
        }
        let soak = &soak;
        s.spawn(move || {
            let period = (duration / 20).clamp(Duration::from_secs(1), Duration::from_secs(30));
            while Instant::now() < soak.deadline {
                // Never past the deadline: the workers' end must not wait for a report.
                let left = soak.deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(period.min(left));
                let held: Vec<String> = resources
                    .iter()
                    .map(|r| {
                        let held = (r.reserved)();
                        if let Some(b) = &r.bound {
                            b.check(r.name, held);
                        }
                        format!("{} {:.0}", r.name, held as f64 / (1 << 20) as f64)
                    })
                    .collect();
                eprintln!(
                    "soak {:>4.0} s, MiB held: {}",
                    started.elapsed().as_secs_f64(),
                    held.join(", ")
                );
            }
        });
    });
    bind();
    let leftovers: Vec<Live> = soak.mailbox.lock().unwrap().drain(..).collect();
    for b in leftovers {
        soak.free(b, streams[0], true);
    }
    sync(streams[0]);
    assert!(soak.registry.live.lock().unwrap().is_empty());
    for r in resources {
        (r.invariants)().unwrap_or_else(|e| panic!("{}: {e}", r.name));
        (r.idle)().unwrap_or_else(|e| panic!("{} lost blocks: {e}", r.name));
        if let Some(b) = &r.bound {
            b.check(r.name, (r.reserved)());
        }
    }
    let breaches: Vec<String> = resources
        .iter()
        .filter_map(|r| r.bound.as_ref()?.breach.lock().unwrap().clone())
        .collect();
    assert!(
        breaches.is_empty(),
        "held memory above the bound:\n{}",
        breaches.join("\n")
    );
    let c = &soak.counters;
    eprintln!(
        "soak: {:.0} s, {} threads, {} resources: {} allocations, {} frees, {} hand-offs, \
         {} tag checks, {} refused (out of memory), 0 lost, 0 handed out twice",
        started.elapsed().as_secs_f64(),
        streams.len(),
        resources.len(),
        c.allocs.load(Ordering::Relaxed),
        c.frees.load(Ordering::Relaxed),
        c.handoffs.load(Ordering::Relaxed),
        c.checks.load(Ordering::Relaxed),
        c.refused.load(Ordering::Relaxed)
    );
    assert_eq!(
        c.allocs.load(Ordering::Relaxed),
        c.frees.load(Ordering::Relaxed)
    );
}

/// The suballocators over `upstream` (tracked), plus `plain` resources as they are. Returns the
/// resources and the upstream trackers to check after drop.
fn suballocators(
    upstream: SharedResource,
    access: Access,
    prefix: &'static [&'static str; 4],
) -> (Vec<Res>, Vec<TrackingResourceAdaptor<SharedResource>>) {
    let mut res = Vec::new();
    let mut trackers = Vec::new();
    let mut track = || {
        let t = TrackingResourceAdaptor::new(upstream.clone(), false);
        trackers.push(t.clone());
        let held = t.clone();
        let reserved: Box<dyn Fn() -> usize + Send + Sync> =
            Box::new(move || held.allocated_bytes());
        (Arc::new(t) as SharedResource, reserved)
    };
    let (up, reserved) = track();
    let pool = PoolMemoryResource::new(up, PoolOptions::new(8 << 20)).unwrap();
    let (p1, p2) = (pool.clone(), pool.clone());
    res.push(Res {
        name: prefix[0],
        mr: Arc::new(pool),
        access,
        max_bytes: 4 << 20,
        idle: Box::new(move || match p1.stats().live_blocks {
            0 => Ok(()),
            n => Err(format!("{n} live blocks")),
        }),
        invariants: Box::new(move || p2.check_invariants()),
        reserved,
        bound: Some(bound::pool(8 << 20)),
    });
    let (up, reserved) = track();
    let fixed = FixedSizeMemoryResource::new(up, FixedSizeOptions::new(64 << 10)).unwrap();
    let (f1, f2) = (fixed.clone(), fixed.clone());
    res.push(Res {
        name: prefix[1],
        mr: Arc::new(fixed),
        access,
        max_bytes: 64 << 10,
        // Its invariant check needs the resource to itself: at the end only.
        idle: Box::new(move || match f1.stats().blocks_in_use {
            0 => f2.check_invariants(),
            n => Err(format!("{n} blocks in use")),
        }),
        invariants: Box::new(|| Ok(())),
        reserved,
        bound: Some(bound::fixed_size(64 << 10)),
    });
    let (up, arena_reserved) = track();
    let arena = ArenaMemoryResource::new(
        up,
        ArenaOptions {
            superblock_size: 4 << 20,
            ..ArenaOptions::default()
        },
    )
    .unwrap();
    let (a1, a2) = (arena.clone(), arena.clone());
    res.push(Res {
        name: prefix[2],
        mr: Arc::new(arena),
        access,
        max_bytes: 8 << 20,
        idle: Box::new(move || match a1.stats().bytes_in_use {
            0 => Ok(()),
            n => Err(format!("{n} bytes in use")),
        }),
        invariants: Box::new(move || a2.check_invariants()),
        reserved: arena_reserved,
        bound: Some(bound::arena(4 << 20)),
    });
    let (bins_up, bins_reserved) = track();
    let binning = BinningMemoryResource::new(bins_up, 8, 16).unwrap();
    // Binning has no counters of its own: a client-side tracker counts its live blocks.
    let counted = TrackingResourceAdaptor::new(binning, false);
    let c1 = counted.clone();
    res.push(Res {
        name: prefix[3],
        mr: Arc::new(counted),
        access,
        max_bytes: 1 << 20,
        idle: Box::new(move || match c1.allocation_count() {
            0 => Ok(()),
            n => Err(format!("{n} outstanding")),
        }),
        invariants: Box::new(|| Ok(())),
        reserved: bins_reserved,
        bound: Some(bound::binning(8, 16)),
    });
    (res, trackers)
}

fn tracked_plain(name: &'static str, mr: SharedResource, access: Access, max: usize) -> Res {
    let t = TrackingResourceAdaptor::new(mr, false);
    let (t1, t2) = (t.clone(), t.clone());
    Res {
        name,
        mr: Arc::new(t),
        access,
        max_bytes: max,
        idle: Box::new(move || match t1.allocation_count() {
            0 => Ok(()),
            n => Err(format!("{n} outstanding")),
        }),
        invariants: Box::new(|| Ok(())),
        reserved: Box::new(move || t2.allocated_bytes()),
        bound: None,
    }
}

fn assert_upstreams_empty(trackers: &[TrackingResourceAdaptor<SharedResource>]) {
    for t in trackers {
        assert_eq!(
            t.allocation_count(),
            0,
            "upstream leak: {}",
            t.leak_report()
        );
    }
    if let Some(e) = carve::take_deferred_error() {
        panic!("teardown failed: {e}");
    }
}

#[test]
fn host_soak() {
    let host: SharedResource = Arc::new(HostMemoryResource::new());
    let (mut res, trackers) = suballocators(
        host.clone(),
        Access::Host,
        &["host pool", "host fixed-size", "host arena", "host binning"],
    );
    res.push(tracked_plain("host", host, Access::Host, 1 << 20));
    let threads = soak_threads();
    let streams: Vec<StreamRef<'_>> = (0..threads).map(|i| StreamRef::simulated(1 + i)).collect();
    run_soak(&res, &streams, soak_duration(3), &|_| {}, &|| {});
    drop(res);
    assert_upstreams_empty(&trackers);
}

#[test]
#[ignore = "10 minutes on a GPU: CARVE_SOAK_SECS=600 cargo test --release --test soak -- --ignored"]
fn gpu_soak() {
    let dev: Device = carve::require_gpu!();
    let cuda: SharedResource = Arc::new(CudaMemoryResource::new(&dev));
    let (mut res, mut trackers) = suballocators(
        cuda.clone(),
        Access::Device,
        &[
            "device pool",
            "device fixed-size",
            "device arena",
            "device binning",
        ],
    );
    res.push(tracked_plain("cuMemAlloc", cuda, Access::Device, 4 << 20));
    let driver_pool: SharedResource = Arc::new(AsyncMemoryResource::default_pool(&dev).unwrap());
    res.push(tracked_plain(
        "driver pool",
        driver_pool,
        Access::Device,
        8 << 20,
    ));
    let pinned: SharedResource =
        Arc::new(PinnedHostMemoryResource::new(&dev, PinnedFlags::PORTABLE).unwrap());
    let (pinned_res, pinned_trackers) = suballocators(
        pinned,
        Access::Host,
        &[
            "pinned pool",
            "pinned fixed-size",
            "pinned arena",
            "pinned binning",
        ],
    );
    res.extend(pinned_res);
    trackers.extend(pinned_trackers);
    res.push(tracked_plain(
        "host",
        Arc::new(HostMemoryResource::new()),
        Access::Host,
        1 << 20,
    ));
    let threads = soak_threads();
    let owned: Vec<Stream> = (0..threads).map(|_| dev.new_stream().unwrap()).collect();
    let streams: Vec<StreamRef<'_>> = owned.iter().map(Stream::as_ref).collect();
    let d = dev.clone();
    let sync = move |s: StreamRef<'_>| {
        d.bind().unwrap();
        // SAFETY: `s` is one of `owned`'s streams, alive for the whole soak.
        unsafe { result::stream::synchronize(s.as_raw()) }.unwrap();
    };
    let d = dev.clone();
    let bind = move || d.bind().unwrap();
    run_soak(&res, &streams, soak_duration(600), &sync, &bind);
    dev.synchronize().unwrap();
    drop(res);
    assert_upstreams_empty(&trackers);
    drop(owned);
}

/// The registry itself catches a block handed out twice.
#[test]
#[should_panic(expected = "inside live")]
fn registry_catches_overlap() {
    let r = Registry::default();
    let names = ["a", "b"];
    r.claim(
        &Live {
            addr: 0x1000,
            bytes: 0x100,
            res: 0,
            tag: 1,
        },
        &names,
    );
    r.claim(
        &Live {
            addr: 0x1080,
            bytes: 0x10,
            res: 1,
            tag: 2,
        },
        &names,
    );
}
