//! `carve replay LOG [--format csv|torch] [--resource KIND[,KIND...]] [sizes] [--passes N]
//! [--simulate-capacity GiB] [--snapshot FILE] [--plot FILE.svg]`.

use std::path::{Path, PathBuf};

use carve::error::{Error, Result};

use super::observe::replay_one;
pub use super::observe::Replayed;
use super::options::{LargeUpstream, ResourceKind, ResourceOptions};
use super::plan::plan;
use super::report::ReplayReport;
use super::target::build_target;
use super::timeline::Timeline;
use super::torch::{read_events, LogFormat};

/// `carve replay` options.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// The allocation log: RMM's CSV (Thread,Time,Action,Pointer,Size,Stream) or a pickled
    /// PyTorch memory snapshot (`torch.cuda.memory._dump_snapshot`).
    pub log: PathBuf,
    /// The log's format (auto: a pickle is a PyTorch snapshot, anything else CSV).
    #[arg(long, value_enum, default_value_t = LogFormat::Auto)]
    pub format: LogFormat,
    /// The resource(s) to replay on; several (`pool,arena,binning`) replay one after another.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "cuda")]
    pub resource: Vec<ResourceKind>,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Initial pool size for suballocators (e.g. 1GiB, 512MiB, 4096).
    #[arg(long, value_parser = parse_size)]
    pub initial_size: Option<usize>,
    /// Maximum pool size for suballocators; most physical memory mapped for virtual and
    /// expandable.
    #[arg(long, value_parser = parse_size)]
    pub maximum_size: Option<usize>,
    /// Block size (fixed), largest bin (binning), chunk size (virtual) or large-page size
    /// (expandable).
    #[arg(long, value_parser = parse_size)]
    pub block_size: Option<usize>,
    /// Expandable: how far above the most bytes ever live (a fraction of them) the pool may
    /// create chunks rather than move free pages; default 0.05.
    #[arg(long)]
    pub headroom: Option<f64>,
    /// Expandable: requests up to this size go to the small range (small pages); default 1MiB.
    #[arg(long, value_parser = parse_size)]
    pub small_limit: Option<usize>,
    /// Virtual and expandable: while several streams allocate, mark every free and hand blocks
    /// to every stream once the device is past them (less memory, slower frees).
    #[arg(long)]
    pub mark_every_free: bool,
    /// Binning: where requests above the largest bin go.
    #[arg(long, value_enum, default_value_t = LargeUpstream::Pool)]
    pub large_upstream: LargeUpstream,
    /// Replay over address-only simulated memory of this many GiB: no GPU needed, answers
    /// "would this log fit on a card this size with this resource?".
    #[arg(long, value_name = "GiB", value_parser = parse_gib)]
    pub simulate_capacity: Option<usize>,
    /// Replay the log this many times over the same resource, as the iterations of a training
    /// loop: the first pass grows the resource, later ones show its steady state. Peak
    /// reserved and `--snapshot` cover every pass; `--plot` samples the first.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub passes: u32,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Write a PyTorch memory snapshot of the replay (open it with pytorch.org/memory_viz or
    /// `python -m torch.cuda._memory_viz trace_plot FILE`). With several resources, the
    /// resource's name goes before the extension. Tracking every block slows the replay.
    #[arg(long, value_name = "FILE")]
    pub snapshot: Option<PathBuf>,
    /// Draw live and reserved bytes over the replay's steps as an SVG chart, one line each per
    /// resource.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

impl ReplayArgs {
    /// The resource options these arguments name, for the first resource.
    pub fn resource_options(&self) -> ResourceOptions {
        self.resource_options_for(self.resource.first().copied().unwrap_or(ResourceKind::Cuda))
    }

    /// The resource options these arguments name, for `kind`.
    pub fn resource_options_for(&self, kind: ResourceKind) -> ResourceOptions {
        ResourceOptions {
            kind,
            device: self.device,
            initial_size: self.initial_size,
            maximum_size: self.maximum_size,
            block_size: self.block_size,
            headroom: self.headroom,
            small_limit: self.small_limit,
            mark_every_free: self.mark_every_free,
            large_upstream: self.large_upstream,
            simulate_capacity: self.simulate_capacity,
        }
    }
}

/// Runs `carve replay`: prints the report, and fails (non-zero exit) when an allocation or free
/// failed.
pub fn run(args: &ReplayArgs) -> Result<()> {
    let all = replay_all(args)?;
    for r in &all {
        print!("{}", r.report);
        if let Some(path) = &r.snapshot {
            println!("  snapshot     {}", path.display());
        }
    }
    if let Some(path) = &args.plot {
        let timelines: Vec<Timeline> = all.iter().filter_map(|r| r.timeline.clone()).collect();
        super::plot::chart(&timelines, &args.log).write_svg(path)?;
        println!("plot written to {}", path.display());
    }
    for r in &all {
        verdict(&r.report)?;
    }
    Ok(())
}

/// `Err` when an allocation or free failed.
fn verdict(report: &ReplayReport) -> Result<()> {
    match &report.first_failure {
        Some(ff) => Err(Error::OutOfMemory {
            bytes: ff.bytes,
            resource: "carve replay",
            detail: format!(
                "{} of {} allocations failed; the first at line {}",
                report.failed_allocations, report.allocations, ff.line
            ),
        }),
        None if !report.succeeded() => Err(Error::InvalidArgument(format!(
            "{} free(s) were refused by the resource",
            report.failed_frees
        ))),
        None => Ok(()),
    }
}

/// Reads, checks and replays the log `args` names on its first resource.
pub fn replay_file(args: &ReplayArgs) -> Result<ReplayReport> {
    let mut first = args.clone();
    first.resource.truncate(1);
    first.plot = None;
    Ok(replay_all(&first)?.remove(0).report)
}

/// Reads and checks the log once, then replays it on each resource `args` names, in turn.
pub fn replay_all(args: &ReplayArgs) -> Result<Vec<Replayed>> {
    let events = read_events(&args.log, args.format).map_err(|e| match e {
        Error::MalformedLog { line, reason } => Error::MalformedLog {
            line,
            reason: format!("{}: {reason}", args.log.display()),
        },
        e => e,
    })?;
    let plan = plan(&events)?;
    let kinds = if args.resource.is_empty() {
        vec![ResourceKind::Cuda]
    } else {
        args.resource.clone()
    };
    let mut out = Vec::with_capacity(kinds.len());
    for &kind in &kinds {
        let target = build_target(&args.resource_options_for(kind), &plan.streams)?;
        let snapshot = args
            .snapshot
            .as_ref()
            .map(|p| snapshot_path(p, kind, kinds.len() > 1));
        out.push(replay_one(
            &plan,
            target,
            kind,
            args.device,
            !args.no_progress,
            args.plot.is_some(),
            snapshot,
            args.passes,
        )?);
    }
    Ok(out)
}

/// `out.pickle` for one resource; `out.pool.pickle` when there are several.
fn snapshot_path(path: &Path, kind: ResourceKind, several: bool) -> PathBuf {
    if !several {
        return path.to_owned();
    }
    let stem = path
        .file_stem()
        .map_or_else(Default::default, |s| s.to_string_lossy().into_owned());
    let name = match path.extension() {
        Some(ext) => format!("{stem}.{kind}.{}", ext.to_string_lossy()),
        None => format!("{stem}.{kind}"),
    };
    path.with_file_name(name)
}

/// Bytes from `4096`, `64KiB`, `1.5GiB`, `2G` (binary) or `2GB` (decimal).
pub fn parse_size(text: &str) -> std::result::Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a size (e.g. 4096, 64KiB, 1.5GiB)"))?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size unit {other:?} in {text:?}")),
    };
    let bytes = number * scale;
    if !bytes.is_finite() || bytes < 1.0 || bytes > isize::MAX as f64 {
        return Err(format!("{text:?} is not a usable size"));
    }
    Ok(bytes as usize)
}

/// Bytes from a number of GiB (`80`, `0.5`).
pub fn parse_gib(text: &str) -> std::result::Result<usize, String> {
    let gib: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a number of GiB"))?;
    let bytes = gib * (1u64 << 30) as f64;
    if !bytes.is_finite() || bytes < 256.0 || bytes > (1u64 << 46) as f64 {
        return Err(format!(
            "{text:?} GiB is not a usable capacity (256 B to 64 TiB)"
        ));
    }
    Ok(bytes as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("abc").is_err());
        assert_eq!(parse_gib("0.5"), Ok(1 << 29));
        assert!(parse_gib("-1").is_err());
        assert!(parse_gib("inf").is_err());
    }
}
