//! RMM's `random_allocations` workload: 2×N steps; each allocates (sizes uniform in 1..=max)
//! with 73 % probability while fewer than N allocations were made and live bytes stay under a
//! cap, and otherwise frees a random live allocation. Fixed seed. Reports ns per step.
//! A second table runs it on 1 to 16 threads at once, each on its own stream, with controls
//! that give each thread a resource of its own (what the machine allows with nothing shared).

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, CudaMemoryResource, Device,
    FixedSizeMemoryResource, HostMemoryResource, MemoryResource, PoolMemoryResource,
    SharedResource, StreamRef,
};
use rand::rngs::SmallRng;
use rand::{RngExt, SeedableRng};

use super::driver_pool::DriverPool;
use super::table::{ns, Table};

const MIB: usize = 1 << 20;
const SEED: u64 = 0x5EED;
/// Timed passes per multi-threaded cell (after one warm-up); the cell is their median.
const PASSES: usize = 3;

/// The live allocations of one run: kept by the caller across runs, so the timed run neither
/// allocates nor first touches the list (page faults and `mmap` serialise threads).
pub type Live = Vec<(NonNull<u8>, usize)>;

/// Runs the workload once on `live` (left empty); returns when its 2×N steps began and ended.
/// The final cleanup is outside that span.
pub fn workload(
    mr: &dyn MemoryResource,
    stream: StreamRef<'_>,
    n: usize,
    max_bytes: usize,
    cap: usize,
    seed: u64,
    live: &mut Live,
) -> carve::Result<(Instant, Instant)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    live.clear();
    live.reserve(n);
    let (mut made, mut live_bytes) = (0usize, 0usize);
    let start = Instant::now();
    for _ in 0..2 * n {
        let size = rng.random_range(1..=max_bytes);
        let alloc = rng.random_bool(0.73) && made < n && live_bytes + size <= cap;
        if alloc {
            live.push((mr.allocate(stream, size, 256)?, size));
            made += 1;
            live_bytes += size;
        } else if !live.is_empty() {
            let (p, size) = live.swap_remove(rng.random_range(0..live.len()));
            // SAFETY: allocated above from `mr` with this size, freed once.
            unsafe { mr.deallocate(stream, p, size, 256)? };
            live_bytes -= size;
        }
    }
    let end = Instant::now();
    for (p, size) in live.drain(..) {
        // SAFETY: as above.
        unsafe { mr.deallocate(stream, p, size, 256)? };
    }
    Ok((start, end))
}

/// Releases threads together: a blocking barrier first (threads sleep while others warm up),
/// then a spin until all have woken, so that wake-up latency does not skew their start times.
struct StartLine {
    barrier: Barrier,
    arrived: AtomicUsize,
    threads: usize,
}

impl StartLine {
    fn new(threads: usize) -> Self {
        StartLine {
            barrier: Barrier::new(threads),
            arrived: AtomicUsize::new(0),
            threads,
        }
    }

    fn wait(&self) {
        self.barrier.wait();
        self.arrived.fetch_add(1, Ordering::AcqRel);
        // Yields after a while, so that more threads than cores still all get there.
        let mut spins = 0u32;
        while self.arrived.load(Ordering::Acquire) < self.threads {
            if spins < 1 << 14 {
                std::hint::spin_loop();
                spins += 1;
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A thread's stream: a real one on a GPU, a simulated one on host memory.
enum BenchStream {
    Real(carve::Stream),
    Simulated(usize),
}

impl BenchStream {
    fn as_ref(&self) -> StreamRef<'_> {
        match self {
            BenchStream::Real(s) => s.as_ref(),
            BenchStream::Simulated(i) => StreamRef::simulated(*i),
        }
    }
}

struct Setup {
    device: Option<Device>,
    cap: usize,
}

impl Setup {
    fn upstream(&self) -> SharedResource {
        match &self.device {
            Some(d) => std::sync::Arc::new(CudaMemoryResource::new(d)),
            None => std::sync::Arc::new(HostMemoryResource::new()),
        }
    }

    fn stream(&self, i: usize) -> carve::Result<BenchStream> {
        match &self.device {
            Some(d) => Ok(BenchStream::Real(d.new_stream()?)),
            None => Ok(BenchStream::Simulated(i)),
        }
    }

    /// The resources of the single-thread table, built fresh for each cell.
    fn single(&self, name: &str, max_bytes: usize) -> carve::Result<Option<SharedResource>> {
        let up = self.upstream();
        Ok(Some(match name {
            "cuda (cuMemAlloc)" => match &self.device {
                Some(d) => std::sync::Arc::new(CudaMemoryResource::new(d)),
                None => return Ok(None),
            },
            "driver pool (cuMemAllocAsync)" => match &self.device {
                Some(d) => std::sync::Arc::new(DriverPool::new(d)?),
                None => return Ok(None),
            },
            "host (std::alloc)" => match &self.device {
                Some(_) => return Ok(None),
                None => up,
            },
            "pool" => std::sync::Arc::new(PoolMemoryResource::new(up, PoolOptions::new(0))?),
            "binning (2^18..2^22)" => std::sync::Arc::new(BinningMemoryResource::new(up, 18, 22)?),
            "fixed-size (block = max)" => std::sync::Arc::new(FixedSizeMemoryResource::new(
                up,
                FixedSizeOptions::new(max_bytes),
            )?),
            "arena" => std::sync::Arc::new(ArenaMemoryResource::new(up, ArenaOptions::default())?),
            _ => return Ok(None),
        }))
    }

    fn threaded(&self, name: &str, max_bytes: usize) -> carve::Result<SharedResource> {
        let up = self.upstream();
        Ok(match name {
            "pool" => std::sync::Arc::new(PoolMemoryResource::new(up, PoolOptions::new(0))?),
            "fixed-size" => std::sync::Arc::new(FixedSizeMemoryResource::new(
                up,
                FixedSizeOptions::new(max_bytes),
            )?),
            _ => std::sync::Arc::new(ArenaMemoryResource::new(up, ArenaOptions::default())?),
        })
    }
}

const SINGLE: [&str; 7] = [
    "cuda (cuMemAlloc)",
    "driver pool (cuMemAllocAsync)",
    "host (std::alloc)",
    "pool",
    "binning (2^18..2^22)",
    "fixed-size (block = max)",
    "arena",
];

/// The random-allocations tables: one thread, then several at once (`--quick`: smaller).
pub fn run(quick: bool) -> carve::Result<Vec<Table>> {
    let device = Device::get(0).ok();
    let cap = if device.is_some() {
        16000 * MIB
    } else {
        4096 * MIB
    };
    let setup = Setup { device, cap };
    let ns_list: &[usize] = if quick {
        &[1000, 10_000]
    } else {
        &[1000, 10_000, 100_000]
    };
    let variants = [(MIB, "1 MiB"), (64 << 10, "64 KiB")];

    let mut header = vec!["resource".to_string()];
    for (_, vname) in variants {
        for &n in ns_list {
            header.push(format!("N={n:.0e}, {vname}"));
        }
    }
    let hdr: Vec<&str> = header.iter().map(String::as_str).collect();
    let mut single = Table::new(
        "random_allocations: ns per step, single thread, default stream (median of 3 passes after a warm-up pass)",
        &hdr,
    );
    match &setup.device {
        Some(d) => single.note(format!("device: {}", d.properties()?.name)),
        None => single.note("no GPU: host-memory upstream, cap 4096 MiB".to_string()),
    }
    single.note(format!(
        "live-bytes cap {} MiB; seed {SEED:#x}",
        setup.cap / MIB
    ));
    for name in SINGLE {
        let mut row = vec![name.to_string()];
        let mut any = false;
        for (max, _) in variants {
            for &n in ns_list {
                if name.starts_with("cuda") && n > 10_000 {
                    row.push("–".into());
                    continue;
                }
                let Some(mr) = setup.single(name, max)? else {
                    row.push("–".into());
                    continue;
                };
                // One untimed pass warms the resource (pools reach their size), then three
                // timed passes on it.
                let mut times = Vec::new();
                let mut live = Live::new();
                for rep in 0..4 {
                    let (a, b) =
                        workload(&*mr, StreamRef::DEFAULT, n, max, setup.cap, SEED, &mut live)?;
                    if rep > 0 {
                        times.push(b - a);
                    }
                    if let Some(d) = &setup.device {
                        d.synchronize()?;
                    }
                }
                drop(mr);
                any = true;
                times.sort();
                row.push(ns(times[times.len() / 2].as_nanos() as f64 / (2 * n) as f64));
            }
        }
        if any {
            single.row(row);
        }
    }

    // Runs long enough (tens of ms per thread) that thread start-up skew does not dominate; 3e4
    // live blocks of up to 64 KiB on 16 threads stay within an 80 GB card.
    let n = if quick { 2000 } else { 30_000 };
    let mut multi = Table::new(
        format!("random_allocations, multi-threaded: each thread its own stream, N={n} per thread, max 64 KiB"),
        &["resource", "threads", "M steps/s (all threads)", "ns per step per thread", "speedup vs 1 thread"],
    );
    let max = 64 << 10;
    // The last three rows are controls: each thread gets a resource of its own, so nothing is
    // shared; their speedup (against the shared resource's single thread, the same setup) is
    // what the machine itself allows.
    let rows: [(&str, bool, &[usize]); 6] = [
        ("pool", false, &[1, 2, 4, 8, 16]),
        ("fixed-size", false, &[1, 4, 16]),
        ("arena", false, &[1, 4, 16]),
        ("pool", true, &[16]),
        ("fixed-size", true, &[16]),
        ("arena", true, &[16]),
    ];
    let mut bases = std::collections::HashMap::new();
    for (name, unshared, threads) in rows {
        for &t in threads {
            let mrs: Vec<SharedResource> = if unshared {
                (0..t)
                    .map(|_| setup.threaded(name, max))
                    .collect::<carve::Result<_>>()?
            } else {
                vec![setup.threaded(name, max)?; t]
            };
            let streams: Vec<_> = (0..t)
                .map(|i| setup.stream(i + 1))
                .collect::<carve::Result<_>>()?;
            let start_lines: Vec<StartLine> = (0..PASSES).map(|_| StartLine::new(t)).collect();
            let per_thread_cap = setup.cap / 16;
            // Each thread clocks its own timed steps; a pass's wall time spans the earliest
            // start to the latest end (a main-thread clock could start after a fast thread
            // finished). The cell is the median pass.
            let wall = std::thread::scope(|scope| -> carve::Result<Duration> {
                let hs: Vec<_> = streams
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let (mr, start_lines, s) = (&mrs[i], &start_lines, s.as_ref());
                        scope.spawn(move || -> carve::Result<Vec<(Instant, Instant)>> {
                            let seed = SEED + i as u64;
                            let mut live = Live::new();
                            // Warm-up: the same run, so the timed ones reuse memory. A failed
                            // thread still reaches every start line, so no other waits forever.
                            let run = |live: &mut Live| {
                                workload(&**mr, s, n, max, per_thread_cap, seed, live)
                            };
                            let mut result = run(&mut live).map(|_| Vec::new());
                            for line in start_lines {
                                line.wait();
                                if let Ok(spans) = &mut result {
                                    match run(&mut live) {
                                        Ok(span) => spans.push(span),
                                        Err(e) => result = Err(e),
                                    }
                                }
                            }
                            result
                        })
                    })
                    .collect();
                let mut spans: Vec<Option<(Instant, Instant)>> = vec![None; PASSES];
                for h in hs {
                    let mine = h.join().expect("bench thread panicked")?;
                    for (span, (a, b)) in spans.iter_mut().zip(mine) {
                        *span = Some(span.map_or((a, b), |(x, y)| (x.min(a), y.max(b))));
                    }
                }
                let mut walls: Vec<Duration> = spans
                    .into_iter()
                    .map(|s| s.map(|(a, b)| b - a).expect("at least one thread"))
                    .collect();
                walls.sort();
                Ok(walls[PASSES / 2])
            })?;
            if let Some(d) = &setup.device {
                d.synchronize()?;
            }
            let steps = (2 * n * t) as f64;
            let rate = steps / wall.as_secs_f64() / 1e6;
            if t == 1 {
                bases.insert(name, rate);
            }
            let base = bases.get(name).copied().unwrap_or(f64::NAN);
            let label = if unshared {
                format!("{name}, one per thread (control)")
            } else {
                name.to_string()
            };
            multi.row(vec![
                label,
                t.to_string(),
                format!("{rate:.1}"),
                ns(wall.as_nanos() as f64 / (2 * n) as f64),
                format!("{:.1}×", rate / base),
            ]);
            drop(mrs);
            drop(streams);
        }
    }
    multi.note(format!("median of {PASSES} passes after an untimed warm-up run per thread; a pass's time is the wall time from the first thread's first step to the last thread's last step; threads start together (a barrier, then a spin until all have woken); each thread reuses its list of live allocations from the warm-up, so the timed steps neither allocate nor page-fault outside the resource; cleanup untimed"));
    Ok(vec![single, multi])
}
