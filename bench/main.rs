//! `cargo bench`: the same workloads as `carve bench`.

#[path = "mod.rs"]
mod bench;

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: bench::BenchArgs,
}

fn main() {
    // cargo bench appends `--bench`; it means nothing here.
    let argv = std::env::args().filter(|a| a != "--bench");
    let cli = Cli::parse_from(argv);
    if let Err(e) = bench::run(&cli.args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
