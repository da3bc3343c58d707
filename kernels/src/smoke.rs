//! The smoke kernel's pattern, shared so the host checks exactly what the device wrote.

/// The value thread `index` writes: an odd-multiplier hash, so neighbours differ in many bits.
#[inline]
pub const fn pattern(index: u32) -> u32 {
    index.wrapping_mul(0x9E37_79B9) ^ 0x00C0_FFEE
}

#[cfg(test)]
mod tests {
    #[test]
    fn pattern_is_injective_on_a_prefix() {
        let mut seen = std::collections::HashSet::new();
        let n = if cfg!(miri) { 1_000 } else { 100_000 };
        assert!((0..n).all(|i| seen.insert(super::pattern(i))));
    }
}
