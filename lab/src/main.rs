//! The `carve` command line: device info, benchmarks, replay, and the device heap's PTX and
//! layout for other languages.

use std::process::ExitCode;

use carve_lab::{bench, heap, replay};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "carve",
    version,
    about = "CUDA memory resources and in-kernel allocators"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List CUDA devices and their memory (or say that no driver was found).
    Info,
    /// Run benchmarks and print Markdown tables.
    Bench(bench::BenchArgs),
    /// Replay an RMM allocation log (CSV) on a resource and report peak, time and failures.
    Replay(replay::cli::ReplayArgs),
    /// Write carve's PTX (the device heap's functions) to a file, for other languages to link.
    HeapPtx(heap::cli::HeapPtxArgs),
    /// Print how to format a device heap in memory carve does not own (JSON), its handle for a
    /// base address, and its statistics from a copy of the region's prefix.
    HeapLayout(heap::cli::HeapLayoutArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info(),
        Command::Bench(args) => bench::run(&args),
        Command::Replay(args) => replay::cli::run(&args),
        Command::HeapPtx(args) => heap::cli::run_ptx(&args),
        Command::HeapLayout(args) => heap::cli::run_layout(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn info() -> carve::Result<()> {
    let exports: Vec<_> = carve::driver::exported_symbols(carve::driver::PTX).collect();
    println!(
        "carve {}: embedded PTX ({} bytes), exports: {}",
        env!("CARGO_PKG_VERSION"),
        carve::driver::PTX.len(),
        exports.join(", ")
    );
    let count = match carve::Device::count() {
        Ok(n) => n,
        Err(carve::Error::NoDriver(why)) => {
            println!("No CUDA driver found ({why}). carve's host-memory resources still work.");
            return Ok(());
        }
        Err(e) => return Err(e),
    };
    println!(
        "carve {}: {count} CUDA device(s)",
        env!("CARGO_PKG_VERSION")
    );
    for ordinal in 0..count {
        let p = carve::Device::get(ordinal)?.properties()?;
        println!(
            "  [{}] {} (sm_{}{}), {} SMs, {:.1} GiB free of {:.1} GiB",
            p.ordinal,
            p.name,
            p.compute_capability.0,
            p.compute_capability.1,
            p.multiprocessors,
            p.free_memory as f64 / (1u64 << 30) as f64,
            p.total_memory as f64 / (1u64 << 30) as f64
        );
    }
    Ok(())
}
