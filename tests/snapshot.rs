//! Memory snapshots in PyTorch's format from the tracking adaptor: well-formed, faithful to the
//! allocations, and loadable by Python's pickle (checked by `tests/snapshot/check_snapshot.py`
//! when python3 is present; the GPU machine renders them with `torch.cuda._memory_viz`, see
//! `tests/gpu/memory_viz.sh`).

use std::path::{Path, PathBuf};
use std::process::Command;

use carve::adaptor::TrackingResourceAdaptor;
use carve::resource::PoolOptions;
use carve::snapshot::{Action, BlockState, Snapshot};
use carve::{HostMemoryResource, MemoryResource, PoolMemoryResource, StreamRef};
use carve_lab::snapshot::ReadSnapshot;

fn checker() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshot/check_snapshot.py");
    script.is_file().then_some(script)
}

/// Runs the Python checker on `snapshot`; `None` (after saying why) when it cannot run here.
fn python_check(snapshot: &Snapshot, args: &[&str]) -> Option<String> {
    let Some(script) = checker() else {
        eprintln!("SKIPPED python check: the checker script is not in this tree");
        return None;
    };
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("snapshot.pickle");
    snapshot.write(&file).unwrap();
    let out = match Command::new("python3")
        .arg(&script)
        .arg(&file)
        .args(args)
        .output()
    {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED python check: python3 not runnable ({e})");
            return None;
        }
    };
    assert!(
        out.status.success(),
        "check_snapshot.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Some(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn s(i: usize) -> StreamRef<'static> {
    StreamRef::simulated(i)
}

#[test]
fn tracker_over_a_plain_resource_gives_one_segment_per_block() {
    let t = TrackingResourceAdaptor::new(HostMemoryResource::new(), true);
    t.record_history(1000);
    let a = t.allocate(s(1), 1000, 256).unwrap();
    let b = t.allocate(s(2), 5000, 256).unwrap();
    // SAFETY: from `t` with these arguments, freed once.
    unsafe { t.deallocate(s(1), a, 1000, 256).unwrap() };
    let snap = t.snapshot(0).unwrap();
    snap.check().unwrap();
    assert_eq!(snap.segments.len(), 1, "only b is live");
    assert_eq!(snap.segments[0].address, b.as_ptr() as u64);
    assert_eq!(
        snap.segments[0].blocks[0].state,
        BlockState::ActiveAllocated
    );
    assert!(
        !snap.segments[0].blocks[0].frames.is_empty(),
        "backtraces were captured"
    );
    let actions: Vec<&str> = snap.device_traces[0]
        .iter()
        .map(|e| e.action.as_str())
        .collect();
    assert_eq!(
        actions,
        [
            "segment_alloc",
            "alloc",
            "segment_alloc",
            "alloc",
            "free_requested",
            "free_completed",
            "segment_free"
        ]
    );
    let round = Snapshot::from_pickle(&snap.to_pickle().unwrap()).unwrap();
    assert_eq!(round, snap);
    if let Some(out) = python_check(&snap, &["--expect-segments", "1", "--expect-events", "7"]) {
        assert!(
            out.starts_with("ok: 1 segments, 5000 bytes reserved"),
            "{out}"
        );
    }
    // SAFETY: as above.
    unsafe { t.deallocate(s(2), b, 5000, 256).unwrap() };
}

#[test]
fn pool_snapshot_shows_chunks_tiled_by_blocks() {
    let upstream = TrackingResourceAdaptor::new(HostMemoryResource::new(), false);
    let pool = PoolMemoryResource::new(upstream.clone(), PoolOptions::new(1 << 20)).unwrap();
    let clients = TrackingResourceAdaptor::new(pool.clone(), false);
    upstream.record_history(100);
    clients.record_history(100);
    let mut live = Vec::new();
    for (i, bytes) in [300usize, 70_000, 4096, 2 << 20].into_iter().enumerate() {
        live.push((clients.allocate(s(i % 2), bytes, 256).unwrap(), bytes));
    }
    let (p, bytes) = live.remove(1);
    // SAFETY: from `clients` with these arguments, freed once.
    unsafe { clients.deallocate(s(1), p, bytes, 256).unwrap() };
    let snap = clients.snapshot_over(0, &upstream).unwrap();
    snap.check().unwrap();
    assert_eq!(
        snap.segments.len(),
        pool.stats().chunks,
        "a segment per chunk"
    );
    let reserved: u64 = snap.segments.iter().map(|g| g.total_size).sum();
    assert_eq!(reserved as usize, pool.stats().pool_size);
    let allocated: u64 = snap.segments.iter().map(|g| g.allocated_size()).sum();
    assert_eq!(allocated, 300 + 4096 + (2 << 20));
    let trace = &snap.device_traces[0];
    let segment_allocs = trace
        .iter()
        .filter(|e| e.action == Action::SegmentAlloc)
        .count();
    assert_eq!(
        segment_allocs, 1,
        "the growth for 2 MiB (the first chunk predates the history)"
    );
    let first_alloc = trace
        .iter()
        .position(|e| e.action == Action::Alloc)
        .unwrap();
    assert_eq!(trace[first_alloc].size, 300);
    if let Some(out) = python_check(&snap, &[]) {
        assert!(out.starts_with("ok: 2 segments"), "{out}");
    }
    for (p, bytes) in live {
        // SAFETY: as above.
        unsafe { clients.deallocate(s(0), p, bytes, 256).unwrap() };
    }
}

#[test]
fn failed_requests_are_oom_events_and_history_is_bounded() {
    let upstream = TrackingResourceAdaptor::new(HostMemoryResource::new(), false);
    let mut opts = PoolOptions::new(1 << 16);
    opts.maximum_size = Some(1 << 16);
    let pool = PoolMemoryResource::new(upstream, opts).unwrap();
    let t = TrackingResourceAdaptor::new(pool, false);
    t.record_history(3);
    assert!(t.allocate(s(0), 1 << 20, 256).is_err());
    for _ in 0..4 {
        let p = t.allocate(s(0), 64, 256).unwrap();
        // SAFETY: from `t` with these arguments, freed once.
        unsafe { t.deallocate(s(0), p, 64, 256).unwrap() };
    }
    let snap = t.snapshot(0).unwrap();
    // 3 recorded events (the last alloc/free pairs); a free becomes requested + completed, and
    // each alloc and free its own segment event, since this is `snapshot`, not `snapshot_over`.
    assert!(snap.device_traces[0]
        .iter()
        .all(|e| e.action != Action::Oom));
    t.record_history(10);
    assert!(t.allocate(s(0), 1 << 20, 256).is_err());
    let snap = t.snapshot(0).unwrap();
    let oom = snap.device_traces[0].last().unwrap();
    assert_eq!((oom.action.clone(), oom.size), (Action::Oom, 1 << 20));
    python_check(&snap, &[]);
    t.record_history(0);
    assert!(t.snapshot(0).unwrap().device_traces[0].is_empty());
}
