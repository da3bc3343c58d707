//! Each resource's statistics as `(name, value)` pairs: dicts in Python, `carve_stat_t`
//! arrays in C.

use std::ffi::CStr;

use crate::error::FfiResult;
use crate::registry::{Entry, Typed};

/// A statistic: a static name and a value.
pub type Stat = (&'static CStr, f64);

/// The statistics `entry` keeps (empty for resources that keep none).
pub fn of(entry: &Entry) -> FfiResult<Vec<Stat>> {
    let n = |v: usize| v as f64;
    Ok(match &entry.typed {
        Typed::Plain | Typed::Logging(_) => Vec::new(),
        Typed::Host(h) => vec![
            (c"allocated_bytes", n(h.allocated_bytes())),
            (c"allocation_count", n(h.allocation_count())),
        ],
        Typed::Managed(m) => vec![
            (c"allocated_bytes", n(m.allocated_bytes())),
            (c"allocation_count", n(m.allocation_count())),
        ],
        Typed::Pinned(p) => vec![
            (c"allocated_bytes", n(p.allocated_bytes())),
            (c"allocation_count", n(p.allocation_count())),
        ],
        Typed::Async(a) => {
            let s = a.stats()?;
            vec![
                (c"allocated_bytes", n(a.allocated_bytes())),
                (c"peak_allocated_bytes", n(a.peak_allocated_bytes())),
                (c"allocation_count", n(a.allocation_count())),
                (c"used", n(s.used)),
                (c"reserved", n(s.reserved)),
                (c"free", n(s.free)),
                (c"used_high", n(s.used_high)),
                (c"reserved_high", n(s.reserved_high)),
            ]
        }
        Typed::Pool(p) => {
            let s = p.stats();
            vec![
                (c"pool_size", n(s.pool_size)),
                (c"bytes_in_use", n(s.bytes_in_use)),
                (c"free_bytes", n(s.free_bytes)),
                (c"largest_free_block", n(s.largest_free_block)),
                (c"fragmentation", s.fragmentation),
                (c"live_blocks", n(s.live_blocks)),
                (c"chunks", n(s.chunks)),
            ]
        }
        Typed::Arena(a) => {
            let s = a.stats();
            vec![
                (c"bytes_in_use", n(s.bytes_in_use)),
                (c"superblocks", n(s.superblocks)),
                (c"pool_size", n(s.global.pool_size)),
                (c"free_bytes", n(s.global.free_bytes)),
            ]
        }
        Typed::FixedSize(f) => {
            let s = f.stats();
            vec![
                (c"block_size", n(s.block_size)),
                (c"slabs", n(s.slabs)),
                (c"total_blocks", n(s.total_blocks)),
                (c"blocks_in_use", n(s.blocks_in_use)),
                (c"upstream_bytes", n(s.upstream_bytes)),
            ]
        }
        Typed::Limiting(l) => vec![
            (c"limit", n(l.limit())),
            (c"allocated_bytes", n(l.allocated_bytes())),
        ],
        Typed::Statistics(s) => {
            let b = s.bytes_counter();
            let c = s.allocations_counter();
            vec![
                (c"current_bytes", b.value as f64),
                (c"peak_bytes", b.peak as f64),
                (c"total_bytes", b.total as f64),
                (c"current_count", c.value as f64),
                (c"peak_count", c.peak as f64),
                (c"total_count", c.total as f64),
            ]
        }
        Typed::Tracking(t) => vec![
            (c"allocated_bytes", n(t.allocated_bytes())),
            (c"allocation_count", n(t.allocation_count())),
        ],
    })
}
