//! Live resources behind opaque handles.
//!
//! A handle is `generation << 32 | (slot + 1)`, never 0. Destroying a handle empties its slot
//! and bumps the slot's generation, so a stale or forged handle fails the lookup with
//! `CARVE_ERROR_INVALID_HANDLE` instead of reaching freed memory. The registry holds one `Arc`
//! per handle; adaptors, the current-resource table and outstanding framework blocks hold their
//! own, so destroying a handle never frees a resource that something still uses.

use std::ffi::CStr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use carve::SharedResource;

use crate::error::{Code, FfiError, FfiResult};

/// A registry id, as C sees it (cast to `carve_resource_t`).
pub type Handle = u64;

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
}

impl Entry {
    /// An entry for `resource` of `kind`.
    pub fn new(kind: &'static CStr, resource: SharedResource) -> Arc<Entry> {
        Arc::new(Entry {
            kind,
            resource,
            driver_pool: None,
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

struct Slot {
    generation: u32,
    entry: Option<Arc<Entry>>,
}

#[derive(Default)]
struct Registry {
    slots: Vec<Slot>,
    free: Vec<u32>,
}

static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    slots: Vec::new(),
    free: Vec::new(),
});

fn registry() -> MutexGuard<'static, Registry> {
    // Every critical section is a single slot update, so a poisoned lock holds consistent data.
    REGISTRY.lock().unwrap_or_else(PoisonError::into_inner)
}

fn split(handle: Handle) -> Option<(usize, u32)> {
    let index = (handle & 0xFFFF_FFFF).checked_sub(1)?;
    Some((index as usize, (handle >> 32) as u32))
}

/// Registers `entry`; returns its new handle.
pub fn insert(entry: Arc<Entry>) -> FfiResult<Handle> {
    let mut reg = registry();
    let index = match reg.free.pop() {
        Some(i) => i,
        None => {
            let i = u32::try_from(reg.slots.len())
                .ok()
                .filter(|i| *i < u32::MAX)
                .ok_or_else(|| FfiError::new(Code::OutOfMemory, "too many live carve handles"))?;
            reg.slots.push(Slot {
                generation: 0,
                entry: None,
            });
            i
        }
    };
    let slot = &mut reg.slots[index as usize];
    slot.entry = Some(entry);
    Ok((u64::from(slot.generation) << 32) | (u64::from(index) + 1))
}

/// The entry behind `handle`.
pub fn get(handle: Handle) -> FfiResult<Arc<Entry>> {
    let reg = registry();
    split(handle)
        .and_then(|(i, generation)| reg.slots.get(i).filter(|s| s.generation == generation))
        .and_then(|s| s.entry.clone())
        .ok_or_else(|| invalid(handle))
}

/// Forgets `handle`; the resource lives on while anything else holds it.
pub fn remove(handle: Handle) -> FfiResult<Arc<Entry>> {
    let mut reg = registry();
    let Some((i, generation)) = split(handle) else {
        return Err(invalid(handle));
    };
    let entry = reg
        .slots
        .get_mut(i)
        .filter(|s| s.generation == generation)
        .and_then(|s| {
            s.generation = s.generation.wrapping_add(1);
            s.entry.take()
        })
        .ok_or_else(|| invalid(handle))?;
    reg.free.push(i as u32);
    Ok(entry)
}

/// A live entry that allocates through `resource`, if a handle names one.
pub fn find(resource: &SharedResource) -> Option<Arc<Entry>> {
    registry()
        .slots
        .iter()
        .filter_map(|s| s.entry.as_ref())
        .find(|e| e.same_resource(resource))
        .cloned()
}

/// Number of live handles (for tests and leak checks).
pub fn live() -> usize {
    registry()
        .slots
        .iter()
        .filter(|s| s.entry.is_some())
        .count()
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
