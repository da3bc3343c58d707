//! Live resources behind opaque handles.
//!
//! Handles are [`Slots`] handles: a stale or forged handle fails the lookup with
//! `CARVE_ERROR_INVALID_HANDLE` instead of reaching freed memory. The registry holds one `Arc`
//! per handle; adaptors, the current-resource table and outstanding framework blocks hold their
//! own, so destroying a handle never frees a resource that something still uses.

use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use carve::SharedResource;

use crate::error::{Code, FfiError, FfiResult};
pub use crate::slots::Handle;
use crate::slots::Slots;
use crate::vm_export::ChunkExporter;

/// One resource: its kind's name and the type-erased resource. Statistics and release go
/// through the resource's [`carve::MemoryResource`] methods.
#[derive(Debug)]
pub struct Entry {
    /// `"pool"`, `"cuda"`, `"statistics"`, ... (`"current"` for a resource found as current
    /// that no live handle names).
    pub kind: &'static CStr,
    /// What allocations go through.
    pub resource: SharedResource,
    /// The driver pool (`CUmemoryPool`) of an async resource, to share with other libraries.
    pub driver_pool: Option<usize>,
    /// The virtual-memory resource's chunk export (`carve_vm_export_chunk`).
    pub chunks: Option<Arc<dyn ChunkExporter>>,
}

impl Entry {
    /// An entry for `resource` of `kind`.
    pub fn new(kind: &'static CStr, resource: SharedResource) -> Arc<Entry> {
        Arc::new(Entry {
            kind,
            resource,
            driver_pool: None,
            chunks: None,
        })
    }

    /// The kind as a Rust string.
    pub fn kind_str(&self) -> &'static str {
        self.kind.to_str().unwrap_or("?")
    }

    /// True when both entries allocate through the same resource.
    pub fn same_resource(&self, resource: &SharedResource) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.resource), Arc::as_ptr(resource))
    }
}

static REGISTRY: Mutex<Slots<Arc<Entry>>> = Mutex::new(Slots::new());

fn registry() -> MutexGuard<'static, Slots<Arc<Entry>>> {
    // Every critical section is a single slot update, so a poisoned lock holds consistent data.
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Registers `entry`; returns its new handle.
pub fn insert(entry: Arc<Entry>) -> FfiResult<Handle> {
    registry()
        .insert(entry)
        .ok_or_else(|| FfiError::new(Code::OutOfMemory, "too many live carve handles"))
}

/// The entry behind `handle`.
pub fn get(handle: Handle) -> FfiResult<Arc<Entry>> {
    registry()
        .get(handle)
        .cloned()
        .ok_or_else(|| invalid(handle))
}

/// Forgets `handle`; the resource lives on while anything else holds it.
pub fn remove(handle: Handle) -> FfiResult<Arc<Entry>> {
    registry().remove(handle).ok_or_else(|| invalid(handle))
}

/// A live entry that allocates through `resource`, if a handle names one.
pub fn find(resource: &SharedResource) -> Option<Arc<Entry>> {
    registry()
        .values()
        .find(|e| e.same_resource(resource))
        .cloned()
}

/// Number of live handles (for tests and leak checks).
pub fn live() -> usize {
    registry().values().count()
}

fn invalid(handle: Handle) -> FfiError {
    if handle == 0 {
        FfiError::new(Code::InvalidHandle, "null carve resource handle")
    } else {
        FfiError::new(
            Code::InvalidHandle,
            format!("carve resource handle {handle:#x} is not live (destroyed or never created)"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host() -> Arc<Entry> {
        Entry::new(c"host", Arc::new(carve::HostMemoryResource::new()))
    }

    #[test]
    fn destroyed_and_forged_handles_are_refused_and_slots_are_reused_with_a_new_generation() {
        let a = insert(host()).unwrap();
        assert_ne!(a, 0);
        assert_eq!(get(a).unwrap().kind, c"host");
        remove(a).unwrap();
        assert_eq!(get(a).unwrap_err().code, Code::InvalidHandle);
        assert_eq!(remove(a).unwrap_err().code, Code::InvalidHandle);
        let b = insert(host()).unwrap();
        assert_ne!(a, b, "a reused slot must not revive the old handle");
        assert_eq!(get(a).unwrap_err().code, Code::InvalidHandle);
        assert_eq!(get(0).unwrap_err().code, Code::InvalidHandle);
        assert_eq!(get(u64::MAX).unwrap_err().code, Code::InvalidHandle);
        assert_eq!(get(b ^ (1 << 40)).unwrap_err().code, Code::InvalidHandle);
        remove(b).unwrap();
    }
}
