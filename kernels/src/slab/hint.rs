//! Where a warp starts looking in a slab: hints that spread the warps of a grid over the heap.

/// The hint for warp `warp` of a grid: the warp index with its bits reversed, read as a fraction
/// of the capacity, rounded down to a multiple of 32.
///
/// Warps that run at the same time (neighbours in the grid) land far apart, on different shard
/// counts and bitmap words; the first `2^k` warps of a grid are spaced `cap / 2^k` blocks apart,
/// so when that is at least 32 (the grid's threads, rounded up to a power of two, fit the heap)
/// their runs never overlap, and a run of 32 never straddles two bitmap words. No division: one
/// bit reversal and one multiply.
#[inline(always)]
pub fn warp_hint(warp: u32, cap: u64) -> u64 {
    spread(warp, cap) & !31
}

/// The hint for a group of `lanes < 32` lanes of warp `warp` that ask one class while the rest
/// of the warp asks others (`carve_malloc` with mixed sizes): [`warp_hint`] without the rounding.
///
/// A class then gets a share of each warp's requests, and its capacity is sized to that share,
/// so it holds fewer than 32 blocks per warp of the grid: rounded to runs of 32, several warps
/// would start at the same block and all but the first lose their claim to the slow path
/// (in the 4 KiB class of `carve bench device-alloc`'s 2^22 mixed row, some 6 warps per run of
/// 32). Unrounded, warps are `cap / warps` blocks apart, about the blocks each takes; a run may
/// cross a word, which the claim handles with a second `fetch_or`.
///
/// In `carve_malloc`'s one step for mixed classes, the hint only picks the shard: the group's
/// run starts where that shard's count stands (`Slab::lead_retrying`).
#[inline(always)]
pub fn group_hint(warp: u32, cap: u64) -> u64 {
    spread(warp, cap)
}

/// `warp` with its bits reversed, read as a fraction of `cap`.
#[inline(always)]
fn spread(warp: u32, cap: u64) -> u64 {
    ((warp.reverse_bits() as u128 * cap as u128) >> 32) as u64
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::warp_hint;

    /// The first 2^k warps of a grid get disjoint, word-aligned runs of 32 inside the heap
    /// whenever the heap holds 32 blocks per warp of the grid rounded up to a power of two.
    #[test]
    fn warp_hints_of_a_grid_are_disjoint_runs() {
        for (warps, cap) in [
            (1u32, 32u64),
            (8, 256),
            (1 << 12, 3 << 16),
            (1 << 14, 600_000),
        ] {
            let mut hints: std::vec::Vec<u64> = (0..warps).map(|w| warp_hint(w, cap)).collect();
            assert!(
                hints.iter().all(|&h| h % 32 == 0 && h + 32 <= cap),
                "{warps} {cap}"
            );
            hints.sort_unstable();
            assert!(
                hints.windows(2).all(|p| p[1] >= p[0] + 32),
                "{warps} warps, cap {cap}"
            );
        }
    }

    /// Unrounded, the first 2^k warps of a grid start `cap / 2^k` blocks apart (give or take
    /// one), however few blocks that is.
    #[test]
    fn group_hints_of_a_grid_spread_evenly() {
        for (warps, cap) in [(1u32 << 17, 655_360u64), (1 << 10, 3000), (1 << 12, 4096)] {
            let mut hints: std::vec::Vec<u64> =
                (0..warps).map(|w| super::group_hint(w, cap)).collect();
            hints.sort_unstable();
            let gap = cap / warps as u64;
            assert!(hints.iter().all(|&h| h < cap));
            assert!(
                hints.windows(2).all(|p| p[1] - p[0] >= gap.max(1) - 1),
                "{warps} warps, cap {cap}"
            );
            hints.dedup();
            assert!(hints.len() as u64 >= (warps as u64).min(cap) - 1);
        }
    }

    /// Any warp index, any capacity: a block index of the heap.
    #[test]
    fn warp_hints_stay_inside_the_heap() {
        for cap in [1u64, 31, 33, 1000, 1 << 40] {
            for w in [0u32, 1, 2, 3, 1000, 123_457, u32::MAX] {
                assert!(warp_hint(w, cap) < cap, "warp {w}, cap {cap}");
            }
        }
    }
}
