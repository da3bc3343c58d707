//! Compiles `kernels/` to one PTX text with rustc's nvptx backend.
//!
//! Fat LTO makes the cdylib one self-contained module; `-C linker=true` turns the link step
//! (which would need `llvm-bitcode-linker`, not installable everywhere) into a no-op. The PTX is
//! written where `--emit=asm=PATH` says, because where cargo would put it moved between nightlies.

use std::path::Path;

use crate::toolchain::Toolchain;

const TARGET: &str = "nvptx64-nvidia-cuda";

/// The PTX of `carve-kernels` built with `features`.
pub fn ptx(
    root: &Path,
    out_dir: &Path,
    toolchain: &Toolchain,
    features: &[&str],
) -> Result<String, String> {
    // A target dir of its own: sharing the outer build's would deadlock on its lock.
    let target_dir = out_dir.join("kernels-target");
    let asm = out_dir.join(format!("kernels-{}.s", features.join("+")));
    let mut emit = std::ffi::OsString::from("--emit=asm=");
    emit.push(&asm);
    let mut cmd = toolchain.command("cargo");
    cmd.args(["rustc", "--quiet", "--release", "--manifest-path"])
        .arg(root.join("kernels/Cargo.toml"))
        .args([
            "--target",
            TARGET,
            // `alloc` for kernels that use it through `global_alloc::CarveAlloc` (the test
            // module); a crate that does not name it links none of it.
            "-Zbuild-std=core,alloc",
            "--crate-type=cdylib",
        ]);
    if !features.is_empty() {
        cmd.arg("--features").arg(features.join(","));
    }
    cmd.arg("--")
        .arg(emit)
        .args(["-C", "target-cpu=sm_70", "-C", "linker=true"])
        .env("CARGO_TARGET_DIR", &target_dir)
        .env("CARGO_PROFILE_RELEASE_LTO", "fat")
        .env("CARGO_PROFILE_RELEASE_PANIC", "abort")
        .env("CARGO_PROFILE_RELEASE_CODEGEN_UNITS", "1")
        .env("CARGO_PROFILE_RELEASE_DEBUG", "false");
    let status = cmd
        .status()
        .map_err(|e| format!("could not run rustup ({e})"))?;
    if !status.success() {
        return Err(format!("cargo rustc for {TARGET} failed (see above)"));
    }
    let text = std::fs::read_to_string(&asm).map_err(|e| format!("{}: {e}", asm.display()))?;
    if !text.contains(".target sm_70") {
        return Err(format!("{} is not a PTX module", asm.display()));
    }
    Ok(text)
}
