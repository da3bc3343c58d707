//! # The carve user guide
//!
//! How to allocate GPU memory with carve, from Rust and from Python. Each chapter is a Markdown
//! file in `docs/guide/`, readable on GitHub as it is; this crate renders them with rustdoc
//! (`cargo doc -p carve-guide --open`), and `cargo test -p carve-guide` runs every Rust example.
//! Examples that need a GPU say so, and skip without one.
//!
//! 1. [Device buffers](ch01_device_buffers): `DeviceBuffer`, `DeviceVec`, copies to and from the host
//! 2. [Memory resources](ch02_memory_resources): pools, suballocators, adaptors, and composing them
//! 3. [The current resource](ch03_current_resource): one resource per device, `reinitialize`
//! 4. [PyTorch, CuPy, Numba and ONNX Runtime](ch04_python): carve from Python
//! 5. [Managed memory](ch05_managed_memory): prefetch and advice
//! 6. [Pinned and mapped host memory](ch06_pinned_memory)
//! 7. [Allocating inside kernels](ch07_kernel_allocation): from Rust, CUDA C++ and Numba
//! 8. [Replay and snapshots](ch08_replay_and_snapshots)
//! 9. [Multiple GPUs and processes](ch09_multiple_gpus)
//! 10. [Troubleshooting out-of-memory errors](ch10_out_of_memory)
//!
//! The rest of this crate is the small helper the examples use to find a GPU.

use std::error::Error;
use std::io::Write;

use carve::Device;

#[doc = include_str!("../guide/01-device-buffers.md")]
pub mod ch01_device_buffers {}
#[doc = include_str!("../guide/02-memory-resources.md")]
pub mod ch02_memory_resources {}
#[doc = include_str!("../guide/03-current-resource.md")]
pub mod ch03_current_resource {}
#[doc = include_str!("../guide/04-python.md")]
pub mod ch04_python {}
#[doc = include_str!("../guide/05-managed-memory.md")]
pub mod ch05_managed_memory {}
#[doc = include_str!("../guide/06-pinned-memory.md")]
pub mod ch06_pinned_memory {}
#[doc = include_str!("../guide/07-kernel-allocation.md")]
pub mod ch07_kernel_allocation {}
#[doc = include_str!("../guide/08-replay-and-snapshots.md")]
pub mod ch08_replay_and_snapshots {}
#[doc = include_str!("../guide/09-multiple-gpus.md")]
pub mod ch09_multiple_gpus {}
#[doc = include_str!("../guide/10-out-of-memory.md")]
pub mod ch10_out_of_memory {}

/// What every example returns.
pub type ExampleResult = Result<(), Box<dyn Error>>;

thread_local! {
    static EXAMPLE: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Names the example running on this thread, for the skip message.
#[doc(hidden)]
pub fn enter(name: &str) {
    EXAMPLE.with(|e| *e.borrow_mut() = name.to_owned());
}

fn example_name() -> String {
    EXAMPLE.with(|e| match e.borrow().as_str() {
        "" => "(example)".to_owned(),
        name => name.to_owned(),
    })
}

/// Turns what an example's `main` returns into its result.
#[doc(hidden)]
pub fn finish<T: Finish>(value: T) -> ExampleResult {
    value.finish()
}

/// What an example's `main` may return: `()` or a `Result`.
#[doc(hidden)]
pub trait Finish {
    /// The value as a result.
    fn finish(self) -> ExampleResult;
}

impl Finish for () {
    fn finish(self) -> ExampleResult {
        Ok(())
    }
}

impl<E: Into<Box<dyn Error>>> Finish for Result<(), E> {
    fn finish(self) -> ExampleResult {
        self.map_err(Into::into)
    }
}

/// Device 0, or `Ok(None)` after printing `SKIPPED <example>: no GPU (...)` when there is none.
/// `why` says what the example needs the GPU for. With `CARVE_REQUIRE_GPU=1` a missing GPU is
/// an error instead, so that a GPU run cannot pass by skipping.
///
/// Examples start with it, hidden:
/// `# let Some(dev) = carve_guide::gpu("device memory")? else { return Ok(()) };`
pub fn gpu(why: &str) -> Result<Option<Device>, Box<dyn Error>> {
    match Device::get(0) {
        Ok(dev) => Ok(Some(dev)),
        Err(e) if carve::driver::gpu_required() => Err(format!(
            "{}: CARVE_REQUIRE_GPU=1 but no usable GPU ({e}); it needs one for {why}",
            example_name()
        )
        .into()),
        Err(e) => {
            skip(&format!("no GPU ({e}); it needs one for {why}"));
            Ok(None)
        }
    }
}

/// Devices 0 and 1, or `Ok(None)` after printing why the example skips. One GPU is a skip even
/// with `CARVE_REQUIRE_GPU=1` (single-GPU machines run the same tests); with
/// `CARVE_REQUIRE_GPUS=2`, fewer than two devices is an error.
pub fn two_gpus(why: &str) -> Result<Option<(Device, Device)>, Box<dyn Error>> {
    let count = match gpu(why)? {
        Some(_) => Device::count()?,
        None => return Ok(None),
    };
    if count < 2 {
        if std::env::var_os("CARVE_REQUIRE_GPUS").is_some_and(|v| v == "2") {
            return Err(format!(
                "{}: CARVE_REQUIRE_GPUS=2 but {count} GPU(s)",
                example_name()
            )
            .into());
        }
        skip(&format!(
            "needs two GPUs, found {count}; it needs them for {why}"
        ));
        return Ok(None);
    }
    Ok(Some((Device::get(0)?, Device::get(1)?)))
}

/// Serialises the examples that change a device's current resource (tests run in parallel in
/// one process, and the current resource is process-wide). Examples take it in a hidden line.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Prints the skip line on the process's stderr, past the test harness's capture.
fn skip(reason: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED {}: {reason}", example_name());
}
