//! Random inputs: the seeded generator for randomised tests (a run repeats exactly), the
//! conformance suite's own sequence, and the number of proptest cases.

pub use rand::rngs::SmallRng;
pub use rand::RngExt;
use rand::SeedableRng;

/// A generator that yields the same sequence for the same seed.
pub fn seeded(seed: u64) -> SmallRng {
    SmallRng::seed_from_u64(seed)
}

/// Proptest cases: `default`, or `PROPTEST_CASES` when set (for long fuzzing runs, see
/// RELIABILITY.md).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// xorshift64*, the conformance suite's generator. The suite keeps this exact sequence, so every
/// resource meets the cases its recorded runs met; another sequence is a new test, added beside.
#[derive(Clone, Debug)]
pub struct XorShift64Star(u64);

impl XorShift64Star {
    /// Seeded; any seed but zero works (zero is replaced).
    pub fn new(seed: u64) -> Self {
        XorShift64Star(seed.max(1))
    }

    /// The next value.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform-ish in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next() % (hi - lo + 1) as u64) as usize
    }
}
