//! [`FaultPattern`]: which calls a test double fails, shared by the fault-injecting adaptor,
//! the checked stream order and the simulated physical backing.

/// Which calls fail. Calls are numbered from 1, per kind (allocations and frees separately),
/// across all threads and clones.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum FaultPattern {
    /// Nothing fails.
    #[default]
    Never,
    /// Only call number `k` fails.
    Nth(u64),
    /// Calls `k`, `2k`, `3k`, ... fail.
    EveryNth(u64),
    /// Each call fails with probability `fraction`, decided by a hash of `seed` and the call
    /// number: the same seed fails the same calls.
    Random {
        /// In `0.0..=1.0`.
        fraction: f64,
        /// Any value; one seed, one sequence.
        seed: u64,
    },
}

impl FaultPattern {
    /// Whether call number `n` (from 1) fails.
    pub fn fails(self, n: u64) -> bool {
        match self {
            FaultPattern::Never => false,
            FaultPattern::Nth(k) => n == k,
            FaultPattern::EveryNth(k) => k != 0 && n % k == 0,
            FaultPattern::Random { fraction, seed } => {
                // The top 53 bits of a SplitMix64 hash, as a uniform fraction in [0, 1).
                let u = (splitmix64(seed ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 11) as f64
                    / (1u64 << 53) as f64;
                u < fraction
            }
        }
    }
}

/// SplitMix64's finaliser: a cheap, well-mixed hash (no `rand` in the library).
fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
