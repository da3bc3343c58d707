//! Page-locking memory the caller already owns (`cuMemHostRegister` / `cuMemHostUnregister`).

use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use cudarc::driver::sys;

use super::{mapped_device_pointer, PinnedFlags};
use crate::driver::{mem, Device};
use crate::error::{DriverCode, Error, Result};

/// A host byte range pinned for as long as this value lives; dropping it unregisters.
///
/// It borrows the memory mutably, so the memory cannot be freed or moved while registered.
pub struct HostRegistration<'a> {
    ptr: NonNull<u8>,
    len: usize,
    flags: PinnedFlags,
    device: Device,
    _borrow: PhantomData<&'a mut [u8]>,
}

// SAFETY: it stands for a `&'a mut [u8]`, which is Send and Sync.
unsafe impl Send for HostRegistration<'_> {}
// SAFETY: as above.
unsafe impl Sync for HostRegistration<'_> {}

impl<'a> HostRegistration<'a> {
    /// Pins `memory` in `device`'s context with `flags` (not write-combined: that is
    /// [`Error::InvalidArgument`]). Empty memory is [`Error::ZeroSize`].
    pub fn new(device: &Device, memory: &'a mut [u8], flags: PinnedFlags) -> Result<Self> {
        let bits = flags.register_bits()?;
        let len = memory.len();
        let ptr = NonNull::new(memory.as_mut_ptr())
            .filter(|_| len > 0)
            .ok_or(Error::ZeroSize)?;
        if flags.device_mapped
            && device.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)?
                == 0
        {
            return Err(Error::Unsupported(format!(
                "device {} cannot map host memory",
                device.ordinal()
            )));
        }
        device.bind()?;
        // SAFETY: `memory` is a live, exclusively borrowed range of `len` bytes; the borrow
        // outlives the registration, and Drop unregisters it.
        match unsafe { mem::host_register(ptr.as_ptr().cast::<c_void>(), len, bits) } {
            Ok(()) => Ok(HostRegistration {
                ptr,
                len,
                flags,
                device: device.clone(),
                _borrow: PhantomData,
            }),
            Err(Error::Driver {
                code: DriverCode(sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED),
                ..
            }) => Err(Error::InvalidArgument(format!(
                "{:#x} is already registered",
                ptr.as_ptr() as usize
            ))),
            Err(e) => Err(e),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: empty ranges are refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> PinnedFlags {
        self.flags
    }

    /// The host view.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the borrowed range, live for 'a.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The mutable host view.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: the exclusively borrowed range; `&mut self` keeps the borrow unique.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The device address of the range's start; [`Error::Unsupported`] unless device-mapped.
    pub fn device_ptr(&self) -> Result<u64> {
        if !self.flags.device_mapped {
            return Err(Error::Unsupported(
                "registered without PinnedFlags::DEVICE_MAPPED".into(),
            ));
        }
        mapped_device_pointer(&self.device, self.ptr)
    }

    /// Unregisters now, reporting what dropping would have to swallow.
    pub fn unregister(self) -> Result<()> {
        let r = self.release();
        std::mem::forget(self);
        r
    }

    fn release(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: registered in `new`, unregistered once (Drop or `unregister`, never both).
        unsafe { mem::host_unregister(self.ptr.as_ptr().cast::<c_void>()) }
    }
}

impl Drop for HostRegistration<'_> {
    fn drop(&mut self) {
        // Drop cannot report (callers who care use `unregister`): record it.
        crate::deferred::record("HostRegistration drop", self.release());
    }
}

impl fmt::Debug for HostRegistration<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HostRegistration")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("flags", &self.flags)
            .finish()
    }
}
