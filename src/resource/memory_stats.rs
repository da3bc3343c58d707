//! [`MemoryStats`]: what any resource reports through [`MemoryResource::memory_stats`], so
//! that code holding only a `dyn MemoryResource` (the C ABI, Python, the current resource)
//! reads the same numbers as code holding the concrete type.
//!
//! [`MemoryResource::memory_stats`]: super::MemoryResource::memory_stats

use std::ffi::CStr;

/// A resource's counters: the ones every allocator user expects, plus each resource's own.
///
/// The common fields follow the names users know: `bytes_in_use` is RMM's current bytes,
/// CuPy's `used_bytes()` and PyTorch's `allocated_bytes`; `bytes_reserved` is CuPy's
/// `total_bytes()` and PyTorch's `reserved_bytes`. A field the resource does not keep is `None`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemoryStats {
    /// Bytes handed out and not yet freed.
    pub bytes_in_use: usize,
    /// Bytes held from the upstream or the driver, in use or free.
    pub bytes_reserved: Option<usize>,
    /// The highest `bytes_in_use` seen.
    pub peak_bytes: Option<usize>,
    /// Blocks handed out and not yet freed.
    pub live_blocks: Option<usize>,
    /// Every counter the resource keeps, by name, in a fixed order: the dict Python's
    /// `Resource.stats()` returns and the array `carve_resource_stats` writes. Names are C
    /// strings so the C ABI hands them out as they are.
    pub detail: Vec<(&'static CStr, f64)>,
}

impl MemoryStats {
    /// Bytes and blocks in use, for resources that count nothing else; `detail` names them
    /// `allocated_bytes` and `allocation_count`.
    pub fn in_use(bytes: usize, blocks: usize) -> Self {
        MemoryStats {
            bytes_in_use: bytes,
            live_blocks: Some(blocks),
            detail: vec![
                (c"allocated_bytes", bytes as f64),
                (c"allocation_count", blocks as f64),
            ],
            ..MemoryStats::default()
        }
    }

    /// The detail counter called `name`.
    pub fn value(&self, name: &str) -> Option<f64> {
        self.detail
            .iter()
            .find(|(n, _)| n.to_bytes() == name.as_bytes())
            .map(|&(_, v)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_use_fills_the_common_fields_and_the_detail() {
        let s = MemoryStats::in_use(512, 2);
        assert_eq!(s.bytes_in_use, 512);
        assert_eq!(s.live_blocks, Some(2));
        assert_eq!(s.bytes_reserved, None);
        assert_eq!(s.value("allocated_bytes"), Some(512.0));
        assert_eq!(s.value("allocation_count"), Some(2.0));
        assert_eq!(s.value("missing"), None);
    }
}
