//! GPU tests of the walking skeleton: the cuda resource, buffers, streams, the smoke kernel.
//! Each skips (saying why) without a GPU, and fails instead under CARVE_REQUIRE_GPU=1.

use std::sync::Arc;

use carve::{
    require_gpu, CudaMemoryResource, Device, DeviceBuffer, DeviceVec, Error, MemoryResource,
    SharedResource, StreamRef,
};
use carve_lab::DeviceTestKernels;

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

#[test]
fn cuda_resource_allocates_distinct_aligned_blocks() {
    let dev = require_gpu!();
    let mr = CudaMemoryResource::new(&dev);
    let s = dev.new_stream().unwrap();
    let blocks: Vec<_> = (1..=64usize)
        .map(|i| (mr.allocate(s.as_ref(), i * 1000, 256).unwrap(), i * 1000))
        .collect();
    let mut spans: Vec<(usize, usize)> = blocks
        .iter()
        .map(|(p, n)| (p.as_ptr() as usize, *n))
        .collect();
    spans.sort();
    for w in spans.windows(2) {
        assert!(w[0].0 + w[0].1 <= w[1].0, "blocks overlap: {w:?}");
    }
    assert!(spans.iter().all(|(p, _)| p % 256 == 0));
    for (p, n) in blocks {
        // SAFETY: each block came from `mr` with this size and is freed once.
        unsafe { mr.deallocate(s.as_ref(), p, n, 256) }.unwrap();
    }
}

#[test]
fn cuda_resource_rejects_bad_input() {
    let dev = require_gpu!();
    let mr = CudaMemoryResource::new(&dev);
    let s = StreamRef::DEFAULT;
    assert!(matches!(mr.allocate(s, 0, 256), Err(Error::ZeroSize)));
    assert!(matches!(
        mr.allocate(s, 64, 48),
        Err(Error::InvalidAlignment(48))
    ));
    assert!(matches!(
        mr.allocate(s, 64, 4096),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(
        mr.allocate(s, usize::MAX, 256),
        Err(Error::SizeOverflow { .. })
    ));
    let huge = mr.allocate(s, 1 << 50, 256).unwrap_err();
    assert!(
        matches!(huge, Error::OutOfMemory { bytes, .. } if bytes == 1 << 50),
        "{huge}"
    );

    let p = mr.allocate(s, 4096, 256).unwrap();
    let interior = std::ptr::NonNull::new(p.as_ptr().wrapping_add(256)).unwrap();
    // SAFETY: an interior pointer on purpose: the driver must refuse it without freeing.
    let err = unsafe { mr.deallocate(s, interior, 4096, 256) }.unwrap_err();
    assert!(matches!(err, Error::UnknownPointer { .. }), "{err}");
    // SAFETY: the real block, freed once.
    unsafe { mr.deallocate(s, p, 4096, 256) }.unwrap();
}

#[test]
fn bad_device_ordinal_is_a_typed_error() {
    let _dev = require_gpu!();
    let count = Device::count().unwrap();
    match Device::get(count + 3) {
        Err(Error::InvalidDevice { ordinal, count: c }) => {
            assert_eq!((ordinal, c), (count + 3, count))
        }
        other => panic!("expected InvalidDevice, got {other:?}"),
    }
    assert!(CudaMemoryResource::on(count).is_err());
}

#[test]
fn device_properties_are_plausible() {
    let dev = require_gpu!();
    let p = dev.properties().unwrap();
    assert!(!p.name.is_empty());
    assert!(p.compute_capability.0 >= 7, "{p:?}");
    assert!(p.free_memory <= p.total_memory && p.total_memory > 0);
    assert!(p.multiprocessors > 0);
}

#[test]
fn buffer_round_trips_bytes_on_a_stream() {
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let data: Vec<u8> = (0..1_000_003u32).map(|i| (i * 31 % 251) as u8).collect();
    let buf = DeviceBuffer::from_slice(&data, &s, cuda(&dev)).unwrap();
    assert_eq!(buf.len(), data.len());
    assert_eq!(buf.as_ptr() % 256, 0);
    assert_eq!(buf.to_host_vec().unwrap(), data);

    let mut small = DeviceBuffer::new(16, &s, cuda(&dev)).unwrap();
    assert!(matches!(
        small.copy_from_host(&[0u8; 17]),
        Err(Error::InvalidArgument(_))
    ));
    small.memset(0x5A).unwrap();
    assert_eq!(small.to_host_vec().unwrap(), vec![0x5A; 16]);
    buf.free().unwrap();
}

#[test]
fn empty_buffers_allocate_nothing() {
    let dev = require_gpu!();
    let s = dev.default_stream();
    let v = DeviceVec::<u64>::new(0, &s, cuda(&dev)).unwrap();
    assert!(v.is_empty());
    assert_eq!(v.as_ptr(), 0);
    assert_eq!(v.to_vec().unwrap(), Vec::<u64>::new());
}

#[test]
fn smoke_kernel_writes_every_element() {
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let n = (1u32 << 20) + 3; // not a multiple of the block size
    let mut v = DeviceVec::<u32>::zeroed(n as usize, &s, cuda(&dev)).unwrap();
    // SAFETY: `v` holds n u32s on this device and nothing else uses it until we read back.
    unsafe { dev.test_kernels().unwrap().smoke_fill(&s, v.as_ptr(), n) }.unwrap();
    let host = v.to_vec().unwrap();
    for (i, x) in host.iter().enumerate() {
        assert_eq!(*x, carve_kernels::smoke::pattern(i as u32), "element {i}");
    }
    // The copy above waited for the kernel, so the buffer can go.
    v.copy_from_host(&[0u32; 4]).unwrap();
    assert_eq!(
        &v.to_vec().unwrap()[..5],
        &[0, 0, 0, 0, carve_kernels::smoke::pattern(4)]
    );
}

#[test]
fn buffer_frees_through_its_resource_on_its_stream() {
    let dev = require_gpu!();
    let before = dev.mem_info().unwrap().free;
    let s = dev.new_stream().unwrap();
    let bufs: Vec<_> = (0..8)
        .map(|_| DeviceBuffer::new(64 << 20, &s, cuda(&dev)).unwrap())
        .collect();
    let during = dev.mem_info().unwrap().free;
    assert!(
        before - during >= 8 * (64 << 20) - (16 << 20),
        "{before} -> {during}"
    );
    drop(bufs);
    let after = dev.mem_info().unwrap().free;
    assert!(
        after + (16 << 20) >= before,
        "memory not returned: {before} -> {after}"
    );
}
