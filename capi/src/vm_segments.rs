//! `carve_vm_set_segment_callback`: a C function told of every chunk a virtual-memory resource
//! maps and unmaps, to register the memory with NCCL (`ncclCommRegister`) or NIXL as it
//! appears and deregister it as it goes.

#![allow(non_camel_case_types)]

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use carve::resource::{SegmentCallback, SegmentChange};

use crate::error::{guard, Code, FfiError, FfiResult};
use crate::ffi::{carve_resource_t, handle_of};
use crate::registry::{self, Entry};

/// `carve_segment_callback_t`: `mapped` is 1 for a chunk just mapped, 0 for one unmapped.
pub type carve_segment_callback_t =
    Option<unsafe extern "C" fn(user: *mut c_void, ptr: *mut c_void, size: usize, mapped: c_int)>;

/// The caller's `user` pointer, passed back on whichever thread delivers an event.
struct User(*mut c_void);

impl User {
    fn get(&self) -> *mut c_void {
        self.0
    }
}

// SAFETY: `carve_vm_set_segment_callback`'s contract: `user` may be used from any thread.
unsafe impl Send for User {}
// SAFETY: as above; carve only passes the pointer back, never dereferences it.
unsafe impl Sync for User {}

/// Sets (or, with `None`, removes) the segment callback of the virtual-memory resource behind
/// `entry`; other resource kinds are `CARVE_ERROR_UNSUPPORTED`.
pub fn set(entry: &Entry, callback: Option<SegmentCallback>) -> FfiResult<()> {
    let chunks = entry.chunks.as_ref().ok_or_else(|| {
        FfiError::new(
            Code::Unsupported,
            format!(
                "a {} resource maps no segments: set the callback on the virtual-memory \
                 resource (virtual or expandable)",
                entry.kind_str()
            ),
        )
    })?;
    chunks.set_segment_callback(callback);
    Ok(())
}

/// `carve_vm_set_segment_callback`.
///
/// # Safety
/// `callback`, when set, must be callable with `user` from any thread until it is replaced or
/// the resource is gone, and must not unwind (throw).
#[no_mangle]
pub unsafe extern "C" fn carve_vm_set_segment_callback(
    r: carve_resource_t,
    callback: carve_segment_callback_t,
    user: *mut c_void,
) -> c_int {
    guard(|| {
        let e = registry::get(handle_of(r))?;
        let callback = callback.map(|f| {
            let user = User(user);
            Arc::new(move |ev: carve::resource::SegmentEvent| {
                let mapped = c_int::from(ev.change == SegmentChange::Mapped);
                // SAFETY: the caller's contract: callable with `user` from any thread.
                unsafe { f(user.get(), ev.addr as *mut c_void, ev.size, mapped) }
            }) as SegmentCallback
        });
        set(&e, callback)
    })
}
