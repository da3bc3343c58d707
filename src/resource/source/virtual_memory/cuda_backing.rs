//! [`CudaBacking`]: the CUDA driver's virtual memory management (`cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemAddressFree`, `cuMemExportToShareableHandle`, `cuMemImportFromShareableHandle`).

use cudarc::driver::sys;

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::Properties;

/// Where a [`CudaBacking`]'s physical chunks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ChunkLocation {
    /// The backing's device.
    #[default]
    Device,
    /// Host memory on this NUMA node, mapped for the device (where the driver supports it).
    HostNuma(u32),
}

/// How a [`CudaBacking`] creates and maps chunks.
#[derive(Clone, Debug, Default)]
pub struct CudaBackingOptions {
    /// Where chunks live.
    pub location: ChunkLocation,
    /// Other devices (ordinals) granted read-write access to every mapping, besides the
    /// backing's own device.
    pub peers: Vec<usize>,
    /// Create chunks exportable as POSIX file descriptors
    /// ([`PhysicalBacking::export_fd`]), for IPC. Off by default: exportable chunks may be
    /// slower to create.
    pub exportable: bool,
}

/// The CUDA driver's virtual memory on one device.
#[derive(Debug)]
pub struct CudaBacking {
    device: Device,
    options: CudaBackingOptions,
    granularity: usize,
}

fn check(call: &'static str, rc: sys::CUresult) -> Result<()> {
    match rc {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => Err(Error::OutOfMemory {
            bytes: 0,
            resource: "CudaBacking",
            detail: format!("{call} failed: out of memory"),
        }),
        code => Err(Error::Driver {
            call,
            code: crate::error::DriverCode(code),
        }),
    }
}

impl CudaBacking {
    /// Virtual memory on `device`. Fails with [`Error::Unsupported`] where the device or driver
    /// has no virtual memory management (or no POSIX handles, when `exportable`), and with
    /// [`Error::InvalidDevice`] for a peer that does not exist.
    pub fn new(device: &Device, options: CudaBackingOptions) -> Result<Self> {
        let vmm = device.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
        )?;
        if vmm == 0 {
            return Err(Error::Unsupported(format!(
                "device {} has no virtual memory management",
                device.ordinal()
            )));
        }
        if options.exportable {
            let fd = device.attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )?;
            if fd == 0 {
                return Err(Error::Unsupported(format!(
                    "device {} cannot export memory as POSIX file descriptors",
                    device.ordinal()
                )));
            }
        }
        for &p in &options.peers {
            crate::resource::check_ordinal(p)?;
        }
        let mut backing = CudaBacking {
            device: device.clone(),
            options,
            granularity: 0,
        };
        let prop = backing.prop();
        let mut granularity = 0usize;
        device.bind()?;
        // SAFETY: `prop` is a fully initialised allocation description; the out-pointer is valid.
        check("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        if !granularity.is_power_of_two() {
            return Err(Error::Unsupported(format!(
                "the driver reports an allocation granularity of {granularity}"
            )));
        }
        backing.granularity = granularity;
        Ok(backing)
    }

    /// The device it maps for.
    pub fn device(&self) -> &Device {
        &self.device
    }

    fn prop(&self) -> sys::CUmemAllocationProp {
        let location = match self.options.location {
            ChunkLocation::Device => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: self.device.ordinal() as i32,
            },
            ChunkLocation::HostNuma(node) => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
                id: node as i32,
            },
        };
        sys::CUmemAllocationProp {
            type_: sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED,
            requestedHandleTypes: if self.options.exportable {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            } else {
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_NONE
            },
            location,
            win32HandleMetaData: std::ptr::null_mut(),
            allocFlags: sys::CUmemAllocationProp_st__bindgen_ty_1 {
                compressionType: 0,
                gpuDirectRDMACapable: 0,
                usage: 0,
                reserved: [0; 4],
            },
        }
    }

    fn access(&self) -> Vec<sys::CUmemAccessDesc> {
        std::iter::once(self.device.ordinal())
            .chain(self.options.peers.iter().copied())
            .map(|d| sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: d as i32,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            })
            .collect()
    }
}

// SAFETY: every call is the driver's own, on this device's context: reservations, chunks and
// mappings are the driver's, which keeps them disjoint; `set_access` grants read-write access to
// the device (and the peers), so mapped memory is device-accessible as stated.
unsafe impl PhysicalBacking for CudaBacking {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn properties(&self) -> Properties {
        Properties::DEVICE
    }

    fn device(&self) -> Option<Device> {
        Some(self.device.clone())
    }

    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.device.bind()?;
        let mut va: sys::CUdeviceptr = 0;
        // SAFETY: reserves address space only; the out-pointer is valid.
        check("cuMemAddressReserve", unsafe {
            sys::cuMemAddressReserve(&mut va, size, align.max(self.granularity), 0, 0)
        })?;
        Ok(va as usize)
    }

    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract: a live, empty reservation, never used again.
        check("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(va as sys::CUdeviceptr, size)
        })
    }

    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        self.device.bind()?;
        let prop = self.prop();
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: a valid description and out-pointer.
        check("cuMemCreate", unsafe {
            sys::cuMemCreate(&mut handle, size, &prop, 0)
        })
        .map_err(|e| match e {
            Error::OutOfMemory { resource, .. } => Error::OutOfMemory {
                bytes: size,
                resource,
                detail: format!(
                    "cuMemCreate of a {size}-byte chunk on device {}",
                    self.device.ordinal()
                ),
            },
            e => e,
        })?;
        Ok(handle)
    }

    unsafe fn release(&self, handle: PhysicalHandle, _size: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract: an unmapped chunk, never used again.
        check("cuMemRelease", unsafe { sys::cuMemRelease(handle) })
    }

    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        self.device.bind()?;
        let ptr = va as sys::CUdeviceptr;
        // SAFETY: the caller's contract: an empty, aligned range of our reservation, and a live
        // chunk of `size` bytes.
        check("cuMemMap", unsafe {
            sys::cuMemMap(ptr, size, 0, handle, 0)
        })
    }

    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        let access = self.access();
        // SAFETY: the caller's contract: the range is wholly mapped; the descriptors are valid
        // for the call.
        check("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(va as sys::CUdeviceptr, size, access.as_ptr(), access.len())
        })
    }

    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract: exactly one earlier mapping, no longer used.
        check("cuMemUnmap", unsafe {
            sys::cuMemUnmap(va as sys::CUdeviceptr, size)
        })
    }

    #[cfg(unix)]
    fn export_fd(&self, handle: PhysicalHandle) -> Result<std::os::fd::OwnedFd> {
        use std::os::fd::FromRawFd;
        if !self.options.exportable {
            return Err(Error::Unsupported(
                "chunks were not created exportable (CudaBackingOptions::exportable)".to_owned(),
            ));
        }
        self.device.bind()?;
        let mut fd: std::ffi::c_int = -1;
        // SAFETY: for POSIX handles the driver writes an `int` file descriptor through the
        // pointer; `handle` is a live chunk created with that handle type.
        check("cuMemExportToShareableHandle", unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut std::ffi::c_int).cast(),
                handle,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        })?;
        if fd < 0 {
            return Err(Error::Unsupported(
                "cuMemExportToShareableHandle returned no descriptor".to_owned(),
            ));
        }
        // SAFETY: the driver handed us a new descriptor that nothing else owns.
        Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
    }
}

impl CudaBacking {
    /// The physical chunk another process exported as a POSIX file descriptor
    /// ([`PhysicalBacking::export_fd`]), live in this process until [`release`]d. The descriptor
    /// stays the caller's.
    ///
    /// [`release`]: PhysicalBacking::release
    #[cfg(unix)]
    pub(crate) fn import_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<PhysicalHandle> {
        use std::os::fd::AsRawFd;
        self.device.bind()?;
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: for POSIX handles the driver takes the descriptor's number in place of a
        // pointer and only reads the descriptor, which the borrow keeps open for the call.
        check("cuMemImportFromShareableHandle", unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut handle,
                fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        })?;
        Ok(handle)
    }
}
