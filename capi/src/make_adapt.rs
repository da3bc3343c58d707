//! Building the aligning, prefetching and failure-callback adaptors.

use std::sync::Arc;

use carve::adaptor::{
    AlignedResourceAdaptor, FailureCallbackResourceAdaptor, PrefetchResourceAdaptor,
};
use carve::{Device, SharedResource};

use crate::error::{FfiError, FfiResult};
use crate::registry::Entry;

fn up(upstream: &Entry) -> SharedResource {
    upstream.resource.clone()
}

/// Aligns requests of `threshold` bytes or more to `alignment` (a power of two).
pub fn aligned(upstream: &Entry, alignment: usize, threshold: usize) -> FfiResult<Arc<Entry>> {
    if !alignment.is_power_of_two() {
        return Err(FfiError::invalid(format!(
            "aligned adaptor: alignment {alignment} is not a power of two"
        )));
    }
    let r = AlignedResourceAdaptor::new(up(upstream), alignment, threshold)?;
    Ok(Entry::new(c"aligned", Arc::new(r)))
}

/// Prefetches `upstream`'s (managed) blocks to `device`.
pub fn prefetch(upstream: &Entry, device: usize) -> FfiResult<Arc<Entry>> {
    let r = PrefetchResourceAdaptor::new(up(upstream), &Device::get(device)?);
    Ok(Entry::new(c"prefetch", Arc::new(r)))
}

/// On out-of-memory, calls `callback(bytes)` and retries while it returns true. The callback
/// must not panic (the C and Python callers catch everything inside it).
pub fn failure_callback<F>(upstream: &Entry, callback: F) -> Arc<Entry>
where
    F: Fn(usize) -> bool + Send + Sync + 'static,
{
    let r = FailureCallbackResourceAdaptor::new(up(upstream), callback);
    Entry::new(c"failure_callback", Arc::new(r))
}
