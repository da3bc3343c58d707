//! The test and benchmark kernels: [`TEST_PTX`], built by `lab/build.rs` from `kernels/` with
//! feature `test-kernels` (or taken from `lab/ptx/`), loaded once per device, and launchers for
//! its smoke kernels. The heap's kernels have theirs in [`HeapKernels`](crate::heap::HeapKernels).

use std::sync::{Arc, Mutex, PoisonError};

use carve::cudarc::driver::{CudaFunction, DriverError, LaunchConfig, PushKernelArg};
use carve::driver::{Device, Kernels, Stream};
use carve::error::DriverCode;
use carve::{Error, Result};

/// The test and benchmark kernels' PTX module; never part of the shipped library.
pub const TEST_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/carve_test.ptx"));

/// [`TEST_PTX`] loaded into one device's context. Cheap to clone.
#[derive(Clone, Debug)]
pub struct TestKernels {
    module: Arc<Kernels>,
}

/// The loaded modules, by device ordinal: each is loaded once per process.
static LOADED: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

/// [`TestKernels::get`] as a method of [`Device`], as the tests call it.
pub trait DeviceTestKernels {
    /// The test kernels on this device, loaded on first use.
    fn test_kernels(&self) -> Result<TestKernels>;
}

impl DeviceTestKernels for Device {
    fn test_kernels(&self) -> Result<TestKernels> {
        TestKernels::get(self)
    }
}

/// A failed launch, as carve reports a failed driver call.
pub(crate) fn launch_error(e: DriverError) -> Error {
    Error::Driver {
        call: "cuLaunchKernel",
        code: DriverCode(e.0),
    }
}

impl TestKernels {
    /// The test kernels on `device`, loaded on first use.
    pub fn get(device: &Device) -> Result<TestKernels> {
        let mut loaded = LOADED.lock().unwrap_or_else(PoisonError::into_inner);
        let ordinal = device.ordinal();
        if let Some((_, module)) = loaded.iter().find(|(o, _)| *o == ordinal) {
            return Ok(TestKernels {
                module: module.clone(),
            });
        }
        let module =
            Arc::new(Kernels::load(device, TEST_PTX).map_err(|e| {
                Error::Unsupported(format!("loading carve's test PTX module: {e}"))
            })?);
        loaded.push((ordinal, module.clone()));
        Ok(TestKernels { module })
    }

    /// A kernel or device function of the module, by its exported name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        self.module.function(name)
    }

    /// Launches the smoke kernel: `out[i] = carve_kernels::smoke::pattern(i)` for `i < n`.
    ///
    /// # Safety
    /// `out` must be device-accessible memory of at least `n` `u32`s, not used concurrently by
    /// other work, and valid until the launch completes on `stream`.
    pub unsafe fn smoke_fill(&self, stream: &Stream, out: u64, n: u32) -> Result<()> {
        let f = self.function("carve_smoke_fill")?;
        let cfg = LaunchConfig::for_num_elems(n.max(1));
        let mut launch = stream.cudarc().launch_builder(&f);
        launch.arg(&out).arg(&n);
        // SAFETY: the signature matches `carve_smoke_fill(*mut u32, u32)`; the caller vouches
        // for the memory.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(launch_error)
    }

    /// Launches the read-modify-write smoke kernel: `data[i] = data[i].wrapping_add(delta)` for
    /// `i < n`.
    ///
    /// # Safety
    /// `data` must be device-accessible memory of at least `n` initialised `u32`s, not used
    /// concurrently by other work, and valid until the launch completes on `stream`.
    pub unsafe fn smoke_add(&self, stream: &Stream, data: u64, n: u32, delta: u32) -> Result<()> {
        let f = self.function("carve_smoke_add")?;
        let cfg = LaunchConfig::for_num_elems(n.max(1));
        let mut launch = stream.cudarc().launch_builder(&f);
        launch.arg(&data).arg(&n).arg(&delta);
        // SAFETY: the signature matches `carve_smoke_add(*mut u32, u32, u32)`; the caller vouches
        // for the memory.
        unsafe { launch.launch(cfg) }
            .map(drop)
            .map_err(launch_error)
    }
}
