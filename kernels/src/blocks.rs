//! Per-allocation patterns for the device-side overlap check: block `b` of a batch gets words
//! that no other block of the batch has, so if two live allocations overlapped, one block's
//! check would find the other's words.

/// Word `i` of block `b`.
#[inline]
pub const fn word(block: u32, i: u32) -> u32 {
    (block.wrapping_add(1)).wrapping_mul(0x9E37_79B9) ^ i.wrapping_mul(0x85EB_CA6B).rotate_left(13)
}

#[cfg(test)]
mod tests {
    #[test]
    fn blocks_differ_at_every_word() {
        for i in 0..1000 {
            for b in 1..50 {
                assert_ne!(super::word(0, i), super::word(b, i), "word {i}, block {b}");
            }
        }
    }
}
