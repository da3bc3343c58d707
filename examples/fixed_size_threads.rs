//! Threads on distinct streams sharing one `FixedSizeMemoryResource` over host memory, with a
//! simulated device ordering (a device-wide synchronisation sleeps 50 µs, a wait 5 µs): prints
//! ns per step per thread and the ordering calls the resource made. Each thread allocates and
//! frees only on its own stream, so in steady state no block should need to cross streams.
//!
//! `cargo run --release --example fixed_size_threads -- [threads] [steps per thread]`

use std::ptr::NonNull;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use carve::resource::{
    CountingOrder, FixedSizeMemoryResource, FixedSizeOptions, HostMemoryResource, MemoryResource,
    StreamOrder,
};
use carve::stream::{StreamId, StreamRef};

/// Host ordering with the latency of the device calls it stands for.
#[derive(Debug)]
struct SlowOrder;

impl StreamOrder for SlowOrder {
    fn mark(&self, _: StreamRef<'_>) -> carve::Result<()> {
        Ok(())
    }
    fn wait_for_mark(&self, _: StreamRef<'_>, _: StreamId) -> carve::Result<()> {
        std::thread::sleep(Duration::from_micros(5));
        Ok(())
    }
    fn mark_complete(&self, _: StreamId) -> carve::Result<bool> {
        Ok(true)
    }
    fn synchronize_all(&self) -> carve::Result<()> {
        std::thread::sleep(Duration::from_micros(50));
        Ok(())
    }
    fn synchronize(&self, _: StreamRef<'_>) -> carve::Result<()> {
        std::thread::sleep(Duration::from_micros(20));
        Ok(())
    }
}

/// The random_allocations workload: 73 % allocations until `n` are made, frees of a random
/// live block otherwise, under a byte cap.
fn workload(mr: &dyn MemoryResource, stream: StreamRef<'_>, n: usize, seed: u64) -> Duration {
    const MAX: usize = 64 << 10;
    const CAP: usize = 256 << 20;
    let mut x = seed | 1;
    let mut rng = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut live: Vec<(NonNull<u8>, usize)> = Vec::with_capacity(n);
    let (mut made, mut bytes) = (0, 0);
    let start = Instant::now();
    for _ in 0..2 * n {
        let size = 1 + (rng() as usize % MAX);
        if rng() % 100 < 73 && made < n && bytes + size <= CAP {
            live.push((mr.allocate(stream, size, 256).expect("allocate"), size));
            made += 1;
            bytes += size;
        } else if !live.is_empty() {
            let k = rng() as usize % live.len();
            let (p, size) = live.swap_remove(k);
            // SAFETY: allocated above from `mr` with this size, freed once.
            unsafe { mr.deallocate(stream, p, size, 256).expect("free") };
            bytes -= size;
        }
    }
    let took = start.elapsed();
    for (p, size) in live {
        // SAFETY: as above.
        unsafe { mr.deallocate(stream, p, size, 256).expect("free") };
    }
    took
}

fn main() {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().map_or(4, |a| a.parse().expect("threads"));
    let n: usize = args.next().map_or(30_000, |a| a.parse().expect("steps"));
    let order = Arc::new(CountingOrder::new(Arc::new(SlowOrder)));
    let mr = FixedSizeMemoryResource::new(
        HostMemoryResource::new(),
        FixedSizeOptions::new(64 << 10).order(order.clone()),
    )
    .expect("resource");
    for pass in 0..4 {
        let before = order.counts();
        let barrier = Barrier::new(threads);
        let times: Vec<Duration> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let (mr, barrier) = (&mr, &barrier);
                    s.spawn(move || {
                        barrier.wait();
                        let seed = 0x5EED + t as u64 * 7919 + pass as u64;
                        workload(mr, StreamRef::simulated(t + 1), n, seed)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        let after = order.counts();
        let ns = times.iter().map(|d| d.as_nanos()).max().unwrap_or(0) / (2 * n as u128);
        let stats = mr.stats();
        println!(
            "pass {pass} ({}): {threads} threads, {ns} ns per step per thread (slowest); \
             marks {}, waits {}, synchronize_all {}, synchronize {}; slabs {}",
            if pass == 0 { "warm-up" } else { "timed" },
            after.marks - before.marks,
            after.waits - before.waits,
            after.device_synchronizations - before.device_synchronizations,
            after.stream_synchronizations - before.stream_synchronizations,
            stats.slabs,
        );
    }
    mr.check_invariants().expect("invariants");
}
