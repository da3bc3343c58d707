//! [`CudaBacking`]: the CUDA driver's virtual memory management (`cuMemAddressReserve`,
//! `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
//! `cuMemAddressFree`, `cuMemExportToShareableHandle`, `cuMemImportFromShareableHandle`).

use cudarc::driver::sys;

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::driver::{vmm, Device};
use crate::error::{Error, Result};
use crate::resource::memory_resource::Properties;

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
    /// Whether chunks also carry fabric handles (`CU_MEM_HANDLE_TYPE_FABRIC`), which NCCL
    /// exports across nodes joined by NVLink (multi-node NVLink, through IMEX). Off by default.
    pub fabric: Fabric,
    /// The size unit of chunks and mappings. [`Granularity::Minimum`] by default.
    pub granularity: Granularity,
}

/// Whether a [`CudaBacking`] requests fabric handles for its chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Fabric {
    /// No fabric handles.
    #[default]
    Off,
    /// Fabric handles where the device reports them and a probe chunk can be created with them
    /// (an IMEX channel is open), as NCCL chooses its own handle type; none elsewhere.
    WhereSupported,
    /// Fabric handles, or [`Error::Unsupported`] from [`CudaBacking::new`].
    Required,
}

/// Which of the driver's allocation granularities sizes a [`CudaBacking`]'s chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Granularity {
    /// `CU_MEM_ALLOC_GRANULARITY_MINIMUM` (2 MiB on current GPUs): the least memory per chunk.
    #[default]
    Minimum,
    /// `CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`: the size the driver maps best, which NCCL uses for
    /// its own buffers (`ncclMemAlloc`) and asks of memory registered with it.
    Recommended,
}

/// The CUDA driver's virtual memory on one device.
#[derive(Debug)]
pub struct CudaBacking {
    device: Device,
    options: CudaBackingOptions,
    granularity: usize,
    /// Chunks carry fabric handles ([`CudaBackingOptions::fabric`], probed).
    fabric: bool,
}

/// A failed virtual-memory call as the backing reports it: out of memory is
/// [`Error::OutOfMemory`], whichever call ran short.
fn backing_error(e: Error) -> Error {
    match e {
        Error::Driver { call, .. } if e.is_out_of_memory() => Error::OutOfMemory {
            bytes: 0,
            resource: "CudaBacking",
            detail: format!("{call} failed: out of memory"),
        },
        e => e,
    }
}

impl CudaBacking {
    /// Virtual memory on `device`. Fails with [`Error::Unsupported`] where the device or driver
    /// has no virtual memory management (or no POSIX handles, when `exportable`; or no fabric
    /// handles, when [`Fabric::Required`]), and with [`Error::InvalidDevice`] for a peer that
    /// does not exist.
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
            crate::resource::source::location::check_ordinal(p)?;
        }
        let fabric = options.fabric != Fabric::Off
            && device.attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED,
            )? != 0;
        if options.fabric == Fabric::Required && !fabric {
            return Err(Error::Unsupported(format!(
                "device {} has no fabric memory handles",
                device.ordinal()
            )));
        }
        let recommended = options.granularity == Granularity::Recommended;
        let mut backing = CudaBacking {
            device: device.clone(),
            options,
            granularity: 0,
            fabric,
        };
        let prop = backing.prop();
        device.bind()?;
        // SAFETY: `prop` is a fully initialised allocation description.
        let granularity =
            unsafe { vmm::allocation_granularity(&prop, recommended) }.map_err(backing_error)?;
        if !granularity.is_power_of_two() {
            return Err(Error::Unsupported(format!(
                "the driver reports an allocation granularity of {granularity}"
            )));
        }
        backing.granularity = granularity;
        if backing.fabric {
            backing.probe_fabric()?;
        }
        Ok(backing)
    }

    /// Creates and releases one chunk with fabric handles: the driver reports them on devices
    /// where creating one still fails without an IMEX channel. Where it fails so, fabric handles
    /// are dropped ([`Fabric::WhereSupported`]) or the failure is [`Error::Unsupported`].
    fn probe_fabric(&mut self) -> Result<()> {
        use sys::CUresult as R;
        let prop = self.prop();
        // SAFETY: a valid description; a context is current (bound by the caller).
        match unsafe { vmm::create(self.granularity, &prop) } {
            Ok(h) => {
                // SAFETY: created just now, mapped nowhere, never used again.
                unsafe { vmm::release(h) }.map_err(backing_error)
            }
            Err(Error::Driver { code, .. })
                if code.0 == R::CUDA_ERROR_NOT_PERMITTED
                    || code.0 == R::CUDA_ERROR_NOT_SUPPORTED =>
            {
                if self.options.fabric == Fabric::Required {
                    return Err(Error::Unsupported(format!(
                        "device {} cannot create memory with fabric handles ({}): no IMEX \
                         channel?",
                        self.device.ordinal(),
                        code
                    )));
                }
                self.fabric = false;
                Ok(())
            }
            Err(e) => Err(backing_error(e)),
        }
    }

    /// Whether chunks carry fabric handles.
    pub fn fabric(&self) -> bool {
        self.fabric
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
            requestedHandleTypes: self.handle_types(),
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

    /// The handle types chunks are created with (a bit mask of `CUmemAllocationHandleType`).
    fn handle_types(&self) -> sys::CUmemAllocationHandleType {
        use sys::CUmemAllocationHandleType as H;
        let mut bits = H::CU_MEM_HANDLE_TYPE_NONE.0;
        if self.options.exportable {
            bits |= H::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        }
        if self.fabric {
            bits |= H::CU_MEM_HANDLE_TYPE_FABRIC.0;
        }
        sys::CUmemAllocationHandleType(bits)
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
        // SAFETY: reserves address space only; a context is current (bound above).
        let va = unsafe { vmm::address_reserve(size, align.max(self.granularity)) }
            .map_err(backing_error)?;
        Ok(va as usize)
    }

    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract: a live, empty reservation, never used again.
        unsafe { vmm::address_free(va as sys::CUdeviceptr, size) }.map_err(backing_error)
    }

    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        self.device.bind()?;
        let prop = self.prop();
        // SAFETY: a valid description; a context is current (bound above).
        let handle = unsafe { vmm::create(size, &prop) }.map_err(|e| match backing_error(e) {
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
        unsafe { vmm::release(handle) }.map_err(backing_error)
    }

    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        self.device.bind()?;
        let ptr = va as sys::CUdeviceptr;
        // SAFETY: the caller's contract: an empty, aligned range of our reservation, and a live
        // chunk of `size` bytes.
        unsafe { vmm::map(ptr, size, handle) }.map_err(backing_error)
    }

    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        let access = self.access();
        // SAFETY: the caller's contract: the range is wholly mapped; the descriptors are valid
        // for the call.
        unsafe { vmm::set_access(va as sys::CUdeviceptr, size, &access) }.map_err(backing_error)
    }

    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        self.device.bind()?;
        // SAFETY: the caller's contract: exactly one earlier mapping, no longer used.
        unsafe { vmm::unmap(va as sys::CUdeviceptr, size) }.map_err(backing_error)
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
        // SAFETY: `handle` is a live chunk created exportable as a descriptor (checked above).
        let fd = unsafe { vmm::export_fd(handle) }.map_err(backing_error)?;
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
        // SAFETY: the borrow keeps the descriptor open for the call; a context is current.
        unsafe { vmm::import_fd(fd.as_raw_fd()) }.map_err(backing_error)
    }
}
