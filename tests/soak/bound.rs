//! The held-memory bounds the soak asserts: what each suballocator may hold from its upstream,
//! given the peak bytes its live blocks occupied, per size class.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The most a resource may hold for its per-class peaks.
type Limit = dyn Fn(&[usize]) -> usize + Send + Sync;

/// A held-memory bound: the most a resource may hold from its upstream, given the peak bytes its
/// live blocks occupied, per size class. A request is counted before it is made and uncounted
/// after its free returns, so the peaks are never below what the resource had live.
pub struct Bound {
    /// The stated rule, for messages.
    rule: &'static str,
    /// A request's size class and the bytes its block occupies.
    class_of: Box<dyn Fn(usize) -> (usize, usize) + Send + Sync>,
    /// The most the resource may hold for these per-class peaks.
    limit: Box<Limit>,
    live: Vec<AtomicUsize>,
    peak: Vec<AtomicUsize>,
    /// The first breach seen, reported at the end with every other resource's.
    pub breach: Mutex<Option<String>>,
}

impl Bound {
    fn new(
        rule: &'static str,
        classes: usize,
        class_of: impl Fn(usize) -> (usize, usize) + Send + Sync + 'static,
        limit: impl Fn(&[usize]) -> usize + Send + Sync + 'static,
    ) -> Self {
        Bound {
            rule,
            class_of: Box::new(class_of),
            limit: Box::new(limit),
            live: (0..classes).map(|_| AtomicUsize::new(0)).collect(),
            peak: (0..classes).map(|_| AtomicUsize::new(0)).collect(),
            breach: Mutex::new(None),
        }
    }

    pub fn count(&self, bytes: usize) {
        let (c, f) = (self.class_of)(bytes);
        let now = self.live[c].fetch_add(f, Ordering::Relaxed) + f;
        self.peak[c].fetch_max(now, Ordering::Relaxed);
    }

    pub fn uncount(&self, bytes: usize) {
        let (c, f) = (self.class_of)(bytes);
        self.live[c].fetch_sub(f, Ordering::Relaxed);
    }

    /// Checks `held` (read before this call, so the peaks cover it); keeps the first breach.
    pub fn check(&self, name: &str, held: usize) {
        let peaks: Vec<usize> = self
            .peak
            .iter()
            .map(|p| p.load(Ordering::Relaxed))
            .collect();
        let limit = (self.limit)(&peaks);
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let mut breach = self.breach.lock().unwrap();
        if held > limit && breach.is_none() {
            *breach = Some(format!(
                "{name} held {:.1} MiB, above its bound {:.1} MiB ({}; peak live {:.1} MiB)",
                mib(held),
                mib(limit),
                self.rule,
                mib(peaks.iter().sum())
            ));
        }
    }
}

fn round_256(bytes: usize) -> usize {
    bytes.div_ceil(256) * 256
}

/// The bound of a fixed-size resource of `block`-byte blocks, `per` per refill (its module docs):
/// `(2 × peak blocks + 2 × blocks per refill) × stride`, as bytes.
fn fixed_size_limit(peak_bytes: usize, block: usize, per: usize) -> usize {
    2 * peak_bytes + 2 * per * round_256(block)
}

/// Blocks per refill by default: about 4 MiB worth, 1 to 1024.
fn default_per_refill(block: usize) -> usize {
    ((4 << 20) / round_256(block)).clamp(1, 1024)
}

/// The default number of pool shards and of arenas: twice the available parallelism (at least 8
/// shards), as `PoolOptions::shards` and `ArenaOptions::arenas` say.
fn default_spread() -> (usize, usize) {
    let par = std::thread::available_parallelism().map_or(1, |n| n.get());
    ((2 * par).max(8), 2 * par)
}

/// A coalescing pool whose first chunk is `initial` bytes, with the default shards: as the pool
/// documents (`tests/bounded_memory.rs`), `8 × peak + 2 slabs (256 KiB) per shard`, plus the
/// initial chunk.
pub fn pool(initial: usize) -> Bound {
    let (shards, _) = default_spread();
    Bound::new(
        "8 × peak + 2 slabs per shard + the initial chunk",
        1,
        |n| (0, round_256(n)),
        move |p| 8 * p[0] + 2 * shards * (256 << 10) + initial,
    )
}

/// A fixed-size resource of `block`-byte blocks with the default refill.
pub fn fixed_size(block: usize) -> Bound {
    Bound::new(
        "2 × peak blocks + 2 refills",
        1,
        move |_| (0, round_256(block)),
        move |p| fixed_size_limit(p[0], block, default_per_refill(block)),
    )
}

/// An arena of `superblock`-byte superblocks with the default arenas and global shards, as the
/// arena documents: `8 × peak + (8 × arenas + 2 × shards) × superblock`.
pub fn arena(superblock: usize) -> Bound {
    let (shards, arenas) = default_spread();
    Bound::new(
        "8 × peak + (8 × arenas + 2 × shards) superblocks",
        1,
        |n| (0, round_256(n)),
        move |p| 8 * p[0] + (8 * arenas + 2 * shards) * superblock,
    )
}

/// Binning with fixed-size bins `2^min_exp..=2^max_exp` (classes `0..=max_exp - min_exp`), each
/// bounded as a fixed-size resource; larger requests (the last class) go to the upstream one
/// by one, so they hold what they occupy.
pub fn binning(min_exp: u32, max_exp: u32) -> Bound {
    let bins = (max_exp - min_exp + 1) as usize;
    Bound::new(
        "per bin, 2 × peak blocks + 2 refills; larger requests as they are",
        bins + 1,
        move |n| match n {
            n if n <= 1 << max_exp => {
                let e = n.next_power_of_two().trailing_zeros().max(min_exp);
                ((e - min_exp) as usize, 1 << e)
            }
            _ => (bins, n),
        },
        move |p| {
            let held: usize = (0..bins)
                .map(|c| {
                    let size = 1usize << (min_exp as usize + c);
                    fixed_size_limit(p[c], size, default_per_refill(size))
                })
                .sum();
            held + p[bins]
        },
    )
}
