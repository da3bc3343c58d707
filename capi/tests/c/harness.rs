//! Compiles a C test program in `capi/tests/c/` against `include/carve.h` and
//! `libcarve_capi.so`, runs it, and checks that it passed.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds and runs `capi/tests/c/<file>`; skips (with a note) without a C compiler or the
/// shared library.
pub fn run_c(file: &str) {
    let Some(cc) = which("cc") else {
        eprintln!("SKIPPED: no C compiler (cc) on PATH");
        return;
    };
    // `cargo test` builds the cdylib next to this test (target/<profile>/deps/) and uplifts it
    // to target/<profile>/ only on `cargo build`: take the one built with this test.
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    let Some(lib_dir) = [deps, deps.parent().unwrap()]
        .into_iter()
        .find(|d| d.join("libcarve_capi.so").exists())
    else {
        eprintln!("SKIPPED: libcarve_capi.so was not built");
        return;
    };
    let lib = lib_dir.join("libcarve_capi.so");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let stem = file.trim_end_matches(".c");
    let out = std::env::temp_dir().join(format!("carve-c-{stem}-{}", std::process::id()));
    let status = Command::new(cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&out)
        .arg(root.join("capi/tests/c").join(file))
        .arg("-I")
        .arg(root.join("include"))
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .status()
        .unwrap();
    assert!(status.success(), "{file} failed to compile");
    let run = Command::new(&out).output().unwrap();
    std::fs::remove_file(&out).ok();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{file}: {}\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("all C checks passed"), "{stdout}");
}

fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
