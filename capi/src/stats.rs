//! Each resource's statistics as `(name, value)` pairs: dicts in Python, `carve_stat_t`
//! arrays in C. They are the resource's [`carve::MemoryStats::detail`].

use std::ffi::CStr;

use crate::error::FfiResult;
use crate::registry::Entry;

/// A statistic: a static name and a value.
pub type Stat = (&'static CStr, f64);

/// The statistics `entry` keeps (empty for resources that keep none).
pub fn of(entry: &Entry) -> FfiResult<Vec<Stat>> {
    Ok(entry
        .resource
        .memory_stats()?
        .map(|s| s.detail)
        .unwrap_or_default())
}
