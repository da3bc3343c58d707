//! Building the virtual-memory resources (the expandable pool, whole-chunk virtual memory) and
//! the graph-safe resource, on a device or over host virtual memory (no GPU needed).

use std::ffi::CStr;
use std::sync::Arc;

use carve::resource::{CudaBackingOptions, ExpandableOptions, Fabric, Granularity, VirtualOptions};
use carve::{
    Device, ExpandableMemoryResource, GraphSafeMemoryResource, SharedResource,
    VirtualMemoryResource,
};

use crate::error::{FfiError, FfiResult};
use crate::registry::Entry;
use crate::vm_export::ChunkExporter;

/// The expandable pool's sizes; `None` picks the resource's default.
#[derive(Clone, Copy, Debug, Default)]
pub struct ExpandableSizes {
    /// The most physical bytes held at once (a device's memory when `None`; required on host).
    pub maximum: Option<usize>,
    /// Requests up to this many bytes go to the small range.
    pub small_limit: Option<usize>,
    /// The small range's page.
    pub small_chunk: Option<usize>,
    /// The large range's page.
    pub large_chunk: Option<usize>,
    /// Growth allowed above the most bytes ever live, as a fraction of them (0 to 1).
    pub headroom: Option<f64>,
    /// Chunks exportable as POSIX file descriptors (device only; see [`crate::vm_share`]).
    pub exportable: bool,
    /// Fabric handles on the chunks (device only).
    pub fabric: Fabric,
    /// The chunk granularity (device only).
    pub granularity: Granularity,
}

impl ExpandableSizes {
    fn options(&self) -> FfiResult<ExpandableOptions> {
        if let Some(h) = self.headroom {
            if !(0.0..=1.0).contains(&h) {
                return Err(FfiError::invalid(format!(
                    "expandable headroom {h}: a fraction between 0 and 1"
                )));
            }
        }
        Ok(ExpandableOptions {
            maximum: self.maximum,
            small_limit: self.small_limit,
            small_chunk: self.small_chunk,
            large_chunk: self.large_chunk,
            headroom: self.headroom,
            ..ExpandableOptions::default()
        })
    }
}

/// Whole-chunk virtual memory's sizes; `None` picks the resource's default.
#[derive(Clone, Copy, Debug, Default)]
pub struct VirtualSizes {
    /// The most physical bytes mapped at once (a device's memory when `None`; required on host).
    pub maximum: Option<usize>,
    /// Bytes per chunk (a power-of-two multiple of the granularity).
    pub chunk_size: Option<usize>,
    /// Bytes of address space reserved.
    pub reserve: Option<usize>,
    /// Chunks exportable as POSIX file descriptors (device only; see [`crate::vm_share`]).
    pub exportable: bool,
    /// Fabric handles on the chunks (device only).
    pub fabric: Fabric,
    /// The chunk granularity (device only).
    pub granularity: Granularity,
}

impl VirtualSizes {
    fn options(&self) -> VirtualOptions {
        VirtualOptions {
            maximum: self.maximum,
            chunk_size: self.chunk_size,
            reserve: self.reserve,
            ..VirtualOptions::default()
        }
    }
}

#[cfg(target_os = "linux")]
fn host_backing(granularity: usize) -> FfiResult<carve::resource::HostBacking> {
    Ok(carve::resource::HostBacking::new(granularity)?)
}

#[cfg(not(target_os = "linux"))]
fn host_backing(_granularity: usize) -> FfiResult<carve::resource::SimulatedBacking> {
    Err(carve::Error::Unsupported("host virtual memory needs Linux".to_owned()).into())
}

fn backing_options(
    exportable: bool,
    fabric: Fabric,
    granularity: Granularity,
) -> CudaBackingOptions {
    CudaBackingOptions {
        exportable,
        fabric,
        granularity,
        ..CudaBackingOptions::default()
    }
}

/// An entry whose chunks `carve_vm_export_chunk` can export.
fn exporting<R: ChunkExporter + carve::MemoryResource + Clone + 'static>(
    kind: &'static CStr,
    r: R,
) -> Arc<Entry> {
    Arc::new(Entry {
        kind,
        resource: Arc::new(r.clone()),
        driver_pool: None,
        chunks: Some(Arc::new(r)),
    })
}

fn need_maximum(maximum: Option<usize>, what: &str) -> FfiResult<()> {
    match maximum {
        Some(_) => Ok(()),
        None => Err(FfiError::invalid(format!(
            "{what} over host memory needs a maximum size"
        ))),
    }
}

/// The expandable pool on `device` (the driver's virtual memory management).
pub fn expandable(device: usize, sizes: &ExpandableSizes) -> FfiResult<Arc<Entry>> {
    let options = sizes.options()?;
    let r = ExpandableMemoryResource::on_device(
        &Device::get(device)?,
        backing_options(sizes.exportable, sizes.fabric, sizes.granularity),
        options,
    )?;
    Ok(exporting(c"expandable", r))
}

/// The expandable pool over host virtual memory with pages of `granularity` bytes.
pub fn expandable_host(granularity: usize, sizes: &ExpandableSizes) -> FfiResult<Arc<Entry>> {
    let options = sizes.options()?;
    need_maximum(sizes.maximum, "the expandable pool")?;
    let r = ExpandableMemoryResource::new(host_backing(granularity)?, options)?;
    Ok(exporting(c"expandable", r))
}

/// Whole-chunk virtual memory on `device`.
pub fn virtual_memory(device: usize, sizes: &VirtualSizes) -> FfiResult<Arc<Entry>> {
    let r = VirtualMemoryResource::on_device(
        &Device::get(device)?,
        backing_options(sizes.exportable, sizes.fabric, sizes.granularity),
        sizes.options(),
    )?;
    Ok(exporting(c"virtual", r))
}

/// Whole-chunk virtual memory over host virtual memory with pages of `granularity` bytes.
pub fn virtual_host(granularity: usize, sizes: &VirtualSizes) -> FfiResult<Arc<Entry>> {
    need_maximum(sizes.maximum, "virtual memory")?;
    let r = VirtualMemoryResource::new(host_backing(granularity)?, sizes.options())?;
    Ok(exporting(c"virtual", r))
}

/// Allocation that is safe inside CUDA graph capture, over `upstream`.
pub fn graph_safe(upstream: &Entry) -> Arc<Entry> {
    let up: SharedResource = upstream.resource.clone();
    Entry::new(c"graph_safe", Arc::new(GraphSafeMemoryResource::new(up)))
}
