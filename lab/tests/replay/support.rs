//! What the replay tests share: arguments, hand-written logs and a workload to log.

use std::path::{Path, PathBuf};
use std::ptr::NonNull;

use carve::{MemoryResource, StreamRef};
use carve_lab::replay::cli::ReplayArgs;
use carve_lab::replay::{LargeUpstream, ResourceKind};

use crate::common::rng::{seeded, RngExt};

pub const GIB: usize = 1 << 30;

pub fn args(log: &Path, kind: ResourceKind) -> ReplayArgs {
    ReplayArgs {
        log: log.to_owned(),
        format: Default::default(),
        resource: vec![kind],
        device: 0,
        initial_size: None,
        maximum_size: None,
        block_size: None,
        headroom: None,
        small_limit: None,
        mark_every_free: false,
        large_upstream: LargeUpstream::Pool,
        simulate_capacity: None,
        passes: 1,
        no_progress: true,
        snapshot: None,
        plot: None,
    }
}

pub fn write_log(dir: &Path, name: &str, rows: &[String]) -> PathBuf {
    let path = dir.join(name);
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    for r in rows {
        text.push_str(r);
        text.push('\n');
    }
    std::fs::write(&path, text).unwrap();
    path
}

pub fn row(thread: u64, action: &str, ptr: u64, bytes: usize, stream: &str) -> String {
    format!("{thread},12:00:00.000000,{action},{ptr:#x},{bytes},{stream}")
}

/// A deterministic pseudo-random workload: `steps` steps of allocate (60 %) or free a live block.
pub fn workload(mr: &dyn MemoryResource, seed: u64, steps: usize, streams: &[StreamRef<'_>]) {
    let mut rng = seeded(seed);
    let mut next = || rng.random::<u64>();
    let mut live: Vec<(NonNull<u8>, usize, StreamRef<'_>)> = Vec::new();
    for _ in 0..steps {
        let r = next();
        if r % 10 < 6 || live.is_empty() {
            let bytes = 1 + (r >> 8) as usize % 100_000;
            let s = streams[(r >> 40) as usize % streams.len()];
            live.push((mr.allocate(s, bytes, 256).unwrap(), bytes, s));
        } else {
            let (p, bytes, s) = live.swap_remove((r >> 20) as usize % live.len());
            // SAFETY: from `mr` with these arguments, freed once.
            unsafe { mr.deallocate(s, p, bytes, 256) }.unwrap();
        }
    }
    for (p, bytes, s) in live {
        // SAFETY: as above.
        unsafe { mr.deallocate(s, p, bytes, 256) }.unwrap();
    }
}
