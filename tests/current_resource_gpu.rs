//! The per-device current resource, `reinitialize`, and device memory info.

use std::sync::Arc;

use carve::current::{self, ReinitializeOptions};
use carve::{
    AsyncMemoryResource, AsyncPoolOptions, CudaMemoryResource, Device, DeviceBuffer, Error,
};

const MIB: usize = 1 << 20;

fn name_of(r: &carve::SharedResource) -> String {
    format!("{r:?}")
}

/// One test owns the process-wide current resource, so nothing races it.
#[test]
fn buffers_free_through_their_own_resource_after_the_current_one_changes() {
    let dev = carve::require_gpu!();
    let d = dev.ordinal();
    let count = Device::count().unwrap();
    assert!(name_of(&current::get(d).unwrap()).starts_with("CudaMemoryResource"));

    let pool = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    let previous = current::set(d, Arc::new(pool.clone())).unwrap();
    assert!(name_of(&previous).starts_with("CudaMemoryResource"));

    let stream = dev.new_stream().unwrap();
    let mut buf = DeviceBuffer::from_current(MIB, &stream).unwrap();
    buf.memset(0xAB).unwrap();
    assert_eq!(pool.allocation_count(), 1);

    let replaced = current::set(d, Arc::new(CudaMemoryResource::new(&dev))).unwrap();
    assert!(name_of(&replaced).starts_with("AsyncMemoryResource"));
    // No context current on this thread: the buffer must bind its own device to free.
    // SAFETY: clearing the calling thread's current context is always allowed.
    unsafe { carve::cudarc::driver::result::ctx::set_current(std::ptr::null_mut()) }.unwrap();
    assert!(buf.to_host_vec().unwrap().iter().all(|&b| b == 0xAB));
    buf.free().unwrap();
    stream.synchronize().unwrap();
    assert_eq!(pool.allocation_count(), 0);
    assert_eq!(pool.used_bytes().unwrap(), 0);

    // Bad ordinals.
    assert!(matches!(
        current::get(count),
        Err(Error::InvalidDevice { .. })
    ));
    assert!(matches!(
        current::set(count, Arc::new(CudaMemoryResource::new(&dev))),
        Err(Error::InvalidDevice { .. })
    ));

    // reinitialize: a limited pool, then managed memory; failures change nothing.
    let pooled = ReinitializeOptions {
        pool: true,
        initial_size: Some(16 * MIB),
        maximum_size: Some(64 * MIB),
        devices: vec![d],
        ..Default::default()
    };
    let old = current::reinitialize(&pooled).unwrap();
    assert_eq!(old.len(), 1);
    assert!(name_of(&old[0].1).starts_with("CudaMemoryResource"));
    let now = current::get(d).unwrap();
    let desc = name_of(&now);
    assert!(desc.starts_with("AsyncMemoryResource") && desc.contains("hard_limit: Some(67108864)"));
    let big = DeviceBuffer::from_current(128 * MIB, &stream).unwrap_err();
    assert!(big.is_out_of_memory(), "{big}");
    let small = DeviceBuffer::from_current(MIB, &stream).unwrap();

    let bad = ReinitializeOptions {
        devices: vec![d, count],
        ..Default::default()
    };
    let err = current::reinitialize(&bad).unwrap_err();
    assert!(matches!(err, Error::InvalidDevice { .. }), "{err}");
    assert!(Arc::ptr_eq(&current::get(d).unwrap(), &now), "{bad:?}");

    // A pool over managed memory: carve's suballocator, host-accessible blocks.
    let old = current::reinitialize(&ReinitializeOptions {
        pool: true,
        managed: true,
        initial_size: Some(4 * MIB),
        maximum_size: Some(8 * MIB),
        devices: vec![d],
    })
    .unwrap();
    assert!(Arc::ptr_eq(&old[0].1, &now));
    let managed_pool = current::get(d).unwrap();
    assert!(
        name_of(&managed_pool).starts_with("PoolMemoryResource"),
        "{managed_pool:?}"
    );
    assert!(managed_pool.properties().host_accessible);
    let in_pool = DeviceBuffer::from_current(MIB, &stream).unwrap();
    assert!(DeviceBuffer::from_current(16 * MIB, &stream)
        .unwrap_err()
        .is_out_of_memory());
    drop(in_pool);

    current::reinitialize(&ReinitializeOptions {
        managed: true,
        devices: vec![d],
        ..Default::default()
    })
    .unwrap();
    assert!(name_of(&current::get(d).unwrap()).starts_with("ManagedMemoryResource"));
    let pool_of_small = small.resource().clone();
    drop(small); // frees through the pool it came from, not the managed resource now current
    assert!(format!("{pool_of_small:?}").ends_with("allocated_bytes: 0 }"));
    current::reinitialize(&ReinitializeOptions::default()).unwrap();
    assert!(name_of(&current::get(d).unwrap()).starts_with("CudaMemoryResource"));
}

#[test]
fn memory_info_reports_free_and_total() {
    let dev = carve::require_gpu!();
    let count = Device::count().unwrap();
    let before = current::mem_info(dev.ordinal()).unwrap();
    eprintln!("device {}: {before:?}", dev.ordinal());
    assert!(before.total > 0 && before.free <= before.total);
    let stream = dev.new_stream().unwrap();
    let buf =
        DeviceBuffer::new(256 * MIB, &stream, Arc::new(CudaMemoryResource::new(&dev))).unwrap();
    let during = current::mem_info(dev.ordinal()).unwrap();
    assert!(
        before.free - during.free >= 256 * MIB,
        "{before:?} {during:?}"
    );
    drop(buf);
    assert!(matches!(
        current::mem_info(count),
        Err(Error::InvalidDevice { .. })
    ));
}
