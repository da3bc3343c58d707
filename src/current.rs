//! The current resource per device, as RMM's `get/set_current_device_resource`.
//!
//! The default is a [`CudaMemoryResource`] on that device. Buffers capture the resource when
//! they allocate, so replacing the current resource never changes where a live buffer frees.
//! [`reinitialize`] sets several devices up in one call, as `rmm.reinitialize` does.

mod reinit;

pub use crate::driver::mem_info;
pub use reinit::{build, reinitialize, reinitialize_with, ReinitializeOptions};

use std::collections::HashMap;
use std::sync::{Arc, PoisonError, RwLock};

use crate::driver::Device;
use crate::error::Result;
use crate::resource::{check_device, CudaMemoryResource, SharedResource};

static CURRENT: RwLock<Option<HashMap<usize, SharedResource>>> = RwLock::new(None);

/// The current resource of device `ordinal` (created as a cuda resource on first use).
pub fn get(ordinal: usize) -> Result<SharedResource> {
    let device = Device::get(ordinal)?;
    if let Some(r) = CURRENT
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .and_then(|m| m.get(&ordinal))
    {
        return Ok(r.clone());
    }
    let mut map = CURRENT.write().unwrap_or_else(PoisonError::into_inner);
    let r = map
        .get_or_insert_with(HashMap::new)
        .entry(ordinal)
        .or_insert_with(|| Arc::new(CudaMemoryResource::new(&device)));
    Ok(r.clone())
}

/// Makes `resource` current for device `ordinal`; returns the one it replaces.
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for device-only memory of another
/// device.
pub fn set(ordinal: usize, resource: SharedResource) -> Result<SharedResource> {
    let previous = get(ordinal)?;
    check_device(&*resource, &Device::get(ordinal)?)?;
    let mut map = CURRENT.write().unwrap_or_else(PoisonError::into_inner);
    map.get_or_insert_with(HashMap::new)
        .insert(ordinal, resource);
    Ok(previous)
}
