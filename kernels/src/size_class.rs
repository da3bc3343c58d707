//! Size classes of the device heap v2 (`carve_malloc`): which block size serves a request.
//!
//! Every class size is a multiple of 16 bytes, so blocks stay 16-byte aligned. The small classes
//! are 16, 32, 48, 64 (steps of 16), then four per power of two: `(2^e, 2^(e+1)]` is split into
//! steps of `2^(e-2)` for `e >= 6` (80, 96, 112, 128, 160, 192, 224, 256, 320, ...), up to
//! 64 KiB: [`NUM_SMALL_CLASSES`] classes. Above that come [`NUM_LARGE_CLASSES`] large classes,
//! one per power of two from 128 KiB to 16 MiB ([`MAX_REQUEST`]): a large request takes a whole
//! block of the next power of two, as a whole segment of that size. [`NUM_CLASSES`] in all.
//!
//! **Waste.** With `c = class_size(class_of(r))` for a request of `r` bytes, the bound is on
//! `(c - r) / c`, the share of the block the request leaves unused:
//! - for `64 < r <= 64 KiB`: `(c - r) / c < 1/5` (the step `s` is a quarter of the power of two
//!   below `r`, so `c >= 5s` and `c - r < s`); measured against the request, `(c - r) / r < 1/4`;
//! - for `36 <= r <= 64`: `(c - r) / c <= 1/4`;
//! - for `r <= 64`: `c - r < 16` bytes, the alignment granule; below 36 bytes no 16-byte
//!   spacing keeps the share under a quarter (a request of 1 byte still takes 16);
//! - for large requests, `(c - r) / c < 1/2` (powers of two).
//!
//! The tests check all of them for every request size up to 64 KiB and at every large class's
//! edges.
//!
//! [`class_of`] runs on every lane of a warp, so it is straight-line for small requests: one
//! `leading_zeros`, a few shifts and adds, one compare, no table; large requests take one more
//! branch.

use static_assertions::const_assert_eq;

/// The smallest class, in bytes.
pub const MIN_CLASS_SIZE: u32 = 16;
/// The largest small class, in bytes; larger requests take a large class.
pub const MAX_CLASS_SIZE: u32 = 64 * 1024;
/// The largest request any class serves (the largest large class), in bytes.
pub const MAX_REQUEST: u32 = 16 << 20;
/// Small classes: four up to 64 bytes, then four for each power of two up to 64 KiB.
pub const NUM_SMALL_CLASSES: usize = 4 + 4 * (MAX_CLASS_SIZE.trailing_zeros() as usize - 6);
/// Large classes: one per power of two above 64 KiB up to [`MAX_REQUEST`].
pub const NUM_LARGE_CLASSES: usize =
    (MAX_REQUEST.trailing_zeros() - MAX_CLASS_SIZE.trailing_zeros()) as usize;
/// Number of classes, small and large.
pub const NUM_CLASSES: usize = NUM_SMALL_CLASSES + NUM_LARGE_CLASSES;

/// The class that serves a request of `bytes`, or `None` for 0 and for more than
/// [`MAX_REQUEST`].
///
/// With `n = bytes - 1` and `e = max(6, floor(log2 n))`, the class is `4 (e - 6) + (n >> (e - 2))`:
/// below 64 bytes `e` is 6 and `n >> 4` counts 16-byte steps; above, `n >> (e - 2)` is in `4..8`,
/// the quarter of `(2^e, 2^(e+1)]` that `bytes` falls in.
#[inline(always)]
pub const fn class_of(bytes: u32) -> Option<u32> {
    let n = bytes.wrapping_sub(1);
    // One compare sends 0 (n wraps to u32::MAX) and everything past the small classes out.
    if n >= MAX_CLASS_SIZE {
        return large_class_of(n);
    }
    // `| 64` makes `e` at least 6 without a branch.
    let e = 31 - (n | 64).leading_zeros();
    Some(4 * (e - 6) + (n >> (e - 2)))
}

/// [`class_of`] past the small classes, for `n = bytes - 1 >= MAX_CLASS_SIZE`: the power of two
/// that holds `bytes`, or `None` past [`MAX_REQUEST`] (and for 0, whose `n` wrapped).
#[inline(always)]
const fn large_class_of(n: u32) -> Option<u32> {
    if n >= MAX_REQUEST {
        return None;
    }
    // `bytes` fits in 2^(bits of n); 2^17 is the first large class.
    let bits = 32 - n.leading_zeros();
    Some(NUM_SMALL_CLASSES as u32 + bits - (MAX_CLASS_SIZE.trailing_zeros() + 1))
}

/// The block size of `class` (`class < NUM_CLASSES`), a multiple of 16 bytes.
#[inline(always)]
pub const fn class_size(class: u32) -> u32 {
    debug_assert!((class as usize) < NUM_CLASSES);
    if class as usize >= NUM_SMALL_CLASSES {
        return MAX_CLASS_SIZE << (class - NUM_SMALL_CLASSES as u32 + 1);
    }
    // Inverse of `class_of`: `e = max(6, 5 + class / 4)`, `q = class - 4 (e - 6)` in `0..8`.
    let e = 5 + class / 4;
    let e = if e < 6 { 6 } else { e };
    let q = class - 4 * (e - 6);
    (q + 1) << (e - 2)
}

const_assert_eq!(NUM_SMALL_CLASSES, 44);
const_assert_eq!(NUM_LARGE_CLASSES, 8);
const_assert_eq!(class_size(0), MIN_CLASS_SIZE);
const_assert_eq!(class_size(NUM_SMALL_CLASSES as u32 - 1), MAX_CLASS_SIZE);
const_assert_eq!(class_size(NUM_SMALL_CLASSES as u32), 2 * MAX_CLASS_SIZE);
const_assert_eq!(class_size(NUM_CLASSES as u32 - 1), MAX_REQUEST);
const_assert_eq!(class_size(4), 80);

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;

    #[test]
    fn zero_and_oversized_requests_have_no_class() {
        assert_eq!(class_of(0), None);
        assert_eq!(class_of(MAX_REQUEST + 1), None);
        assert_eq!(class_of(u32::MAX), None);
        assert_eq!(class_of(1), Some(0));
        assert_eq!(class_of(MAX_CLASS_SIZE), Some(NUM_SMALL_CLASSES as u32 - 1));
        assert_eq!(class_of(MAX_CLASS_SIZE + 1), Some(NUM_SMALL_CLASSES as u32));
        assert_eq!(class_of(MAX_REQUEST), Some(NUM_CLASSES as u32 - 1));
    }

    /// Large requests: the smallest power of two that holds them, under half of it wasted, at
    /// every class's edges.
    #[test]
    fn large_requests_take_the_next_power_of_two() {
        for c in NUM_SMALL_CLASSES as u32..NUM_CLASSES as u32 {
            let size = class_size(c);
            assert!(size.is_power_of_two());
            let below = class_size(c - 1);
            for r in [below + 1, below + 4096, size / 2 + size / 4, size - 1, size] {
                assert_eq!(class_of(r), Some(c), "request {r}");
                assert!(
                    2 * (size - r) < size,
                    "request {r}: waste {} of {size}",
                    size - r
                );
            }
        }
    }

    #[test]
    fn class_sizes_are_the_documented_sequence() {
        let sizes: std::vec::Vec<u32> = (0..NUM_CLASSES as u32).map(class_size).collect();
        assert_eq!(
            sizes[..16],
            [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
        );
        assert_eq!(
            sizes[NUM_SMALL_CLASSES - 4..NUM_SMALL_CLASSES],
            [40960, 49152, 57344, 65536]
        );
        assert_eq!(
            sizes[NUM_SMALL_CLASSES..],
            [
                1 << 17,
                1 << 18,
                1 << 19,
                1 << 20,
                1 << 21,
                1 << 22,
                1 << 23,
                1 << 24
            ]
        );
        assert!(sizes.windows(2).all(|w| w[0] < w[1]), "strictly increasing");
        assert!(sizes.iter().all(|s| s % 16 == 0), "16-byte multiples");
        assert_eq!(sizes.len(), NUM_CLASSES);
    }

    #[test]
    fn every_class_round_trips() {
        for c in 0..NUM_CLASSES as u32 {
            assert_eq!(class_of(class_size(c)), Some(c), "class {c}");
            // The byte after a class's size belongs to the next class.
            if c + 1 < NUM_CLASSES as u32 {
                assert_eq!(class_of(class_size(c) + 1), Some(c + 1), "class {c}");
            }
        }
    }

    /// Every request size: the class fits it, is the smallest class that does, is monotone in the
    /// size, and wastes within the module's bounds.
    #[test]
    fn every_request_size_gets_the_smallest_fitting_class_within_the_waste_bound() {
        let mut prev = 0;
        let mut seen = [false; NUM_SMALL_CLASSES];
        for r in 1..=MAX_CLASS_SIZE {
            let class = class_of(r).expect("every small request has a class");
            assert!((class as usize) < NUM_SMALL_CLASSES, "request {r}");
            seen[class as usize] = true;
            assert!(class >= prev, "monotone at {r}");
            prev = class;
            let c = class_size(class);
            assert!(c >= r, "request {r} in class {class} of {c} bytes");
            if class > 0 {
                assert!(
                    class_size(class - 1) < r,
                    "request {r}: a smaller class fits"
                );
            }
            if r > 64 {
                assert!(5 * (c - r) < c, "request {r}: waste {} of {c}", c - r);
                assert!(4 * (c - r) < r, "request {r}: waste {} of {c}", c - r);
            } else {
                assert!(c - r < 16, "request {r}: waste {} of {c}", c - r);
            }
            if r >= 36 {
                assert!(4 * (c - r) <= c, "request {r}: waste {} of {c}", c - r);
            }
        }
        assert!(seen.iter().all(|&s| s), "every class serves some request");
    }
}
