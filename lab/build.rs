//! Puts `carve_test.ptx`, the kernels only carve's tests and benchmarks load, in `$OUT_DIR`:
//! compiled from `kernels/` with feature `test-kernels`, or taken from the copy committed in
//! `lab/ptx/`. The library's `build.rs` does the same for the shipped `carve.ptx`, with the same
//! code (`build/`) and the same environment variables (`build/ptx.rs`).

#[path = "../build/committed.rs"]
mod committed;
#[path = "../build/compile.rs"]
mod compile;
#[path = "../build/ptx.rs"]
mod ptx;
#[path = "../build/registers.rs"]
mod registers;
#[path = "../build/toolchain.rs"]
mod toolchain;

use std::env;
use std::path::PathBuf;

use ptx::{fail, Module};

fn main() {
    let lab = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = lab.parent().expect("lab/ sits in the workspace root");
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let test = Module {
        file: "carve_test.ptx",
        features: &["test-kernels"],
        committed_dir: "lab/ptx",
        regenerate: "CARVE_UPDATE_PTX=1 cargo build --workspace",
    };
    ptx::run(root, &out_dir, &[test]);
}
