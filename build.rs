//! Compiles `kernels/` to PTX for `nvptx64-nvidia-cuda` and hands it to `src/` as
//! `$OUT_DIR/carve_kernels.ptx`.
//!
//! No CUDA toolkit is involved: rustc's nvptx backend emits PTX text (`--emit=asm`), fat LTO
//! makes that one self-contained module, and `-C linker=true` turns the link step (which would
//! need `llvm-bitcode-linker`, not installable here) into a no-op. `CARVE_KERNELS_PTX=path` skips
//! all of this and embeds a prebuilt file.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

#[path = "kernels/build/registers.rs"]
mod registers;

const TARGET: &str = "nvptx64-nvidia-cuda";
const FIX: &str =
    "rustup toolchain install nightly && rustup component add rust-src --toolchain nightly";

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let dest = out_dir.join("carve_kernels.ptx");
    println!("cargo:rerun-if-env-changed=CARVE_KERNELS_PTX");

    if let Some(prebuilt) = env::var_os("CARVE_KERNELS_PTX") {
        let prebuilt = PathBuf::from(prebuilt);
        println!("cargo:rerun-if-changed={}", prebuilt.display());
        if let Err(e) = fs::copy(&prebuilt, &dest) {
            fail(&format!("CARVE_KERNELS_PTX={}: {e}", prebuilt.display()));
        }
        return;
    }

    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let kernels = root.join("kernels");
    println!("cargo:rerun-if-changed={}", kernels.join("src").display());
    println!(
        "cargo:rerun-if-changed={}",
        kernels.join("Cargo.toml").display()
    );

    let toolchain = pick_toolchain();
    // A target dir of its own: sharing the outer build's would deadlock on its lock.
    let target_dir = out_dir.join("kernels-target");
    let mut cmd = Command::new("rustup");
    cmd.args([
        "run",
        toolchain.name,
        "cargo",
        "rustc",
        "--quiet",
        "--release",
    ])
    .arg("--manifest-path")
    .arg(kernels.join("Cargo.toml"))
    .args([
        "--target",
        TARGET,
        "-Zbuild-std=core",
        "--crate-type=cdylib",
    ])
    .args([
        "--",
        "--emit=asm",
        "-C",
        "target-cpu=sm_70",
        "-C",
        "linker=true",
    ]);
    scrub(&mut cmd);
    cmd.env("CARGO_TARGET_DIR", &target_dir)
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false");
    if toolchain.bootstrap {
        cmd.env("RUSTC_BOOTSTRAP", "1");
    }

    let status = cmd.status().unwrap_or_else(|e| {
        fail(&format!(
            "could not run rustup ({e}); install it, then: {FIX}"
        ))
    });
    if !status.success() {
        fail(&format!(
            "building kernels/ for {TARGET} failed (see above)"
        ));
    }
    let ptx = target_dir.join(TARGET).join("release/deps/carve_kernels.s");
    let text = fs::read_to_string(&ptx)
        .unwrap_or_else(|e| fail(&format!("reading {}: {e}", ptx.display())));
    if !text.contains(".visible .entry") {
        fail(&format!("{} holds no kernel entry point", ptx.display()));
    }
    let text = registers::cap_heap_kernels(&text);
    fs::write(&dest, text).unwrap_or_else(|e| fail(&format!("writing {}: {e}", dest.display())));
}

struct Toolchain {
    name: &'static str,
    bootstrap: bool,
}

/// Nightly with rust-src; failing that, stable with rust-src under `RUSTC_BOOTSTRAP=1`.
fn pick_toolchain() -> Toolchain {
    if has_rust_src("nightly") {
        return Toolchain {
            name: "nightly",
            bootstrap: false,
        };
    }
    if has_rust_src("stable") {
        println!(
            "cargo:warning=carve: nightly with rust-src not found; building kernels with stable \
             and RUSTC_BOOTSTRAP=1. Prefer: {FIX}"
        );
        return Toolchain {
            name: "stable",
            bootstrap: true,
        };
    }
    fail(&format!(
        "carve builds its CUDA kernels with a nightly Rust toolchain and its rust-src component, \
         and this machine lacks them. Fix: {FIX}"
    ))
}

fn has_rust_src(toolchain: &str) -> bool {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", toolchain, "rustc", "--print", "sysroot"]);
    scrub(&mut cmd);
    let Ok(out) = cmd.output() else { return false };
    if !out.status.success() {
        return false;
    }
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Path::new(&sysroot)
        .join("lib/rustlib/src/rust/library/core/Cargo.toml")
        .exists()
}

/// Removes what the outer build sets for itself, so the inner build sees a plain environment.
fn scrub(cmd: &mut Command) {
    for (key, _) in env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let outer_cargo = key.starts_with("CARGO_") && key != "CARGO_HOME";
        let outer_rustc = matches!(
            key,
            "RUSTC"
                | "RUSTC_WRAPPER"
                | "RUSTC_WORKSPACE_WRAPPER"
                | "RUSTDOC"
                | "RUSTFLAGS"
                | "RUSTDOCFLAGS"
                | "RUSTUP_TOOLCHAIN"
                | "RUSTC_BOOTSTRAP"
                | "MAKEFLAGS"
                | "MFLAGS"
        );
        if outer_cargo || outer_rustc {
            cmd.env_remove(key);
        }
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(1);
}
