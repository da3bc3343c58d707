//! Replays allocation traces on every resource: ns per operation, the peak reserved (bytes
//! taken from the device) and its ratio to the logical peak. Each replay is a fresh resource
//! that runs the trace `PASSES` times, as a training loop runs its iterations: the first pass
//! pays for the resource's growth; later passes show its steady state (RMM's replay benchmark
//! times only that, reusing one resource across its iterations). Traces: the committed synthetic
//! transformer trace, plus every CSV that `--traces` names (files or directories), e.g. the
//! PyTorch traces `lab/bench/traces/make_torch_traces.py` records. On a machine without a
//! GPU every resource runs over 80 GiB of address-only simulated memory.

use std::path::PathBuf;

use carve::Device;

use super::table::{ns, Table};
use crate::replay::ResourceOptions;
use crate::replay::{build_target, parse_log, plan, read_log, replay_passes, Plan, ResourceKind};

/// Passes of the trace over each fresh resource.
const PASSES: u32 = 4;

const SYNTHETIC: &str = include_str!("../../../tests/data/synthetic_transformer.csv");

/// Each resource, with the large-page size for the expandable pool (`None`: its default,
/// 32 MiB; 2 MiB maps more often and wastes less), and whether it marks every free
/// (`ExpandableOptions::mark_every_free`: less memory across streams, slower frees).
const KINDS: [(ResourceKind, Option<usize>, bool); 9] = [
    (ResourceKind::Cuda, None, false),
    (ResourceKind::Async, None, false),
    (ResourceKind::Pool, None, false),
    (ResourceKind::Arena, None, false),
    (ResourceKind::Binning, None, false),
    (ResourceKind::Virtual, None, false),
    (ResourceKind::Expandable, None, false),
    (ResourceKind::Expandable, Some(2 << 20), false),
    (ResourceKind::Expandable, None, true),
];

/// The synthetic trace, then each of `extra` (a CSV, or a directory whose CSVs are read in name
/// order).
fn traces(extra: &[PathBuf]) -> carve::Result<Vec<(String, Plan)>> {
    let mut out = vec![(
        "synthetic_transformer (tests/data)".to_owned(),
        plan(&parse_log(SYNTHETIC.as_bytes())?)?,
    )];
    let mut files: Vec<PathBuf> = vec![];
    for entry in extra {
        if entry.is_dir() {
            let mut csvs: Vec<PathBuf> = std::fs::read_dir(entry)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "csv"))
                .collect();
            csvs.sort();
            files.extend(csvs);
        } else {
            files.push(entry.clone());
        }
    }
    for f in files {
        let name = f
            .file_name()
            .map_or("trace".into(), |n| n.to_string_lossy().into_owned());
        out.push((name, plan(&read_log(&f)?)?));
    }
    Ok(out)
}

/// A table per trace: the synthetic one, then each of `extra` (a CSV, or a directory of them).
pub fn run(quick: bool, extra: &[PathBuf]) -> carve::Result<Vec<Table>> {
    let reps = if quick { 1 } else { 3 };
    let gpu = Device::get(0).ok();
    let mut tables = vec![];
    for (name, plan) in traces(extra)? {
        let ops = plan.steps.len();
        let mut table = Table::new(
            format!(
                "trace_replay: {name}, {ops} operations, logical peak {:.1} MiB",
                plan.logged_peak as f64 / (1 << 20) as f64
            ),
            &[
                "resource",
                "ns/op, first pass",
                "ns/op, later passes",
                "peak reserved (MiB)",
                "reserved / logical peak",
                "failed allocations",
            ],
        );
        table.note(format!(
            "ns/op: the median over {reps} fresh resource(s) of the first pass, and over their \
             later {} passes each; peak reserved covers all {PASSES} passes of the last one",
            PASSES - 1
        ));
        match &gpu {
            Some(dev) => table.note(format!("device: {}", dev.properties()?.name)),
            None => table.note(
                "no GPU: every resource over 80 GiB of simulated memory (address-only; timings \
                 leave out the driver)",
            ),
        }
        for (kind, pages, marking) in KINDS {
            if gpu.is_none() && kind == ResourceKind::Async {
                continue;
            }
            let mut opts = ResourceOptions::new(kind);
            opts.block_size = pages;
            opts.mark_every_free = marking;
            if gpu.is_none() {
                opts.simulate_capacity = Some(80 << 30);
            }
            let (mut first, mut later) = (vec![], vec![]);
            let mut last = None;
            for _ in 0..reps {
                let target = build_target(&opts, &plan.streams)?;
                let report = replay_passes(&plan, &target, PASSES)?;
                first.push(report.per_op(report.elapsed));
                later.extend(report.later_passes.iter().map(|&d| report.per_op(d)));
                last = Some(report);
            }
            first.sort_by(f64::total_cmp);
            later.sort_by(f64::total_cmp);
            let report = last.expect("at least one repetition");
            let reserved = report.peak_reserved.unwrap_or(0);
            let label = match (pages, marking) {
                (Some(p), _) => format!("{kind} ({} MiB pages)", p >> 20),
                (None, true) => format!("{kind} (marking every free)"),
                (None, false) => kind.to_string(),
            };
            // Chunk and driver-call counts (virtual, expandable): where the time went.
            if let Some(notes) = &report.resource_notes {
                table.note(format!(
                    "{label}, last resource, all {PASSES} passes: {notes}"
                ));
            }
            table.row(vec![
                label,
                ns(first[first.len() / 2]),
                ns(later[later.len() / 2]),
                format!("{:.1}", reserved as f64 / (1 << 20) as f64),
                format!("{:.3}×", reserved as f64 / report.peak_bytes.max(1) as f64),
                report.failed_allocations.to_string(),
            ]);
        }
        tables.push(table);
    }
    Ok(tables)
}
