//! Exact division of a byte offset by a block size, for sizes that are not powers of two.
//!
//! Every such size of the general heap is `m << k` with `m` 3, 5 or 7 (four classes per power
//! of two: 48 = 3 · 16, 80 = 5 · 16, 112 = 7 · 16, ...). For odd `m`, `x` is a multiple of `m`
//! exactly when `x · m⁻¹ mod 2^64` (the inverse of `m` modulo 2^64) is at most `⌊(2^64 - 1) / m⌋`,
//! and then that product is `x / m` (Granlund and Montgomery, "Division by invariant integers
//! using multiplication", 1994, §9). So a free of such a block costs a shift, a multiply and a
//! compare, where a division on the GPU is a subroutine of some tens of instructions. Other
//! sizes (a slab of any block size) divide out of line.

/// `m⁻¹ mod 2^64` for odd `m`: Newton's iteration `y ← y (2 - m y)` doubles the correct low bits,
/// and `y = m` starts with three (`m² ≡ 1 mod 8`).
const fn inverse(m: u64) -> u64 {
    let mut y = m;
    let mut i = 0;
    while i < 5 {
        y = y.wrapping_mul(2u64.wrapping_sub(m.wrapping_mul(y)));
        i += 1;
    }
    y
}

/// `(m⁻¹ mod 2^64, ⌊(2^64 - 1) / m⌋)` for the odd factors of the general heap's classes.
const ODD: [(u64, u64); 3] = [
    (inverse(3), u64::MAX / 3),
    (inverse(5), u64::MAX / 5),
    (inverse(7), u64::MAX / 7),
];

/// `off / size` if `size` divides `off`, else `None` (`size > 0`): by [`class_quotient`] for
/// `m << k` with `m` 3, 5 or 7, else by division, out of line.
#[inline(always)]
pub fn exact_quotient(off: u64, size: u64) -> Option<u64> {
    if matches!(size >> size.trailing_zeros(), 3 | 5 | 7) {
        class_quotient(off, size)
    } else {
        exact_quotient_slow(off, size)
    }
}

/// [`exact_quotient`] for a general heap class's size (`m << k` with `m` 1, 3, 5 or 7):
/// straight-line, with the factor's inverse and limit picked by selects. The lanes of a warp
/// freeing blocks of different classes then take one path, not one branch per factor in turn.
#[inline(always)]
pub fn class_quotient(off: u64, size: u64) -> Option<u64> {
    let k = size.trailing_zeros();
    let m = size >> k;
    debug_assert!(matches!(m, 1 | 3 | 5 | 7), "size {size}");
    let (inv, limit) = match m {
        3 => ODD[0],
        5 => ODD[1],
        7 => ODD[2],
        _ => (1, u64::MAX),
    };
    let q = (off >> k).wrapping_mul(inv);
    (off & ((1u64 << k) - 1) == 0 && q <= limit).then_some(q)
}

/// [`exact_quotient`] by division: out of line, for block sizes no general heap class has.
#[cold]
#[inline(never)]
fn exact_quotient_slow(off: u64, size: u64) -> Option<u64> {
    off.is_multiple_of(size).then(|| off / size)
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;
    use crate::size_class::{class_size, NUM_CLASSES};

    #[test]
    fn inverses_invert() {
        for m in [3u64, 5, 7] {
            assert_eq!(m.wrapping_mul(inverse(m)), 1, "{m}");
        }
    }

    /// Every class size, at and around block boundaries near 0, 2^32, 2^40 and the top of the
    /// range, and every offset of the first blocks of the small classes: the same answer as a
    /// division.
    #[test]
    fn matches_division_for_every_class() {
        for c in 0..NUM_CLASSES as u32 {
            let size = class_size(c) as u64;
            let mut offs = std::vec::Vec::new();
            if size <= 4096 {
                offs.extend(0..3 * size + 2);
            }
            for base in [0u64, 1 << 32, (1 << 40) + 5, u64::MAX - 3 * size] {
                let first = base - base % size;
                for j in 0..3 {
                    let at = first + j * size;
                    for d in [0, 1, 2, 16, size / 2, size - 16, size - 1] {
                        offs.push(at.wrapping_add(d));
                    }
                    offs.push(at.wrapping_sub(1));
                }
            }
            for off in offs {
                let want = (off % size == 0).then(|| off / size);
                assert_eq!(exact_quotient(off, size), want, "size {size}, off {off}");
                assert_eq!(class_quotient(off, size), want, "size {size}, off {off}");
            }
        }
    }

    #[test]
    fn other_sizes_divide_out_of_line() {
        for size in [1u64, 9, 24, 100, 4097, 3 << 20] {
            for off in [0u64, size, size + 1, 7 * size, u64::MAX] {
                let want = (off % size == 0).then(|| off / size);
                assert_eq!(exact_quotient(off, size), want, "size {size}, off {off}");
            }
        }
    }
}
