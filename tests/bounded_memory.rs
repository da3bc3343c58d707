//! Held memory stays a bounded multiple of the live peak when blocks are allocated on one
//! stream and freed on another, by the same thread or by another thread (into another arena),
//! and no block changes streams without a covering ordering call ([`CheckedOrder`]).
//!
//! The bounds are the ones the resources document ([`ArenaMemoryResource`] and
//! [`PoolMemoryResource`]). Before the arena merged other streams' frees before growing, it held
//! 350 to 570 times the live peak here.

mod common;

use std::collections::VecDeque;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use carve::adaptor::StatisticsResourceAdaptor;
use carve::resource::{ArenaOptions, CheckedOrder, OrderFaults, PoolOptions, StreamOrder};
use carve::{
    ArenaMemoryResource, HostMemoryResource, MemoryResource, PoolMemoryResource, StreamRef,
};
use common::rng::{seeded, RngExt};

const KIB: usize = 1024;
const THREADS: usize = 4;
/// Blocks each thread keeps live.
const WINDOW: usize = 64;
const STEPS: usize = 20_000;

/// Live bytes now and at their peak, counted before a block is asked for and after it is
/// freed, so the count never falls below what the resource must hold.
#[derive(Default)]
struct Live {
    now: AtomicUsize,
    peak: AtomicUsize,
}

impl Live {
    fn add(&self, n: usize) {
        let v = self.now.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(v, Ordering::Relaxed);
    }
    fn sub(&self, n: usize) {
        self.now.fetch_sub(n, Ordering::Relaxed);
    }
}

/// A block in flight between threads: (address, bytes).
type Handoff = Mutex<VecDeque<(usize, usize)>>;

fn free(mr: &dyn MemoryResource, s: StreamRef<'_>, addr: usize, bytes: usize, live: &Live) {
    let p = NonNull::new(addr as *mut u8).unwrap();
    // SAFETY: a live block of `mr` allocated with `bytes`, freed once (it left the owner's
    // ring or the hand-off queue when it was taken).
    unsafe { mr.deallocate(s, p, bytes, 256) }.unwrap();
    live.sub(bytes);
}

/// Each thread allocates on its stream and frees on a succession of others: half the blocks it frees
/// itself, the other half go to a queue that every thread drains, freeing on its own freeing
/// stream (blocks of other arenas, too).
fn churn(mr: &dyn MemoryResource, live: &Live) {
    let handoff = Handoff::default();
    std::thread::scope(|scope| {
        for t in 0..THREADS {
            let handoff = &handoff;
            scope.spawn(move || {
                let alloc_on = StreamRef::simulated(1 + t);
                // A new freeing stream every 32 steps, as with a pool of streams: fewer frees
                // on each than a suballocator waits for before it marks a stream.
                let free_on = |step: usize| StreamRef::simulated(1000 + t * 1_000_000 + step / 32);
                let mut ring = VecDeque::with_capacity(WINDOW);
                let mut rng = seeded(0x9e37_79b9_7f4a_7c15u64 ^ t as u64);
                for step in 0..STEPS {
                    let x: u64 = rng.random();
                    let bytes = 256 * (1 + (x % 128) as usize);
                    live.add(bytes);
                    let p = mr.allocate(alloc_on, bytes, 256).unwrap();
                    ring.push_back((p.as_ptr() as usize, bytes));
                    if ring.len() == WINDOW {
                        let old = ring.pop_front().unwrap();
                        if step % 2 == 0 {
                            free(mr, free_on(step), old.0, old.1, live);
                        } else {
                            handoff.lock().unwrap().push_back(old);
                        }
                    }
                    for _ in 0..2 {
                        let Some((addr, bytes)) = handoff.lock().unwrap().pop_front() else {
                            break;
                        };
                        free(mr, free_on(step), addr, bytes, live);
                    }
                }
                for (addr, bytes) in ring {
                    free(mr, free_on(STEPS), addr, bytes, live);
                }
            });
        }
    });
    for (addr, bytes) in handoff.lock().unwrap().drain(..) {
        free(mr, StreamRef::simulated(100), addr, bytes, live);
    }
    assert_eq!(live.now.load(Ordering::Relaxed), 0);
}

type Upstream = StatisticsResourceAdaptor<HostMemoryResource>;

fn setup() -> (HostMemoryResource, Upstream, Arc<CheckedOrder>) {
    let host = HostMemoryResource::new();
    let stats = StatisticsResourceAdaptor::new(host.clone());
    (host, stats, CheckedOrder::new(OrderFaults::default()))
}

#[test]
fn arena_holds_a_bounded_multiple_of_live_memory_when_streams_free_each_others_blocks() {
    let (host, stats, order) = setup();
    let (superblock, arenas, shards) = (256 * KIB, THREADS, 4);
    let arena = ArenaMemoryResource::new(
        order.upstream(stats.clone()),
        ArenaOptions {
            superblock_size: superblock,
            arenas,
            global: PoolOptions::new(0)
                .shards(shards)
                .order(order.clone() as Arc<dyn StreamOrder>),
        },
    )
    .unwrap();
    let mr = order.check(arena.clone());
    let live = Live::default();
    churn(&mr, &live);
    arena.check_invariants().unwrap();
    let held = stats.bytes_counter().peak as usize;
    let peak = live.peak.load(Ordering::Relaxed);
    let bound = 8 * peak + (8 * arenas + 2 * shards) * superblock;
    assert!(
        held <= bound,
        "held {held} bytes at peak for a live peak of {peak}: over the bound {bound}"
    );
    assert!(order.violations().is_empty(), "{:?}", order.violations());
    drop((mr, arena));
    assert_eq!(host.allocated_bytes(), 0);
}

#[test]
fn pool_holds_a_bounded_multiple_of_live_memory_when_streams_free_each_others_blocks() {
    let (host, stats, order) = setup();
    let shards = 4;
    let pool = PoolMemoryResource::new(
        order.upstream(stats.clone()),
        PoolOptions::new(0)
            .shards(shards)
            .order(order.clone() as Arc<dyn StreamOrder>),
    )
    .unwrap();
    let mr = order.check(pool.clone());
    let live = Live::default();
    churn(&mr, &live);
    pool.check_invariants().unwrap();
    let held = stats.bytes_counter().peak as usize;
    let peak = live.peak.load(Ordering::Relaxed);
    // Each shard holds at most four times its own live peak (plus a slab); live bytes move
    // between shards as streams come and go, so the shards' peaks may add up to more than
    // the pool's: twice that, here.
    let bound = 8 * peak + 2 * shards * 256 * KIB;
    assert!(
        held <= bound,
        "held {held} bytes at peak for a live peak of {peak}: over the bound {bound}"
    );
    assert!(order.violations().is_empty(), "{:?}", order.violations());
    drop((mr, pool));
    assert_eq!(host.allocated_bytes(), 0);
}
