//! Prefetch, advice and range attributes on managed memory (`carve::resource::ManagedRange`),
//! for `carve.torch`'s unified-memory functions. Locations are ints as CUDA's runtime spells
//! them: a device ordinal, or -1 (`cudaCpuDeviceId`) for the CPU.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use carve::resource::{Advice, ManagedRange};
use carve::{Device, Error, Location};

use crate::errors::to_py;
use crate::stream::HeldStream;

fn err(e: Error) -> PyErr {
    to_py(e.into())
}

/// -1 is the CPU; other negative values are refused.
fn location(id: i64) -> Result<Location, Error> {
    match id {
        -1 => Ok(Location::Host),
        id if id >= 0 => Ok(Location::Device(id as usize)),
        id => Err(Error::InvalidArgument(format!(
            "location {id}: expected a device ordinal or -1 for the CPU"
        ))),
    }
}

fn location_id(l: Option<Location>) -> Option<i64> {
    l.map(|l| match l {
        Location::Host => -1,
        Location::Device(d) => d as i64,
    })
}

/// True when the first and last bytes of `[ptr, ptr + nbytes)` are managed memory.
#[pyfunction]
fn managed_is_managed(py: Python<'_>, ptr: u64, nbytes: usize) -> PyResult<bool> {
    match py.detach(|| ManagedRange::new(ptr, nbytes)) {
        Ok(_) => Ok(true),
        Err(Error::NotManaged { .. }) => Ok(false),
        Err(e) => Err(err(e)),
    }
}

/// Queues a migration of `[ptr, ptr + nbytes)` to `location` on `stream`, which belongs to
/// `device`.
#[pyfunction]
#[pyo3(signature = (ptr, nbytes, location, device, stream))]
fn managed_prefetch(
    py: Python<'_>,
    ptr: u64,
    nbytes: usize,
    location: i64,
    device: usize,
    stream: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let to = self::location(location).map_err(err)?;
    let held = HeldStream::extract(stream)?;
    py.detach(|| {
        let range = ManagedRange::new(ptr, nbytes)?;
        range.prefetch_on(to, &Device::get(device)?, held.for_call())
    })
    .map_err(err)
}

/// Gives the driver `advice` for `[ptr, ptr + nbytes)`: "preferred_location" and
/// "accessed_by" with a location, their "unset_" forms, "read_mostly", "unset_read_mostly".
#[pyfunction]
#[pyo3(signature = (ptr, nbytes, advice, location = None))]
fn managed_advise(
    py: Python<'_>,
    ptr: u64,
    nbytes: usize,
    advice: &str,
    location: Option<i64>,
) -> PyResult<()> {
    let at = || {
        location.map(self::location).unwrap_or_else(|| {
            Err(Error::InvalidArgument(format!(
                "advice {advice:?} needs a location"
            )))
        })
    };
    let device = || match at()? {
        Location::Device(d) => Ok(d),
        Location::Host => Err(Error::InvalidArgument(format!(
            "advice {advice:?} needs a device, not the CPU"
        ))),
    };
    let advice = match advice {
        "preferred_location" => Advice::SetPreferredLocation(at().map_err(err)?),
        "unset_preferred_location" => Advice::UnsetPreferredLocation,
        "accessed_by" => Advice::SetAccessedBy(device().map_err(err)?),
        "unset_accessed_by" => Advice::UnsetAccessedBy(device().map_err(err)?),
        "read_mostly" => Advice::SetReadMostly,
        "unset_read_mostly" => Advice::UnsetReadMostly,
        other => {
            return Err(err(Error::InvalidArgument(format!(
                "unknown advice {other:?}"
            ))))
        }
    };
    py.detach(|| ManagedRange::new(ptr, nbytes)?.advise(advice))
        .map_err(err)
}

/// The range's attributes (`cuMemRangeGetAttribute`): `read_mostly`, `preferred_location` and
/// `last_prefetch_location` (an int, -1 for the CPU, None for none) and `accessed_by` (a
/// sorted list of devices).
#[pyfunction]
fn managed_range_attributes(
    py: Python<'_>,
    ptr: u64,
    nbytes: usize,
) -> PyResult<Bound<'_, PyDict>> {
    let a = py
        .detach(|| ManagedRange::new(ptr, nbytes)?.attributes())
        .map_err(err)?;
    let d = PyDict::new(py);
    d.set_item("read_mostly", a.read_mostly)?;
    d.set_item("preferred_location", location_id(a.preferred_location))?;
    d.set_item("accessed_by", a.accessed_by)?;
    d.set_item(
        "last_prefetch_location",
        location_id(a.last_prefetch_location),
    )?;
    Ok(d)
}

/// Adds this module's functions to the extension module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(managed_is_managed, m)?)?;
    m.add_function(wrap_pyfunction!(managed_prefetch, m)?)?;
    m.add_function(wrap_pyfunction!(managed_advise, m)?)?;
    m.add_function(wrap_pyfunction!(managed_range_attributes, m)?)?;
    Ok(())
}
