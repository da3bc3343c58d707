//! GPU tests of what NCCL asks of registered memory: chunks at the driver's recommended
//! granularity, created with POSIX-descriptor (and, where offered, fabric) handles, each one
//! driver allocation that the segment callback announces. Each skips (saying why) without a
//! GPU, and fails instead under CARVE_REQUIRE_GPU=1.

use std::sync::{Arc, Mutex};

use carve::cudarc::driver::sys;
use carve::resource::{
    CudaBackingOptions, ExpandableOptions, Fabric, Granularity, SegmentCallback, SegmentChange,
    SegmentEvent, VirtualOptions,
};
use carve::{
    require_gpu, Device, Error, ExpandableMemoryResource, MemoryResource, VirtualMemoryResource,
};

const MIB: usize = 1 << 20;

fn nccl_backing(fabric: Fabric) -> CudaBackingOptions {
    CudaBackingOptions {
        exportable: true,
        fabric,
        granularity: Granularity::Recommended,
        ..CudaBackingOptions::default()
    }
}

/// The handle types the driver records for the allocation mapped at `addr`, and its range.
fn allocation_at(dev: &Device, addr: usize) -> (u32, usize, usize) {
    dev.bind().unwrap();
    let (mut base, mut size) = (0, 0);
    // SAFETY: valid out-slots; a context is current.
    let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr as _) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    let mut handle = 0;
    // SAFETY: `addr` is mapped (checked above); the retained handle is released below.
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut handle, addr as *mut _) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: all-zero is a valid bit pattern for this plain C struct (an out-slot).
    let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: a live handle and a valid out-slot.
    let r = unsafe { sys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    // SAFETY: retained above, released once.
    let r = unsafe { sys::cuMemRelease(handle) };
    assert_eq!(r, sys::CUresult::CUDA_SUCCESS);
    (prop.requestedHandleTypes.0, base as usize, size)
}

#[test]
fn recommended_granularity_and_fabric_where_supported() {
    let dev = require_gpu!();
    let minimum = match carve::resource::CudaBacking::new(&dev, CudaBackingOptions::default()) {
        Ok(b) => carve::resource::PhysicalBacking::granularity(&b),
        Err(Error::Unsupported(why)) => return eprintln!("SKIPPED: {why}"),
        Err(e) => panic!("{e}"),
    };
    let b = match carve::resource::CudaBacking::new(&dev, nccl_backing(Fabric::WhereSupported)) {
        Ok(b) => b,
        Err(Error::Unsupported(why)) => return eprintln!("SKIPPED: {why}"),
        Err(e) => panic!("{e}"),
    };
    let recommended = carve::resource::PhysicalBacking::granularity(&b);
    eprintln!(
        "granularity: minimum {minimum}, recommended {recommended}; fabric handles: {}",
        b.fabric()
    );
    assert!(recommended >= minimum && recommended % minimum == 0);
    match carve::resource::CudaBacking::new(&dev, nccl_backing(Fabric::Required)) {
        Ok(r) => assert!(r.fabric()),
        Err(Error::Unsupported(why)) => {
            assert!(!b.fabric(), "probed fabric yet required fails: {why}");
        }
        Err(e) => panic!("{e}"),
    }
}

/// Every segment the callback announces is exactly one driver allocation, with POSIX
/// descriptors (and fabric handles when the backing has them) among its handle types: what
/// `ncclCommRegister` exports to its peers.
#[test]
fn announced_segments_are_whole_exportable_allocations() {
    let dev = require_gpu!();
    let log: Arc<Mutex<Vec<SegmentEvent>>> = Arc::default();
    let l = log.clone();
    let cb: SegmentCallback = Arc::new(move |e| l.lock().unwrap().push(e));
    let options = ExpandableOptions {
        on_segment: Some(cb),
        ..ExpandableOptions::default()
    };
    let backing = nccl_backing(Fabric::WhereSupported);
    let r = match ExpandableMemoryResource::on_device(&dev, backing, options) {
        Ok(r) => r,
        Err(Error::Unsupported(why)) => return eprintln!("SKIPPED: {why}"),
        Err(e) => panic!("{e}"),
    };
    let fabric = r.backing().fabric();
    let blocks: Vec<_> = [4096, 3 * MIB, 70 * MIB]
        .iter()
        .map(|&n| (r.allocate_sync(n, 256).unwrap(), n))
        .collect();
    let events = std::mem::take(&mut *log.lock().unwrap());
    assert!(!events.is_empty());
    for e in &events {
        assert_eq!(e.change, SegmentChange::Mapped);
        let (types, base, size) = allocation_at(&dev, e.addr);
        assert_eq!((base, size), (e.addr, e.size), "{e:?}");
        assert_ne!(types & 1, 0, "POSIX descriptor handles: {types:#x}");
        assert_eq!(types & 8 != 0, fabric, "fabric handles: {types:#x}");
    }
    for (p, n) in blocks {
        // SAFETY: from `r` with these arguments.
        unsafe { r.deallocate_sync(p, n, 256) }.unwrap();
    }
    let trimmed = r.trim().unwrap();
    let gone = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(gone.iter().map(|e| e.size).sum::<usize>(), trimmed);
    assert!(gone.iter().all(|e| e.change == SegmentChange::Unmapped));
    assert_eq!(r.segment_callback_panics(), 0);
    let v =
        VirtualMemoryResource::on_device(&dev, nccl_backing(Fabric::Off), VirtualOptions::new())
            .unwrap();
    let p = v.allocate_sync(MIB, 256).unwrap();
    let (types, _, _) = allocation_at(&dev, p.as_ptr() as usize);
    assert_eq!(types, 1, "descriptors only without fabric");
    // SAFETY: from `v` with these arguments.
    unsafe { v.deallocate_sync(p, MIB, 256) }.unwrap();
}
