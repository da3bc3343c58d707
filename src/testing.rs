//! Support for GPU tests and benches: find a device or say plainly why not.
//!
//! Not part of the stable API.

use std::io::Write;

use crate::driver::{gpu_required, Device};

/// Device 0, or `None` after printing why the caller skips.
///
/// The message goes straight to the process's stderr, past the test harness's capture, so a
/// skipped test always says so. With `CARVE_REQUIRE_GPU=1`, a missing device panics instead:
/// on the GPU machine, a skip would hide a failure.
pub fn gpu_or_skip(test: &str) -> Option<Device> {
    match Device::get(0) {
        Ok(dev) => Some(dev),
        Err(e) if gpu_required() => {
            panic!("{test}: CARVE_REQUIRE_GPU=1 but no usable GPU: {e}")
        }
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "SKIPPED {test}: no GPU ({e})");
            None
        }
    }
}

/// The running test's name (libtest names each test's thread after it).
pub fn test_name() -> String {
    std::thread::current()
        .name()
        .filter(|n| *n != "main")
        .unwrap_or("(unnamed test)")
        .to_owned()
}

/// The `carve` CLI for integration tests: where cargo built it (`built_at`, the caller's
/// `env!("CARGO_BIN_EXE_carve")`), else beside the running test binary, which is where
/// `gpu-stage` puts both on a machine without the build tree. `None` (after saying so) if neither.
pub fn cli_binary(built_at: &str) -> Option<std::path::PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.join("carve")));
    let found = std::iter::once(std::path::PathBuf::from(built_at))
        .chain(beside)
        .find(|p| p.is_file());
    if found.is_none() {
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {}: the carve binary is neither at {built_at} nor beside this test",
            test_name()
        );
    }
    found
}

/// Returns from the enclosing test when there is no GPU (see [`gpu_or_skip`]).
#[macro_export]
macro_rules! require_gpu {
    () => {
        match $crate::testing::gpu_or_skip(&$crate::testing::test_name()) {
            Some(dev) => dev,
            None => return,
        }
    };
    ($name:expr) => {
        match $crate::testing::gpu_or_skip($name) {
            Some(dev) => dev,
            None => return,
        }
    };
}
