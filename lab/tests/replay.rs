//! `carve replay` on host and simulated memory (no GPU needed): logs replayed (`logs`), and the
//! committed traces' peaks on every resource (`traces`).

#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "replay/support.rs"]
mod support;
#[path = "replay/traces.rs"]
mod traces;

use std::process::Command;
use std::sync::Arc;

use carve::adaptor::{LoggingResourceAdaptor, StatisticsResourceAdaptor};
use carve::{Error, HostMemoryResource, StreamRef};
use carve_lab::replay::cli::replay_file;
use carve_lab::replay::{
    build_target, parse_log, plan, replay, ResourceKind, ResourceOptions, Target,
};
use common::{ScriptedUpstream, SharedBuf};
use support::{args, row, workload, write_log, GIB};

#[test]
fn logging_then_replay_reproduces_the_peak_single_thread() {
    let buf = SharedBuf::default();
    let stats = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    let logged = LoggingResourceAdaptor::to_writer(stats.clone(), buf.clone(), false).unwrap();
    workload(
        &logged,
        7,
        3000,
        &[StreamRef::DEFAULT, StreamRef::simulated(5)],
    );
    logged.flush().unwrap();
    let original_peak = stats.bytes_counter().peak as usize;

    let text = buf.bytes();
    let plan = plan(&parse_log(&text[..]).unwrap()).unwrap();
    assert_eq!(plan.logged_peak, original_peak);
    assert_eq!(plan.streams.len(), 2);
    let target = build_target(&ResourceOptions::new(ResourceKind::Host), &plan.streams).unwrap();
    let report = replay(&plan, &target, false).unwrap();
    assert!(report.succeeded(), "{report}");
    assert_eq!(report.peak_bytes, original_peak);
    assert_eq!(report.allocations + report.frees, plan.steps.len());
    assert_eq!(
        report.allocations,
        stats.allocations_counter().total as usize
    );
    assert_eq!((report.threads, report.streams, report.unfreed), (1, 2, 0));
}

#[test]
fn logging_then_replay_from_four_threads() {
    let buf = SharedBuf::default();
    let stats = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    let logged = LoggingResourceAdaptor::to_writer(stats.clone(), buf.clone(), false).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let logged = logged.clone();
            s.spawn(move || {
                let streams = [StreamRef::simulated(t as usize), StreamRef::DEFAULT];
                workload(&logged, 100 + t, 1500, &streams);
            });
        }
    });
    logged.flush().unwrap();
    let text = buf.bytes();
    let plan = plan(&parse_log(&text[..]).unwrap()).unwrap();
    assert_eq!(plan.threads.len(), 4);
    let target = build_target(&ResourceOptions::new(ResourceKind::Host), &plan.streams).unwrap();
    let report = replay(&plan, &target, false).unwrap();
    assert!(report.succeeded(), "{report}");
    // The replay runs in log order, so it reproduces the log's peak exactly; a line is written
    // after its allocation and before its free, so that peak never exceeds the real one.
    assert_eq!(report.peak_bytes, plan.logged_peak);
    assert!(report.peak_bytes <= stats.bytes_counter().peak as usize);
    assert_eq!(
        report.allocations,
        stats.allocations_counter().total as usize
    );
    assert_eq!(report.threads, 4);
    assert_eq!(report.streams, 5);
}

#[test]
fn replay_follows_the_global_order_with_one_os_thread_per_logged_thread() {
    // Three logged threads, interleaved; sizes number the allocations in log order.
    let mut rows = Vec::new();
    for i in 0..300u64 {
        let thread = [11, 22, 33][(i * 7 % 3) as usize];
        let stream = ["0", "0xa0", "0xb0"][(i % 3) as usize];
        rows.push(row(
            thread,
            "allocate",
            0x1000 + i * 0x100,
            i as usize + 1,
            stream,
        ));
    }
    let text = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n{}\n",
        rows.join("\n")
    );
    let plan = plan(&parse_log(text.as_bytes()).unwrap()).unwrap();
    let rec = Arc::new(ScriptedUpstream::new());
    let streams = vec![
        StreamRef::DEFAULT,
        StreamRef::simulated(1),
        StreamRef::simulated(2),
    ];
    let target = Target::new(rec.clone(), "recorder", streams.clone());
    let report = replay(&plan, &target, false).unwrap();
    assert!(report.succeeded(), "{report}");
    assert_eq!(report.unfreed, 300);
    assert_eq!(
        rec.host.allocation_count(),
        0,
        "unfreed blocks are freed at the end"
    );
    let seen = rec.calls.lock().unwrap();
    let sizes: Vec<usize> = seen.iter().map(|r| r.bytes).collect();
    assert_eq!(sizes, (1..=300).collect::<Vec<_>>());
    for (i, r) in seen.iter().enumerate() {
        assert_eq!(r.stream, streams[i % 3].id());
    }
    // Each logged thread ran on one OS thread of its own.
    let mut by_logged: std::collections::HashMap<u64, std::collections::HashSet<_>> =
        Default::default();
    for (i, r) in seen.iter().enumerate() {
        by_logged
            .entry([11, 22, 33][i * 7 % 3])
            .or_default()
            .insert(r.thread);
    }
    assert!(by_logged.values().all(|set| set.len() == 1));
    let os: std::collections::HashSet<_> = by_logged.values().flatten().collect();
    assert_eq!(os.len(), 3);
}

#[test]
fn simulated_capacity_answers_whether_a_log_fits() {
    let dir = tempfile::tempdir().unwrap();
    // Four 1 GiB blocks; free the first and third; then ask for 2 GiB.
    let g = GIB as u64;
    let log = write_log(
        dir.path(),
        "frag.csv",
        &[
            row(1, "allocate", g, GIB, "0"),
            row(1, "allocate", 2 * g, GIB, "0"),
            row(1, "allocate", 3 * g, GIB, "0"),
            row(1, "allocate", 4 * g, GIB, "0"),
            row(1, "free", g, GIB, "0"),
            row(1, "free", 3 * g, GIB, "0"),
            row(1, "allocate", 5 * g, 2 * GIB, "0"),
        ],
    );
    let mut a = args(&log, ResourceKind::Cuda);
    a.simulate_capacity = Some(4 * GIB);
    let report = replay_file(&a).unwrap();
    assert!(!report.succeeded());
    assert_eq!(report.failed_allocations, 1);
    let ff = report.first_failure.clone().unwrap();
    assert_eq!((ff.line, ff.bytes, ff.in_use), (8, 2 * GIB, 2 * GIB));
    assert!((ff.fragmentation.unwrap() - 0.5).abs() < 1e-9, "{ff:?}");
    assert_eq!(report.peak_bytes, 4 * GIB);
    let text = report.to_string();
    assert!(text.contains("first failure: line 8"), "{text}");
    assert!(text.contains("fragmentation 50.0 %"), "{text}");

    // 5 GiB would still fail (three separate 1 GiB holes); 6 GiB leaves a 2 GiB tail.
    a.simulate_capacity = Some(5 * GIB);
    assert_eq!(replay_file(&a).unwrap().failed_allocations, 1);
    a.simulate_capacity = Some(6 * GIB);
    let report = replay_file(&a).unwrap();
    assert!(report.succeeded(), "{report}");
    assert_eq!(report.peak_bytes, 4 * GIB);
}

#[test]
fn malformed_logs_give_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "columns.csv",
            vec![
                row(1, "allocate", 0x100, 8, "0"),
                "1,t,allocate,0x200".to_owned(),
            ],
            3,
            "expected 6 columns, found 4",
        ),
        (
            "number.csv",
            vec![
                row(1, "allocate", 0x100, 8, "0"),
                "1,t,allocate,0x200,eight,0".to_owned(),
            ],
            3,
            "Size \"eight\"",
        ),
        (
            "unknown.csv",
            vec![
                row(1, "allocate", 0x100, 8, "0"),
                row(1, "allocate", 0x200, 8, "0"),
                row(2, "free", 0x300, 8, "0"),
            ],
            4,
            "free of unknown pointer 0x300",
        ),
    ];
    for (name, rows, line, needle) in cases {
        let path = write_log(dir.path(), name, &rows);
        match replay_file(&args(&path, ResourceKind::Host)) {
            Err(Error::MalformedLog { line: l, reason }) => {
                assert_eq!(l, line, "{name}: {reason}");
                assert!(reason.contains(needle), "{name}: {reason}");
            }
            other => panic!("{name}: expected MalformedLog, got {other:?}"),
        }
    }
    let missing = args(&dir.path().join("absent.csv"), ResourceKind::Host);
    assert!(matches!(replay_file(&missing), Err(Error::Io(_))));
}

#[test]
fn suballocators_replay_over_simulated_memory() {
    let dir = tempfile::tempdir().unwrap();
    let g = GIB as u64;
    let log = write_log(
        dir.path(),
        "three.csv",
        &[
            row(1, "allocate", g, GIB, "0"),
            row(1, "allocate", 2 * g, GIB, "0"),
            row(1, "allocate", 3 * g, GIB, "0"),
            row(1, "free", 2 * g, GIB, "0"),
            row(1, "allocate", 4 * g, GIB / 2, "0"),
        ],
    );
    for kind in [
        ResourceKind::Pool,
        ResourceKind::Arena,
        ResourceKind::Binning,
    ] {
        let mut a = args(&log, kind);
        a.simulate_capacity = Some(2 * GIB);
        let report = replay_file(&a).unwrap();
        assert_eq!(report.failed_allocations, 1, "{kind}: {report}");
        assert_eq!(
            report.first_failure.as_ref().unwrap().line,
            4,
            "{kind}: {report}"
        );

        a.simulate_capacity = Some(8 * GIB);
        let report = replay_file(&a).unwrap();
        assert!(report.succeeded(), "{kind}: {report}");
        assert_eq!(report.peak_bytes, 3 * GIB, "{kind}");
        // What the driver was asked for: three 1 GiB requests, each too large for the
        // pool's free memory; the half GiB reuses the freed one. One stream: no synchronisation.
        let notes = report.resource_notes.as_deref().unwrap_or_default();
        assert!(
            notes.starts_with("upstream: 3 allocation(s) of 3.00 GiB in all, 0 freed so far"),
            "{kind}: {notes}"
        );
        assert!(
            notes.contains(" 0 device and 0 stream synchronisation(s)"),
            "{kind}: {notes}"
        );
    }
    let mut a = args(&log, ResourceKind::Fixed);
    a.block_size = Some(GIB);
    a.simulate_capacity = Some(64 * GIB);
    let report = replay_file(&a).unwrap();
    assert!(report.succeeded(), "fixed: {report}");
    assert_eq!(report.peak_bytes, 3 * GIB);
    // A fixed-size resource refuses requests above its block size, and the report says so.
    a.block_size = Some(GIB / 4);
    assert_eq!(replay_file(&a).unwrap().failed_allocations, 4);
}

#[test]
fn cli_exit_status_reflects_failures() {
    let dir = tempfile::tempdir().unwrap();
    let log = write_log(
        dir.path(),
        "big.csv",
        &[
            row(1, "allocate", 0x1000, 3 * GIB, "0"),
            row(2, "allocate", 0x2000, 2 * GIB, "0x7f00"),
            row(1, "free", 0x1000, 3 * GIB, "0"),
            row(2, "free", 0x2000, 2 * GIB, "0x7f00"),
        ],
    );
    let Some(carve) = carve::testing::cli_binary(env!("CARGO_BIN_EXE_carve")) else {
        return;
    };
    let run = |gib: &str| {
        Command::new(&carve)
            .args(["replay", log.to_str().unwrap(), "--simulate-capacity", gib])
            .output()
            .unwrap()
    };
    let fits = run("8");
    let out = String::from_utf8_lossy(&fits.stdout);
    assert!(
        fits.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&fits.stderr)
    );
    assert!(out.contains("failed allocations 0"), "{out}");
    assert!(out.contains("2 thread(s), 2 stream(s)"), "{out}");

    let short = run("4");
    let out = String::from_utf8_lossy(&short.stdout);
    let err = String::from_utf8_lossy(&short.stderr);
    assert!(!short.status.success());
    assert!(
        out.contains("first failure: line 3, 2147483648 bytes"),
        "{out}"
    );
    assert!(err.contains("1 of 2 allocations failed"), "{err}");

    let bad = Command::new(&carve)
        .args(["replay", "/no/such/log.csv", "--resource", "host"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
}

/// The case that defeats every allocator with fixed addresses: free memory in two separate
/// 1 GiB holes, then a 2 GiB request. The expandable pool moves the free pages' memory and
/// serves it within the same 4 GiB; the report says what each resource reserved.
#[test]
fn expandable_serves_a_request_larger_than_any_hole() {
    let dir = tempfile::tempdir().unwrap();
    let g = GIB as u64;
    let log = write_log(
        dir.path(),
        "holes.csv",
        &[
            row(1, "allocate", g, GIB, "0"),
            row(1, "allocate", 2 * g, GIB, "0"),
            row(1, "allocate", 3 * g, GIB, "0"),
            row(1, "allocate", 4 * g, GIB, "0"),
            row(1, "free", g, GIB, "0"),
            row(1, "free", 3 * g, GIB, "0"),
            row(1, "allocate", 5 * g, 2 * GIB, "0"),
        ],
    );
    let mut a = args(&log, ResourceKind::Expandable);
    a.simulate_capacity = Some(4 * GIB);
    let report = replay_file(&a).unwrap();
    assert!(report.succeeded(), "{report}");
    assert_eq!(report.peak_reserved, Some(4 * GIB));
    let text = report.to_string();
    assert!(
        text.contains("peak reserved 4294967296 bytes (4096.0 MiB), 1.00× the logical peak"),
        "{text}"
    );
    assert!(
        text.contains("large range (32 MiB) 128 created, 64 moved"),
        "{text}"
    );

    // The virtual resource (whole chunks per block) does the same.
    a.resource = vec![ResourceKind::Virtual];
    assert!(replay_file(&a).unwrap().succeeded());

    // A pool over the same memory cannot: the first failure names the largest hole.
    a.resource = vec![ResourceKind::Pool];
    let report = replay_file(&a).unwrap();
    assert_eq!(report.failed_allocations, 1, "{report}");
    let ff = report.first_failure.unwrap();
    assert_eq!(
        ff.largest_free,
        Some(0),
        "the device has no free range left"
    );
    assert_eq!(report.peak_reserved, Some(4 * GIB));

    // Too little memory is still a failure (the fourth block), with the largest request that
    // could be mapped; the 2 GiB request then fits in the two freed blocks' memory.
    a.resource = vec![ResourceKind::Expandable];
    a.simulate_capacity = Some(3 * GIB);
    let report = replay_file(&a).unwrap();
    assert_eq!(report.failed_allocations, 1, "{report}");
    let ff = report.first_failure.clone().unwrap();
    assert_eq!((ff.line, ff.largest_free), (5, Some(0)));
    assert!(
        report.to_string().contains("largest free hole 0 bytes"),
        "{report}"
    );
}
