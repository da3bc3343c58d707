//! Support for GPU tests and benches: find a device or say plainly why not.
//!
//! Not part of the stable API.

mod gate;

pub use gate::{Gate, GATE_LIMIT};

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

/// Devices 0 and 1, or `None` after printing why the caller skips. One GPU is a skip even with
/// `CARVE_REQUIRE_GPU=1` (the single-GPU machine runs the same binaries); with
/// `CARVE_REQUIRE_GPUS=2`, fewer than two devices panics instead.
pub fn two_gpus_or_skip(test: &str) -> Option<(Device, Device)> {
    let required = std::env::var_os("CARVE_REQUIRE_GPUS").is_some_and(|v| v == "2");
    let count = Device::count().unwrap_or(0);
    if count < 2 {
        if required {
            panic!("{test}: CARVE_REQUIRE_GPUS=2 but {count} GPU(s) found");
        }
        let _ = writeln!(
            std::io::stderr(),
            "SKIPPED {test}: needs two GPUs, found {count}"
        );
        return None;
    }
    match (Device::get(0), Device::get(1)) {
        (Ok(a), Ok(b)) => Some((a, b)),
        (Err(e), _) | (_, Err(e)) => panic!("{test}: {count} GPUs reported, but: {e}"),
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

/// Returns from the enclosing test unless there are two GPUs (see [`two_gpus_or_skip`]).
#[macro_export]
macro_rules! require_two_gpus {
    () => {
        match $crate::testing::two_gpus_or_skip(&$crate::testing::test_name()) {
            Some(devs) => devs,
            None => return,
        }
    };
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
