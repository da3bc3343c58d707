//! Prefetch, advice and attribute queries on any managed range (`cuMemPrefetchAsync_v2`,
//! `cuMemAdvise_v2`, `cuMemRangeGetAttribute`).
//!
//! The `_v2` entry points take a `CUmemLocation`; CUDA 13 made them the only form in its headers,
//! while libcuda keeps exporting both names. carve calls the `_v2` symbols by name and checks they
//! exist first, so an old driver gives [`Error::Unsupported`] instead of cudarc's panic.

use std::ffi::c_void;

use cudarc::driver::sys;

use super::super::location::{Location, CU_DEVICE_INVALID};
use crate::driver::{mem, Device, Stream};
use crate::error::{DriverCode, Error, Result};
use crate::stream::StreamRef;

/// A byte range inside one managed allocation, checked to be managed at both ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagedRange {
    ptr: u64,
    len: usize,
}

/// Advice for the unified-memory driver (`cuMemAdvise`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Advice {
    /// Mostly read: devices that read it get their own read-only copies.
    SetReadMostly,
    /// Undoes [`Advice::SetReadMostly`].
    UnsetReadMostly,
    /// Prefer to keep the pages at this location.
    SetPreferredLocation(Location),
    /// Undoes [`Advice::SetPreferredLocation`].
    UnsetPreferredLocation,
    /// Keep the pages mapped in this device's page tables, wherever they live.
    SetAccessedBy(usize),
    /// Undoes [`Advice::SetAccessedBy`] for this device.
    UnsetAccessedBy(usize),
}

/// What [`ManagedRange::attributes`] reports (`cuMemRangeGetAttribute`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeAttributes {
    /// Every page of the range is read-mostly.
    pub read_mostly: bool,
    /// The preferred location shared by every page, if there is one.
    pub preferred_location: Option<Location>,
    /// Devices every page is advised to be accessed by, in ascending order.
    pub accessed_by: Vec<usize>,
    /// Where the whole range was last prefetched to, if one place. This says where a prefetch
    /// went, not where the pages are now.
    pub last_prefetch_location: Option<Location>,
}

impl ManagedRange {
    /// The range `[ptr, ptr + len)`, after checking that its first and last bytes are managed.
    ///
    /// Other memory is [`Error::NotManaged`]: CUDA rejects device memory, and carve does not pass
    /// pageable host memory on (only systems with HMM would accept it).
    pub fn new(ptr: u64, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::ZeroSize);
        }
        let last = ptr.checked_add(len as u64 - 1).ok_or(Error::SizeOverflow {
            bytes: len,
            align: 1,
        })?;
        Device::current()?.bind()?;
        for p in [ptr, last] {
            if !is_managed(p)? {
                return Err(Error::NotManaged { ptr: p as usize });
            }
        }
        Ok(ManagedRange { ptr, len })
    }

    /// Start address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Always false: ranges are never empty.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Queues a migration of the range to `location` on `stream`. The range is usable at once;
    /// the prefetch only moves pages ahead of use. Needs a device with concurrent managed access.
    pub fn prefetch(&self, location: Location, stream: &Stream) -> Result<()> {
        self.prefetch_on(location, stream.device(), stream.as_ref())
    }

    /// [`ManagedRange::prefetch`] on a stream carve does not own (a framework's), which must
    /// belong to `device`.
    pub fn prefetch_on(
        &self,
        location: Location,
        device: &Device,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        device.bind()?;
        prefetch_raw(self.ptr, self.len, location, stream)
    }

    /// Gives the driver `advice` for the range.
    pub fn advise(&self, advice: Advice) -> Result<()> {
        let current = Device::current()?;
        // The location is ignored for the read-mostly and unset-preferred advice; a valid device
        // is passed anyway.
        let here = Location::Device(current.ordinal());
        let (raw, location) = match advice {
            Advice::SetReadMostly => (sys::CUmem_advise::CU_MEM_ADVISE_SET_READ_MOSTLY, here),
            Advice::UnsetReadMostly => (sys::CUmem_advise::CU_MEM_ADVISE_UNSET_READ_MOSTLY, here),
            Advice::SetPreferredLocation(l) => (
                sys::CUmem_advise::CU_MEM_ADVISE_SET_PREFERRED_LOCATION,
                l.validate()?,
            ),
            Advice::UnsetPreferredLocation => (
                sys::CUmem_advise::CU_MEM_ADVISE_UNSET_PREFERRED_LOCATION,
                here,
            ),
            Advice::SetAccessedBy(d) => (
                sys::CUmem_advise::CU_MEM_ADVISE_SET_ACCESSED_BY,
                Location::Device(d).validate()?,
            ),
            Advice::UnsetAccessedBy(d) => (
                sys::CUmem_advise::CU_MEM_ADVISE_UNSET_ACCESSED_BY,
                Location::Device(d).validate()?,
            ),
        };
        require_symbol("cuMemAdvise_v2")?;
        current.bind()?;
        // SAFETY: advice changes placement policy only; the range is managed (checked), and the
        // symbol is present (checked).
        unsafe { mem::advise(self.ptr, self.len, raw, location.to_cu()) }
    }

    /// The range's current attributes. Prefetches still queued may not show yet: synchronise
    /// their stream first.
    pub fn attributes(&self) -> Result<RangeAttributes> {
        use sys::CUmem_range_attribute as A;
        Device::current()?.bind()?;
        let read_mostly = self.int_attribute(A::CU_MEM_RANGE_ATTRIBUTE_READ_MOSTLY)? != 0;
        let preferred = self.int_attribute(A::CU_MEM_RANGE_ATTRIBUTE_PREFERRED_LOCATION)?;
        let last = self.int_attribute(A::CU_MEM_RANGE_ATTRIBUTE_LAST_PREFETCH_LOCATION)?;
        let mut ids = vec![CU_DEVICE_INVALID; Device::count()?.max(1)];
        // SAFETY: `ids` holds `ids.len()` i32s, the size passed; the range is managed.
        unsafe {
            mem::range_attribute(
                ids.as_mut_ptr().cast::<c_void>(),
                ids.len() * size_of::<i32>(),
                A::CU_MEM_RANGE_ATTRIBUTE_ACCESSED_BY,
                self.ptr,
                self.len,
            )
        }?;
        Ok(RangeAttributes {
            read_mostly,
            preferred_location: Location::from_legacy_id(preferred),
            accessed_by: accessed_by_from_ids(&ids),
            last_prefetch_location: Location::from_legacy_id(last),
        })
    }

    fn int_attribute(&self, attr: sys::CUmem_range_attribute) -> Result<i32> {
        let mut value: i32 = CU_DEVICE_INVALID;
        // SAFETY: these attributes are one 32-bit int; the range is managed.
        unsafe {
            mem::range_attribute(
                (&mut value as *mut i32).cast::<c_void>(),
                size_of::<i32>(),
                attr,
                self.ptr,
                self.len,
            )
        }?;
        Ok(value)
    }
}

/// The device ordinals in an accessed-by answer (unused slots are `CU_DEVICE_INVALID`).
pub(crate) fn accessed_by_from_ids(ids: &[i32]) -> Vec<usize> {
    let mut out: Vec<usize> = ids
        .iter()
        .filter(|&&id| id >= 0)
        .map(|&id| id as usize)
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// True when `ptr` lies in managed memory. Memory unknown to CUDA (pageable host memory) is
/// not managed rather than an error.
fn is_managed(ptr: u64) -> Result<bool> {
    // The attribute is a bool; a wider zeroed slot reads the same whatever width is written.
    let mut flag: u32 = 0;
    // SAFETY: `flag` is a valid out-slot for the attribute.
    let r = unsafe {
        mem::pointer_attribute(
            (&mut flag as *mut u32).cast::<c_void>(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_MANAGED,
            ptr,
        )
    };
    match r {
        Ok(()) => Ok(flag != 0),
        Err(Error::Driver {
            code: DriverCode(sys::CUresult::CUDA_ERROR_INVALID_VALUE),
            ..
        }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// [`Error::Unsupported`] unless libcuda exports `name` (cudarc panics on a missing symbol).
pub(crate) fn require_symbol(name: &str) -> Result<()> {
    crate::driver::init()?;
    // SAFETY: the library is loaded (init succeeded); a lookup has no side effects, and the
    // symbol is not called through this typed handle.
    let present = unsafe {
        sys::culib()
            .get::<unsafe extern "C" fn()>(name.as_bytes())
            .is_ok()
    };
    if present {
        Ok(())
    } else {
        Err(Error::Unsupported(format!(
            "this CUDA driver does not export {name}"
        )))
    }
}

/// `cuMemPrefetchAsync_v2` on `[ptr, ptr + len)` without the managed check, for callers that know
/// the range is managed (the prefetch adaptor, on blocks its managed upstream just returned). The
/// caller has made the stream's context current.
pub(crate) fn prefetch_raw(
    ptr: u64,
    len: usize,
    location: Location,
    stream: StreamRef<'_>,
) -> Result<()> {
    let raw = stream.driver_handle("cuMemPrefetchAsync_v2")?;
    let location = location.validate()?;
    require_symbol("cuMemPrefetchAsync_v2")?;
    // SAFETY: the caller names a live range; the driver rejects memory that is not managed with
    // an error code; the stream is valid by `StreamRef`'s contract; the symbol is present.
    unsafe { mem::prefetch_async(ptr, len, location.to_cu(), raw) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accessed_by_skips_invalid_slots_and_sorts() {
        assert_eq!(accessed_by_from_ids(&[2, -2, 0, -2, 2]), vec![0, 2]);
        assert!(accessed_by_from_ids(&[-2, -2]).is_empty());
    }

    #[test]
    fn bad_ranges_are_refused_before_the_driver() {
        assert!(matches!(ManagedRange::new(0x1000, 0), Err(Error::ZeroSize)));
        assert!(matches!(
            ManagedRange::new(u64::MAX - 4, 16),
            Err(Error::SizeOverflow { .. })
        ));
    }
}
