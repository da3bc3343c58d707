//! Puts `carve.ptx`, the shipped device-heap ABI, in `$OUT_DIR`: compiled from `kernels/` here
//! (rustc's nvptx backend; no CUDA toolkit), or taken from the copy committed in
//! `src/driver/ptx/`, which records the toolchain that made it and a hash of the sources. A
//! committed file whose hash no longer matches the sources is refused: carve never embeds a
//! stale PTX. The test and benchmark kernels are the lab's (`lab/build.rs`).
//!
//! The environment variables that choose between the two are in `build/ptx.rs`.

#[path = "build/committed.rs"]
mod committed;
#[path = "build/compile.rs"]
mod compile;
#[path = "build/ptx.rs"]
mod ptx;
#[path = "build/registers.rs"]
mod registers;
#[path = "build/toolchain.rs"]
mod toolchain;

use std::env;
use std::path::PathBuf;

use ptx::{fail, Module};

fn main() {
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let shipped = Module {
        file: "carve.ptx",
        features: &[],
        committed_dir: "src/driver/ptx",
        regenerate: "CARVE_UPDATE_PTX=1 cargo build --workspace",
    };
    ptx::run(&root, &out_dir, &[shipped]);
}
