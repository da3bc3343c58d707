//! Where memory lives or should move to: a device or the CPU, as the driver's `CUmemLocation`;
//! and whether a device may use a resource's memory.

use cudarc::driver::sys;

use crate::driver::Device;
use crate::error::{Error, Result};
use crate::resource::MemoryResource;

/// The driver's `CU_DEVICE_CPU`: "the host", in the legacy `int` encodings.
pub(crate) const CU_DEVICE_CPU: i32 = -1;
/// The driver's `CU_DEVICE_INVALID`: "nowhere" (no prefetch yet, no preferred location).
pub(crate) const CU_DEVICE_INVALID: i32 = -2;

/// A memory location: the CPU or one device, by ordinal.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory (any NUMA node).
    Host,
    /// The device with this ordinal.
    Device(usize),
}

impl Location {
    /// Checks that a device location names a device that exists ([`Error::InvalidDevice`]).
    pub fn validate(self) -> Result<Self> {
        if let Location::Device(ordinal) = self {
            check_ordinal(ordinal)?;
        }
        Ok(self)
    }

    /// The driver's form. Ordinals are assumed validated.
    pub(crate) fn to_cu(self) -> sys::CUmemLocation {
        match self {
            Location::Host => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
                id: 0,
            },
            Location::Device(ordinal) => sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: ordinal as i32,
            },
        }
    }

    /// Decodes the legacy `int` form the range attributes return (`None` for "nowhere").
    pub(crate) fn from_legacy_id(id: i32) -> Option<Location> {
        match id {
            CU_DEVICE_CPU => Some(Location::Host),
            id if id >= 0 => Some(Location::Device(id as usize)),
            _ => None,
        }
    }
}

/// [`Error::InvalidDevice`] unless `ordinal` names a present device.
pub fn check_ordinal(ordinal: usize) -> Result<()> {
    let count = Device::count()?;
    if ordinal >= count {
        return Err(Error::InvalidDevice { ordinal, count });
    }
    Ok(())
}

/// Refuses device-only memory of one device ordered on another device's stream (managed and
/// mapped host memory, which every device reaches, may be).
pub(crate) fn check_device(resource: &dyn MemoryResource, device: &Device) -> Result<()> {
    let props = resource.properties();
    match resource.device() {
        Some(own) if own != *device && !props.host_accessible => {
            Err(Error::InvalidArgument(format!(
                "{resource:?} allocates on device {}, not device {}",
                own.ordinal(),
                device.ordinal()
            )))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_ids_decode() {
        assert_eq!(
            Location::from_legacy_id(CU_DEVICE_CPU),
            Some(Location::Host)
        );
        assert_eq!(Location::from_legacy_id(CU_DEVICE_INVALID), None);
        assert_eq!(Location::from_legacy_id(3), Some(Location::Device(3)));
        assert_eq!(Location::from_legacy_id(-7), None);
    }

    #[test]
    fn driver_form() {
        let d = Location::Device(2).to_cu();
        assert_eq!(
            (d.type_, d.id),
            (sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, 2)
        );
        let h = Location::Host.to_cu();
        assert_eq!(h.type_, sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST);
    }

    #[test]
    fn host_needs_no_driver_to_validate() {
        assert_eq!(Location::Host.validate().unwrap(), Location::Host);
    }
}
