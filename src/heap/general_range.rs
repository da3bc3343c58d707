//! A growable general heap's memory: one mapped range of address space, a stride per size
//! class, and each class's segments after the first.

use super::mapped::MappedRange;
use super::region::Segment;
use crate::driver::Device;
use crate::resource::CudaBacking;

/// A growable general heap's memory and class chains.
#[derive(Debug)]
pub(super) struct GeneralGrowth {
    pub(super) device: Device,
    pub(super) range: MappedRange<CudaBacking>,
    /// Bytes of address space per class (a power of two).
    pub(super) stride: usize,
    /// Offset of class 0's first segment in the range (one chunk).
    pub(super) classes_off: usize,
    /// Bytes of each class's first segment.
    pub(super) first_len: usize,
    pub(super) classes: Vec<ClassChain>,
}

/// One class's segments after the first.
#[derive(Debug, Default)]
pub(super) struct ClassChain {
    /// Segments after the first, in chain order (`raw_len`: the bytes mapped for each).
    pub(super) extra: Vec<Segment>,
}

impl Drop for GeneralGrowth {
    fn drop(&mut self) {
        // Kernels on any stream may still use the heap; unmapping needs them done, and after a
        // failed wait the range leaks.
        let r = self.device.synchronize();
        self.range.after_wait(r);
    }
}

impl GeneralGrowth {
    /// Offset in the range of byte `at` of class `c`'s stride.
    pub(super) fn class_off(&self, c: usize, at: usize) -> usize {
        self.classes_off + c * self.stride + at
    }

    /// Bytes of class `c`'s stride in use (mapped).
    pub(super) fn class_end(&self, c: usize) -> usize {
        self.first_len
            + self.classes[c]
                .extra
                .iter()
                .map(|s| s.raw_len)
                .sum::<usize>()
    }
}
