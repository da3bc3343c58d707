//! One call to set up every chosen device's current resource, as `rmm.reinitialize` does.
//!
//! [`build`] maps the options to a resource: `pool` over device memory is a driver pool
//! ([`AsyncMemoryResource`], shareable with PyTorch and CuPy through its handle); `pool` over
//! managed memory is carve's [`PoolMemoryResource`] over [`ManagedMemoryResource`], since driver
//! pools hold device memory only.

use std::collections::HashSet;
use std::sync::Arc;

use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::{
    AsyncMemoryResource, AsyncPoolOptions, CudaMemoryResource, ManagedMemoryResource,
    PoolMemoryResource, PoolOptions, SharedResource,
};

/// What [`reinitialize`] builds on each device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReinitializeOptions {
    /// Put a pool in front of the device memory.
    pub pool: bool,
    /// Allocate managed memory instead of device memory.
    pub managed: bool,
    /// Bytes the pool reserves at once (pool only).
    pub initial_size: Option<usize>,
    /// Hard limit on the pool's bytes in use (pool only).
    pub maximum_size: Option<usize>,
    /// Device ordinals to set up, each once.
    pub devices: Vec<usize>,
}

impl Default for ReinitializeOptions {
    /// Plain device memory on device 0, as `rmm.reinitialize()` with no arguments.
    fn default() -> Self {
        ReinitializeOptions {
            pool: false,
            managed: false,
            initial_size: None,
            maximum_size: None,
            devices: vec![0],
        }
    }
}

impl ReinitializeOptions {
    /// Refuses contradictory options ([`Error::InvalidArgument`]); needs no device.
    pub fn validate(&self) -> Result<()> {
        if self.devices.is_empty() {
            return Err(Error::InvalidArgument("no devices to reinitialize".into()));
        }
        let mut seen = HashSet::new();
        if let Some(d) = self.devices.iter().find(|&&d| !seen.insert(d)) {
            return Err(Error::InvalidArgument(format!(
                "device {d} is listed twice"
            )));
        }
        if !self.pool && (self.initial_size.is_some() || self.maximum_size.is_some()) {
            return Err(Error::InvalidArgument(
                "initial and maximum sizes apply to a pool: set `pool`".into(),
            ));
        }
        self.pool_options().validate()
    }

    fn pool_options(&self) -> AsyncPoolOptions {
        AsyncPoolOptions {
            initial_size: self.initial_size.unwrap_or(0),
            release_threshold: None,
            hard_limit: self.maximum_size,
            ipc_export: false,
        }
    }
}

/// Builds the resource `options` ask for on `device` (see the module's extension point).
pub fn build(device: &Device, options: &ReinitializeOptions) -> Result<SharedResource> {
    Ok(match (options.pool, options.managed) {
        (false, false) => Arc::new(CudaMemoryResource::new(device)),
        (false, true) => Arc::new(ManagedMemoryResource::new(device)?),
        (true, false) => Arc::new(AsyncMemoryResource::new(device, &options.pool_options())?),
        (true, true) => {
            let mut pool = PoolOptions::new(options.initial_size.unwrap_or(0));
            pool.maximum_size = options.maximum_size;
            Arc::new(PoolMemoryResource::new(
                ManagedMemoryResource::new(device)?,
                pool,
            )?)
        }
    })
}

/// Sets every listed device's current resource as `options` say, and returns the resources it
/// replaced, in device order. All resources are built before any is set, so an error (a bad
/// ordinal is [`Error::InvalidDevice`]) changes nothing.
pub fn reinitialize(options: &ReinitializeOptions) -> Result<Vec<(usize, SharedResource)>> {
    reinitialize_with(options, |_, r| Ok(r))
}

/// As [`reinitialize`], with each built resource passed through `wrap(device, resource)` before
/// it is set (an adaptor per device, such as a log file each). A failing `wrap` changes nothing.
pub fn reinitialize_with(
    options: &ReinitializeOptions,
    mut wrap: impl FnMut(usize, SharedResource) -> Result<SharedResource>,
) -> Result<Vec<(usize, SharedResource)>> {
    options.validate()?;
    let built = options
        .devices
        .iter()
        .map(|&d| Ok((d, wrap(d, build(&Device::get(d)?, options)?)?)))
        .collect::<Result<Vec<_>>>()?;
    built
        .into_iter()
        .map(|(d, r)| Ok((d, super::set(d, r)?)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation() {
        assert!(ReinitializeOptions::default().validate().is_ok());
        let pool = ReinitializeOptions {
            pool: true,
            initial_size: Some(1 << 20),
            maximum_size: Some(1 << 30),
            devices: vec![0, 1],
            ..Default::default()
        };
        assert!(pool.validate().is_ok());
        let bad = [
            ReinitializeOptions {
                devices: vec![],
                ..Default::default()
            },
            ReinitializeOptions {
                devices: vec![0, 1, 0],
                ..Default::default()
            },
            ReinitializeOptions {
                initial_size: Some(1),
                ..Default::default()
            },
            ReinitializeOptions {
                managed: true,
                maximum_size: Some(1),
                ..Default::default()
            },
            ReinitializeOptions {
                pool: true,
                initial_size: Some(2 << 20),
                maximum_size: Some(1 << 20),
                ..Default::default()
            },
        ];
        for b in bad {
            assert!(
                matches!(b.validate(), Err(Error::InvalidArgument(_))),
                "{b:?}"
            );
        }
    }

    #[test]
    fn invalid_options_fail_before_any_device_is_touched() {
        // Without a GPU, a device lookup would fail with NoDriver; validation must come first.
        let r = reinitialize(&ReinitializeOptions {
            devices: vec![],
            ..Default::default()
        });
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
        let mut wrapped = 0;
        let r = reinitialize_with(
            &ReinitializeOptions {
                devices: vec![0, 0],
                ..Default::default()
            },
            |_, r| {
                wrapped += 1;
                Ok(r)
            },
        );
        assert!(matches!(r, Err(Error::InvalidArgument(_))));
        assert_eq!(wrapped, 0);
    }
}
