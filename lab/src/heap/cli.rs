//! `carve heap-ptx` and `carve heap-layout`: what a kernel in another language (Numba, CuPy,
//! plain CUDA) needs to use carve's device heap from a process that carve does not run: carve's
//! PTX to link, and how to format a heap in that process's own device memory and read its
//! statistics back (see [`ForeignHeapPlan`] and `examples/numba_heap.py`).

use std::fmt::Write as _;
use std::path::PathBuf;

use carve::error::Result;
use carve::heap::{ForeignHeapPlan, HeapKind, HeapStats};

/// `carve heap-ptx` options.
#[derive(clap::Args, Debug, Clone)]
pub struct HeapPtxArgs {
    /// Where to write carve's PTX module (it exports carve_slab_alloc, carve_slab_free,
    /// carve_bump_alloc, and their carve_numba_* forms for Numba's calling convention).
    #[arg(long)]
    pub out: PathBuf,
}

/// `carve heap-layout` options.
#[derive(clap::Args, Debug, Clone)]
pub struct HeapLayoutArgs {
    #[command(subcommand)]
    /// Which heap to lay out.
    pub kind: LayoutKind,
    /// Device address of the region (decimal or 0x-hex): prints the handle to write there.
    #[arg(long, global = true, value_parser = parse_address)]
    pub base: Option<u64>,
    /// A file holding the region's first `stats_bytes` bytes: prints the heap's statistics.
    #[arg(long, global = true)]
    pub stats: Option<PathBuf>,
}

/// The heap to lay out.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum LayoutKind {
    /// A slab of fixed-size blocks.
    Slab {
        /// Number of blocks.
        #[arg(long)]
        capacity: u64,
        /// Bytes per block (a multiple of 16).
        #[arg(long)]
        block_size: u64,
    },
    /// A bump arena.
    Bump {
        /// Arena bytes.
        #[arg(long)]
        capacity: u64,
    },
}

fn parse_address(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    }
    .map_err(|e| format!("not an address: {s:?} ({e})"))
}

/// Writes carve's PTX to `--out`.
pub fn run_ptx(args: &HeapPtxArgs) -> Result<()> {
    std::fs::write(&args.out, carve::driver::PTX)?;
    Ok(())
}

/// Prints the layout (and handle, and statistics, when asked) as one JSON object.
pub fn run_layout(args: &HeapLayoutArgs) -> Result<()> {
    println!("{}", layout_json(args)?);
    Ok(())
}

/// The JSON that `carve heap-layout` prints.
pub fn layout_json(args: &HeapLayoutArgs) -> Result<String> {
    let plan = match args.kind {
        LayoutKind::Slab {
            capacity,
            block_size,
        } => ForeignHeapPlan::slab(capacity, block_size)?,
        LayoutKind::Bump { capacity } => ForeignHeapPlan::bump(capacity)?,
    };
    let (kind, block_size) = match plan.kind() {
        HeapKind::Slab { block_size } => ("slab", block_size),
        HeapKind::Bump => ("bump", 0),
        // ForeignHeapPlan makes no general heaps (yet).
        HeapKind::General { .. } => ("general", 0),
    };
    let mut json = format!(
        "{{\"kind\": \"{kind}\", \"block_size\": {block_size}, \"bytes\": {}, \"align\": {}, \
         \"stats_bytes\": {}",
        plan.bytes(),
        plan.align(),
        plan.stats_bytes()
    );
    if let Some(base) = args.base {
        let hex: String = plan
            .handle_bytes_at(base)?
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let _ = write!(json, ", \"base\": {base}, \"handle\": \"{hex}\"");
    }
    if let Some(path) = &args.stats {
        let prefix = std::fs::read(path)?;
        let _ = write!(json, ", \"stats\": {}", stats_json(&plan.stats(&prefix)?));
    }
    json.push('}');
    Ok(json)
}

fn stats_json(s: &HeapStats) -> String {
    format!(
        "{{\"capacity\": {}, \"in_use\": {}, \"high_water\": {}, \"failed_allocs\": {}, \
         \"double_frees\": {}, \"foreign_frees\": {}}}",
        s.capacity, s.in_use, s.high_water, s.failed_allocs, s.double_frees, s.foreign_frees
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve::error::Error;

    fn args(kind: LayoutKind, base: Option<u64>, stats: Option<PathBuf>) -> HeapLayoutArgs {
        HeapLayoutArgs { kind, base, stats }
    }

    #[test]
    fn addresses_parse_in_hex_and_decimal() {
        assert_eq!(parse_address("0x100"), Ok(256));
        assert_eq!(parse_address("4096"), Ok(4096));
        assert!(parse_address("0xzz").is_err());
        assert!(parse_address("").is_err());
    }

    #[test]
    fn layout_json_carries_the_handle_and_the_stats() {
        let slab = || LayoutKind::Slab {
            capacity: 1000,
            block_size: 64,
        };
        let plain = layout_json(&args(slab(), None, None)).unwrap();
        assert!(plain.starts_with("{\"kind\": \"slab\", \"block_size\": 64"));
        assert!(!plain.contains("handle"));

        let plan = ForeignHeapPlan::slab(1000, 64).unwrap();
        let with_base = layout_json(&args(slab(), Some(0x10_0000), None)).unwrap();
        let hex: String = plan
            .handle_bytes_at(0x10_0000)
            .unwrap()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert!(with_base.contains(&format!("\"handle\": \"{hex}\"")));
        assert_eq!(hex.len(), 256);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("prefix");
        std::fs::write(&path, vec![0u8; plan.stats_bytes()]).unwrap();
        let stats = layout_json(&args(slab(), None, Some(path.clone()))).unwrap();
        assert!(stats.contains("\"stats\": {\"capacity\": 1000, \"in_use\": 0,"));
        std::fs::write(&path, [0u8; 4]).unwrap();
        assert!(layout_json(&args(slab(), None, Some(path))).is_err());

        assert!(matches!(
            layout_json(&args(slab(), Some(0x10_0001), None)),
            Err(Error::InvalidArgument(_))
        ));
        let bump = layout_json(&args(LayoutKind::Bump { capacity: 0 }, None, None));
        assert!(matches!(bump, Err(Error::ZeroSize)));
    }
}
