//! `cargo bench -p carve-lab`: the same workloads as `carve bench`.
//!
//! Under `cargo test --all-targets` this target is run as a test, without `--bench`: it then
//! runs every workload in `--quick` mode, as a smoke test that the benchmarks still work.

use carve_lab::bench;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: bench::BenchArgs,
}

fn main() {
    let argv: Vec<String> = std::env::args().collect();
    let as_bench = argv.iter().any(|a| a == "--bench");
    let args = if as_bench {
        Cli::parse_from(argv.into_iter().filter(|a| a != "--bench")).args
    } else {
        bench::BenchArgs::quick()
    };
    match bench::run(&args) {
        Ok(()) if !as_bench => println!("test result: ok. benchmarks ran in --quick mode"),
        Ok(()) => {}
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
