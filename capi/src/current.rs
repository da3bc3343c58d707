//! The current resource per device, remembering which entry was set so that `get` returns it
//! (with its statistics) rather than an anonymous wrapper.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use carve::SharedResource;

use crate::error::FfiResult;
use crate::registry::{Entry, Typed};

static SET: Mutex<Option<HashMap<usize, Arc<Entry>>>> = Mutex::new(None);

fn same(a: &SharedResource, b: &SharedResource) -> bool {
    std::ptr::addr_eq(Arc::as_ptr(a), Arc::as_ptr(b))
}

/// Makes `entry` current for `device`; returns the entry it replaces.
pub fn set(device: usize, entry: Arc<Entry>) -> FfiResult<Arc<Entry>> {
    let previous = get(device)?;
    carve::current::set(device, entry.resource.clone())?;
    SET.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(device, entry);
    Ok(previous)
}

/// The current resource of `device` (a cuda resource until one is set).
pub fn get(device: usize) -> FfiResult<Arc<Entry>> {
    let resource = carve::current::get(device)?;
    let set = SET.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(e) = set.as_ref().and_then(|m| m.get(&device)) {
        if same(&e.resource, &resource) {
            return Ok(e.clone());
        }
    }
    Ok(Entry::new("current", resource, Typed::Plain))
}
