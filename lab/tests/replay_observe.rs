//! `carve replay` reading PyTorch snapshots (`--format torch`), writing them (`--snapshot`), and
//! plotting several resources (`--plot`), on host and simulated memory (no GPU needed).

#[path = "../../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr::NonNull;

use carve::adaptor::{LoggingResourceAdaptor, StatisticsResourceAdaptor, TrackingResourceAdaptor};
use carve::snapshot::Snapshot;
use carve::{HostMemoryResource, MemoryResource, StreamRef};
use carve_lab::replay::cli::{replay_all, ReplayArgs};
use carve_lab::replay::{LargeUpstream, ResourceKind};
use carve_lab::snapshot::ReadSnapshot;
use common::rng::{seeded, RngExt};
use common::SharedBuf;

fn args(log: &Path, kinds: &[ResourceKind]) -> ReplayArgs {
    ReplayArgs {
        log: log.to_owned(),
        format: Default::default(),
        resource: kinds.to_vec(),
        device: 0,
        initial_size: None,
        maximum_size: None,
        block_size: None,
        headroom: None,
        small_limit: None,
        mark_every_free: false,
        large_upstream: LargeUpstream::Pool,
        simulate_capacity: Some(1 << 30),
        passes: 1,
        no_progress: true,
        snapshot: None,
        plot: None,
    }
}

/// Allocates and frees pseudo-randomly through `mr`, leaving `keep` blocks live at the end.
fn workload(mr: &dyn MemoryResource, steps: usize, keep: usize) -> Vec<(NonNull<u8>, usize)> {
    let mut rng = seeded(0x5eed_u64);
    let mut live: Vec<(NonNull<u8>, usize)> = Vec::new();
    let s = [StreamRef::DEFAULT, StreamRef::simulated(3)];
    for _ in 0..steps {
        let x: u64 = rng.random();
        if x % 10 < 6 || live.is_empty() {
            let bytes = 512 * (1 + (x >> 8) as usize % 400);
            live.push((
                mr.allocate(s[(x >> 40) as usize % 2], bytes, 256).unwrap(),
                bytes,
            ));
        } else {
            let (p, bytes) = live.swap_remove((x >> 20) as usize % live.len());
            // SAFETY: from `mr` with these arguments, freed once.
            unsafe { mr.deallocate(s[0], p, bytes, 256) }.unwrap();
        }
    }
    while live.len() > keep {
        let (p, bytes) = live.pop().unwrap();
        // SAFETY: as above.
        unsafe { mr.deallocate(s[0], p, bytes, 256) }.unwrap();
    }
    live
}

/// The same workload as a CSV log and as a PyTorch snapshot (history from the start).
fn both_logs(dir: &Path) -> (PathBuf, PathBuf, usize) {
    let buf = SharedBuf::default();
    let stats = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    let tracked = TrackingResourceAdaptor::new(stats.clone(), false);
    tracked.record_history(1 << 20);
    let logged = LoggingResourceAdaptor::to_writer(tracked.clone(), buf.clone(), false).unwrap();
    let left = workload(&logged, 2000, 0);
    assert!(left.is_empty());
    logged.flush().unwrap();
    let csv = dir.join("log.csv");
    std::fs::write(&csv, buf.bytes()).unwrap();
    let torch = dir.join("snapshot.pickle");
    tracked.snapshot(0).unwrap().write(&torch).unwrap();
    (csv, torch, stats.bytes_counter().peak as usize)
}

#[test]
fn a_pytorch_snapshot_replays_like_the_csv_log() {
    let dir = tempfile::tempdir().unwrap();
    let (csv, torch, peak) = both_logs(dir.path());
    let from_csv = replay_all(&args(&csv, &[ResourceKind::Pool])).unwrap();
    let from_torch = replay_all(&args(&torch, &[ResourceKind::Pool])).unwrap();
    let (a, b) = (&from_csv[0].report, &from_torch[0].report);
    assert!(a.succeeded() && b.succeeded(), "{a}{b}");
    assert_eq!((a.allocations, a.frees), (b.allocations, b.frees));
    assert_eq!(a.peak_bytes, peak);
    assert_eq!(b.peak_bytes, peak);
    assert_eq!(b.threads, 1, "PyTorch records no threads");
    // Forcing the wrong format is an error, not a misreading.
    let mut wrong = args(&torch, &[ResourceKind::Pool]);
    wrong.format = carve_lab::replay::torch::LogFormat::Csv;
    assert!(replay_all(&wrong).is_err());
}

#[test]
fn a_snapshot_with_blocks_before_its_trace_replays() {
    // History starts late: blocks allocated before it are freed in the trace (or still live at
    // the end) without an alloc event; the replay allocates them first.
    let tracked = TrackingResourceAdaptor::new(HostMemoryResource::new(), false);
    let early = workload(&tracked, 300, 20);
    tracked.record_history(1 << 20);
    for (p, bytes) in &early[..10] {
        // SAFETY: from `tracked` with these arguments, freed once.
        unsafe { tracked.deallocate(StreamRef::DEFAULT, *p, *bytes, 256) }.unwrap();
    }
    let late = workload(&tracked, 500, 5);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("late.pickle");
    tracked.snapshot(0).unwrap().write(&path).unwrap();
    let r = &replay_all(&args(&path, &[ResourceKind::Arena])).unwrap()[0].report;
    assert!(r.succeeded(), "{r}");
    assert_eq!(
        r.unfreed,
        10 + 5,
        "early blocks never freed, and the late ones kept"
    );
    for (p, bytes) in early[10..].iter().chain(&late) {
        // SAFETY: as above.
        unsafe { tracked.deallocate(StreamRef::DEFAULT, *p, *bytes, 256) }.unwrap();
    }
}

#[test]
fn several_resources_give_a_plot_and_a_snapshot_each() {
    let dir = tempfile::tempdir().unwrap();
    let (csv, _, _) = both_logs(dir.path());
    let mut a = args(
        &csv,
        &[
            ResourceKind::Pool,
            ResourceKind::Arena,
            ResourceKind::Binning,
        ],
    );
    a.snapshot = Some(dir.path().join("out.pickle"));
    a.plot = Some(dir.path().join("out.svg"));
    let all = replay_all(&a).unwrap();
    assert_eq!(all.len(), 3);
    for (r, kind) in all.iter().zip(["pool", "arena", "binning"]) {
        assert!(r.report.succeeded(), "{}", r.report);
        let path = r.snapshot.as_ref().unwrap();
        assert_eq!(path, &dir.path().join(format!("out.{kind}.pickle")));
        let snap = Snapshot::read(path).unwrap();
        snap.check().unwrap();
        assert!(
            !snap.segments.is_empty(),
            "{kind} keeps its upstream chunks"
        );
        assert!(
            snap.segments.iter().all(|s| s.allocated_size() == 0),
            "all freed at the end"
        );
        let t = r.timeline.as_ref().unwrap();
        let peak_reserved = t.points.iter().filter_map(|p| p.2).max().unwrap();
        let peak_live = t.points.iter().map(|p| p.1).max().unwrap();
        assert!(
            peak_reserved >= peak_live,
            "{kind}: reserved {peak_reserved} < live {peak_live}"
        );
        assert_eq!(t.points.last().unwrap().1, 0, "{kind}: everything freed");
    }
}

fn carve_bin() -> Option<PathBuf> {
    carve::testing::cli_binary(env!("CARGO_BIN_EXE_carve"))
}

#[test]
fn the_cli_writes_a_valid_svg_with_a_series_per_resource() {
    let Some(carve) = carve_bin() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (_, torch, _) = both_logs(dir.path());
    let svg = dir.path().join("plot.svg");
    let snap = dir.path().join("snap.pickle");
    let out = Command::new(&carve)
        .arg("replay")
        .arg(&torch)
        .args([
            "--resource",
            "pool,arena,host",
            "--simulate-capacity",
            "1",
            "--plot",
        ])
        .arg(&svg)
        .arg("--snapshot")
        .arg(&snap)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.matches("replay on ").count(), 3, "{stdout}");
    let text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&text).expect("the SVG is valid XML");
    let labels: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .map(str::trim)
        .collect();
    for kind in ["pool", "arena", "host"] {
        for what in ["live", "reserved"] {
            let label = format!("{kind} {what}");
            assert!(
                labels.contains(&label.as_str()),
                "{label} not in {labels:?}"
            );
        }
        assert!(dir.path().join(format!("snap.{kind}.pickle")).is_file());
    }
    let lines = doc
        .descendants()
        .filter(|n| n.has_tag_name("polyline") && n.attribute("stroke-width") == Some("2"))
        .count();
    assert_eq!(lines, 2 * 6, "six series, each a line and a legend mark");
}
