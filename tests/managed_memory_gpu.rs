//! Managed memory: kernels and the host share it; prefetch and advice show in the attributes.

use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::{Advice, ManagedRange};
use carve::{
    CudaMemoryResource, Device, DeviceBuffer, Error, Location, ManagedBuffer,
    ManagedMemoryResource, MemoryResource, StreamRef,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const N: usize = 1 << 20; // 4 MiB of u32: far below any GPU's free memory.

#[test]
fn kernel_reads_and_writes_managed_memory_and_the_host_reads_it_back() {
    let dev = carve::require_gpu!();
    let mr = ManagedMemoryResource::new(&dev).unwrap();
    let init: Vec<u32> = (0..N as u32).map(|i| i.wrapping_mul(3)).collect();
    let mut buf = ManagedBuffer::from_slice(&mr, &init).unwrap();
    assert_eq!((mr.allocation_count(), mr.allocated_bytes()), (1, N * 4));
    let stream = dev.new_stream().unwrap();
    let kernels = dev.test_kernels().unwrap();

    buf.prefetch(Location::Device(dev.ordinal()), &stream)
        .unwrap();
    // SAFETY: N initialised u32s of managed memory; the host does not touch them until the
    // stream is synchronised.
    unsafe { kernels.smoke_add(&stream, buf.device_ptr(), N as u32, 7) }.unwrap();
    stream.synchronize().unwrap();
    let bad = (0..N).find(|&i| buf.as_slice()[i] != init[i].wrapping_add(7));
    assert_eq!(bad, None, "kernel read-modify-write not seen by the host");

    // Host writes, kernel reads them back through a second read-modify-write.
    buf.as_mut_slice()
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x = pattern(i as u32));
    // SAFETY: as above.
    unsafe { kernels.smoke_add(&stream, buf.device_ptr(), N as u32, 1) }.unwrap();
    stream.synchronize().unwrap();
    let bad = (0..N).find(|&i| buf.as_slice()[i] != pattern(i as u32).wrapping_add(1));
    assert_eq!(bad, None);

    buf.free().unwrap();
    assert_eq!((mr.allocation_count(), mr.allocated_bytes()), (0, 0));
}

#[test]
fn prefetch_location_shows_in_the_attributes() {
    let dev = carve::require_gpu!();
    let mr = ManagedMemoryResource::new(&dev).unwrap();
    let buf = ManagedBuffer::<u32>::zeroed(&mr, N).unwrap();
    let stream = dev.new_stream().unwrap();

    buf.prefetch(Location::Host, &stream).unwrap();
    stream.synchronize().unwrap();
    let a = buf.attributes().unwrap();
    assert_eq!(a.last_prefetch_location, Some(Location::Host), "{a:?}");

    buf.prefetch(Location::Device(dev.ordinal()), &stream)
        .unwrap();
    stream.synchronize().unwrap();
    let a = buf.attributes().unwrap();
    assert_eq!(
        a.last_prefetch_location,
        Some(Location::Device(dev.ordinal())),
        "{a:?}"
    );
    eprintln!("managed attributes after prefetch to the device: {a:?}");
}

#[test]
fn advice_shows_in_the_attributes() {
    let dev = carve::require_gpu!();
    let d = dev.ordinal();
    let mr = ManagedMemoryResource::new(&dev).unwrap();
    let buf = ManagedBuffer::<u32>::zeroed(&mr, N).unwrap();
    let fresh = buf.attributes().unwrap();
    assert!(
        !fresh.read_mostly && fresh.preferred_location.is_none(),
        "{fresh:?}"
    );
    assert!(fresh.accessed_by.is_empty(), "{fresh:?}");

    buf.advise(Advice::SetReadMostly).unwrap();
    assert!(buf.attributes().unwrap().read_mostly);
    buf.advise(Advice::UnsetReadMostly).unwrap();
    assert!(!buf.attributes().unwrap().read_mostly);

    buf.advise(Advice::SetPreferredLocation(Location::Device(d)))
        .unwrap();
    assert_eq!(
        buf.attributes().unwrap().preferred_location,
        Some(Location::Device(d))
    );
    buf.advise(Advice::SetPreferredLocation(Location::Host))
        .unwrap();
    assert_eq!(
        buf.attributes().unwrap().preferred_location,
        Some(Location::Host)
    );
    buf.advise(Advice::UnsetPreferredLocation).unwrap();
    assert_eq!(buf.attributes().unwrap().preferred_location, None);

    buf.advise(Advice::SetAccessedBy(d)).unwrap();
    assert_eq!(buf.attributes().unwrap().accessed_by, vec![d]);
    buf.advise(Advice::UnsetAccessedBy(d)).unwrap();
    assert!(buf.attributes().unwrap().accessed_by.is_empty());

    // Advice on part of the buffer: a sub-range reports it, the whole does not.
    let half = ManagedRange::new(buf.device_ptr(), N * 2).unwrap();
    half.advise(Advice::SetReadMostly).unwrap();
    assert!(half.attributes().unwrap().read_mostly);
    assert!(!buf.attributes().unwrap().read_mostly);
}

#[test]
fn non_managed_memory_and_bad_ordinals_are_typed_errors() {
    let dev = carve::require_gpu!();
    let count = Device::count().unwrap();
    let stream = dev.new_stream().unwrap();

    let device_mem =
        DeviceBuffer::new(4096, &stream, Arc::new(CudaMemoryResource::new(&dev))).unwrap();
    assert!(matches!(
        ManagedRange::of_buffer(&device_mem),
        Err(Error::NotManaged { .. })
    ));
    let pageable = vec![0u8; 4096];
    assert!(matches!(
        ManagedRange::new(pageable.as_ptr() as u64, pageable.len()),
        Err(Error::NotManaged { .. })
    ));

    // A managed range whose end runs past the allocation is refused too.
    let mr = ManagedMemoryResource::new(&dev).unwrap();
    let managed = DeviceBuffer::new(1 << 16, &stream, Arc::new(mr.clone())).unwrap();
    let range = ManagedRange::of_buffer(&managed).unwrap();
    range
        .prefetch(Location::Device(dev.ordinal()), &stream)
        .unwrap();
    stream.synchronize().unwrap();
    assert!(matches!(
        ManagedRange::new(managed.as_ptr(), (1 << 30) + 1),
        Err(Error::NotManaged { .. })
    ));

    let bad = Location::Device(count);
    assert!(matches!(
        range.prefetch(bad, &stream),
        Err(Error::InvalidDevice { ordinal, count: c }) if ordinal == count && c == count
    ));
    assert!(matches!(
        range.advise(Advice::SetAccessedBy(count + 7)),
        Err(Error::InvalidDevice { .. })
    ));
    assert!(matches!(
        range.advise(Advice::SetPreferredLocation(bad)),
        Err(Error::InvalidDevice { .. })
    ));
    assert!(matches!(
        ManagedMemoryResource::on(count),
        Err(Error::InvalidDevice { .. })
    ));
}

#[test]
fn foreign_double_and_mismatched_frees_are_refused() {
    let dev = carve::require_gpu!();
    let mr = ManagedMemoryResource::new(&dev).unwrap();
    let s = StreamRef::DEFAULT;
    assert!(matches!(mr.allocate(s, 0, 256), Err(Error::ZeroSize)));
    assert!(matches!(
        mr.allocate(s, 64, 3),
        Err(Error::InvalidAlignment(3))
    ));
    let p = mr.allocate(s, 4096, 256).unwrap();
    let mut local = 0u8;
    // SAFETY: deliberately bad frees; the resource must refuse them before the driver.
    unsafe {
        assert!(matches!(
            mr.deallocate(s, NonNull::from(&mut local), 4096, 256),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            mr.deallocate(s, p, 100, 256),
            Err(Error::SizeMismatch { .. })
        ));
        mr.deallocate(s, p, 4096, 256).unwrap();
        assert!(matches!(
            mr.deallocate(s, p, 4096, 256),
            Err(Error::UnknownPointer { .. })
        ));
    }
    assert_eq!(mr.allocation_count(), 0);
}
