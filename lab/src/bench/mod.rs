//! carve's benchmarks: one file per workload, shared by `carve bench` and `cargo bench -p
//! carve-lab` (`lab/benches/carve_bench.rs`). Each workload prints a Markdown table, ready for
//! BENCHMARKS.md. Timings are ratios against peers measured in the same run.

pub mod adaptor_overhead;
pub mod alloc_free;
pub mod device_alloc;
mod driver_pool;
pub mod plot;
pub mod random_allocations;
pub mod table;
pub mod trace_replay;
pub mod virtual_growth;

use std::path::PathBuf;

use clap::{Args, ValueEnum};

/// Device 0, or `None` with a note in `table` saying why nothing was measured.
fn device_or_note(table: &mut table::Table) -> Option<carve::Device> {
    match carve::Device::get(0) {
        Ok(d) => Some(d),
        Err(e) => {
            table.note(format!("no GPU ({e}): nothing measured"));
            None
        }
    }
}

/// `carve bench` options.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Workloads to run (default: all that the machine can run).
    #[arg(value_enum)]
    pub workloads: Vec<Workload>,
    /// Fewer iterations, for a quick look (and for CI).
    #[arg(long)]
    pub quick: bool,
    /// Also draw each table as an SVG chart in this directory.
    #[arg(long, value_name = "DIR")]
    pub plot: Option<PathBuf>,
    /// trace-replay: more allocation logs to replay besides the synthetic trace, comma-separated
    /// (RMM CSV files, or directories whose CSVs are all read).
    #[arg(long, value_delimiter = ',', value_name = "CSV|DIR")]
    pub traces: Vec<PathBuf>,
    #[command(flatten)]
    #[allow(missing_docs)]
    pub device_alloc: device_alloc::DeviceAllocArgs,
}

impl BenchArgs {
    /// Every workload in `--quick` mode, with no other option.
    pub fn quick() -> Self {
        BenchArgs {
            workloads: Vec::new(),
            quick: true,
            plot: None,
            traces: Vec::new(),
            device_alloc: device_alloc::DeviceAllocArgs::default(),
        }
    }
}

/// The benchmark workloads.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// Allocate and free one size in a loop, through each plain resource.
    AllocFree,
    /// What each adaptor adds per allocate + free.
    AdaptorOverhead,
    /// RMM's random_allocations: pool, binning, fixed-size, arena vs cuMemAlloc and the driver pool.
    RandomAllocations,
    /// In-kernel allocation: carve's slab and bump against CUDA malloc and atomicAdd.
    DeviceAlloc,
    /// Allocation traces replayed on every resource: ns/op, peak reserved and its ratio.
    TraceReplay,
    /// The growth cost of the virtual-memory resource and the expandable pool vs cuMemAlloc.
    VirtualGrowth,
}

/// Runs the chosen workloads, printing each table as it completes.
pub fn run(args: &BenchArgs) -> carve::Result<()> {
    let all = [
        Workload::AllocFree,
        Workload::AdaptorOverhead,
        Workload::RandomAllocations,
        Workload::DeviceAlloc,
        Workload::TraceReplay,
        Workload::VirtualGrowth,
    ];
    let chosen = if args.workloads.is_empty() {
        &all[..]
    } else {
        &args.workloads[..]
    };
    let mut drawn = 0;
    for w in chosen {
        let tables = match w {
            Workload::AllocFree => vec![alloc_free::run(args.quick)?],
            Workload::AdaptorOverhead => vec![adaptor_overhead::run(args.quick)?],
            Workload::RandomAllocations => random_allocations::run(args.quick)?,
            Workload::DeviceAlloc => device_alloc::run(args.quick, &args.device_alloc)?,
            Workload::TraceReplay => trace_replay::run(args.quick, &args.traces)?,
            Workload::VirtualGrowth => vec![
                virtual_growth::run(args.quick)?,
                virtual_growth::calls(args.quick)?,
            ],
        };
        for t in &tables {
            t.print();
            if let Some(dir) = &args.plot {
                let path = plot::write(t, drawn, dir)?;
                println!("(chart: {})\n", path.display());
                drawn += 1;
            }
        }
    }
    Ok(())
}
