//! The current resource per device is the library's ([`carve::current`]); a resource found
//! there is reported as the live entry that names it, so `get` returns its kind.

use std::sync::Arc;

use carve::SharedResource;

use crate::error::FfiResult;
use crate::registry::{self, Entry};

fn entry_for(resource: SharedResource) -> Arc<Entry> {
    registry::find(&resource).unwrap_or_else(|| Entry::new(c"current", resource))
}

/// Makes `entry` current for `device`; returns the entry it replaces.
pub fn set(device: usize, entry: Arc<Entry>) -> FfiResult<Arc<Entry>> {
    let previous = carve::current::set(device, entry.resource.clone())?;
    Ok(entry_for(previous))
}

/// The current resource of `device` (a cuda resource until one is set).
pub fn get(device: usize) -> FfiResult<Arc<Entry>> {
    Ok(entry_for(carve::current::get(device)?))
}
