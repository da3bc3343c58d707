//! Pinned host memory: every flag alone and together, mapped access from kernels, registration.

use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::HostRegistration;
use carve::{
    CudaMemoryResource, Device, DeviceBuffer, Error, HostMemoryResource, MemoryResource,
    PinnedBuffer, PinnedFlags, PinnedHostMemoryResource, Properties, StreamRef,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const N: usize = 1 << 18; // 1 MiB of u32

fn all_flag_sets() -> Vec<PinnedFlags> {
    (0..8)
        .map(|bits| PinnedFlags {
            portable: bits & 1 != 0,
            device_mapped: bits & 2 != 0,
            write_combined: bits & 4 != 0,
        })
        .collect()
}

#[test]
fn kernel_writes_through_a_mapped_pointer_and_the_host_sees_it_without_a_copy() {
    let dev = carve::require_gpu!();
    let mr = PinnedHostMemoryResource::new(&dev, PinnedFlags::DEVICE_MAPPED).unwrap();
    assert_eq!(mr.properties(), Properties::BOTH);
    let buf = PinnedBuffer::<u32>::zeroed(&mr, N).unwrap();
    let stream = dev.new_stream().unwrap();
    let dptr = buf.device_ptr().unwrap();
    // SAFETY: N mapped u32s; the host reads only after the stream is synchronised.
    unsafe {
        dev.test_kernels()
            .unwrap()
            .smoke_fill(&stream, dptr, N as u32)
    }
    .unwrap();
    stream.synchronize().unwrap();
    let bad = (0..N).find(|&i| buf.as_slice()[i] != pattern(i as u32));
    assert_eq!(bad, None);
}

#[test]
fn every_flag_combination_round_trips_through_the_device() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let kernels = dev.test_kernels().unwrap();
    let device_mr = Arc::new(CudaMemoryResource::new(&dev));
    for flags in all_flag_sets() {
        let mr = PinnedHostMemoryResource::new(&dev, flags).unwrap();
        let expected = if flags.device_mapped {
            Properties::BOTH
        } else {
            Properties::HOST
        };
        assert_eq!(mr.properties(), expected, "{flags:?}");

        // Host -> device -> host, through this pinned memory at both ends.
        let data: Vec<u32> = (0..N as u32).map(|i| pattern(i) ^ 0x5555).collect();
        let mut pinned = PinnedBuffer::from_slice(&mr, &data).unwrap();
        assert_eq!(pinned.as_slice(), &data[..], "{flags:?}");
        let mut dbuf = DeviceBuffer::new(N * 4, &stream, device_mr.clone()).unwrap();
        dbuf.copy_from_host(bytemuck::cast_slice(pinned.as_slice()))
            .unwrap();
        pinned.as_mut_slice().fill(0);
        dbuf.copy_to_host(bytemuck::cast_slice_mut(pinned.as_mut_slice()))
            .unwrap();
        assert_eq!(pinned.as_slice(), &data[..], "{flags:?}");

        // Mapped: a kernel writes it in place. Otherwise there is no device pointer.
        if flags.device_mapped {
            let dptr = pinned.device_ptr().unwrap();
            // SAFETY: N mapped u32s; read after the stream is synchronised.
            unsafe { kernels.smoke_fill(&stream, dptr, N as u32) }.unwrap();
            stream.synchronize().unwrap();
            let bad = (0..N).find(|&i| pinned.as_slice()[i] != pattern(i as u32));
            assert_eq!(bad, None, "{flags:?}");
        } else {
            assert!(
                matches!(pinned.device_ptr(), Err(Error::Unsupported(_))),
                "{flags:?}"
            );
        }
        pinned.free().unwrap();
        assert_eq!(mr.allocation_count(), 0, "{flags:?}");
    }
}

#[test]
fn registered_host_memory_is_mapped_for_kernels() {
    let dev = carve::require_gpu!();
    let host = HostMemoryResource::new();
    let bytes = N * 4;
    let p = host.allocate(StreamRef::DEFAULT, bytes, 4096).unwrap();
    // SAFETY: `bytes` fresh host bytes, zeroed before use and freed only at the end.
    let mem = unsafe {
        p.as_ptr().write_bytes(0, bytes);
        std::slice::from_raw_parts_mut(p.as_ptr(), bytes)
    };
    {
        let reg = HostRegistration::new(
            &dev,
            mem,
            PinnedFlags::DEVICE_MAPPED | PinnedFlags::PORTABLE,
        )
        .unwrap();
        let stream = dev.new_stream().unwrap();
        // SAFETY: the registered range holds N u32s; read after synchronising.
        unsafe {
            dev.test_kernels()
                .unwrap()
                .smoke_fill(&stream, reg.device_ptr().unwrap(), N as u32)
        }
        .unwrap();
        stream.synchronize().unwrap();
        let words: &[u32] = bytemuck::cast_slice(reg.as_slice());
        assert_eq!((0..N).find(|&i| words[i] != pattern(i as u32)), None);
        reg.unregister().unwrap();
    }
    // SAFETY: unregistered above; allocated with this size and alignment.
    unsafe { host.deallocate(StreamRef::DEFAULT, p, bytes, 4096) }.unwrap();
}

#[test]
fn registration_of_an_unaligned_vec_pins_it_for_copies() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let mut v: Vec<u8> = (0..100_003u32).map(|i| (i % 251) as u8).collect();
    let expect = v.clone();
    let mut reg = HostRegistration::new(&dev, &mut v[3..], PinnedFlags::NONE).unwrap();
    assert!(matches!(reg.device_ptr(), Err(Error::Unsupported(_))));
    let mut dbuf =
        DeviceBuffer::new(reg.len(), &stream, Arc::new(CudaMemoryResource::new(&dev))).unwrap();
    dbuf.copy_from_host(reg.as_slice()).unwrap();
    reg.as_mut_slice().fill(0);
    dbuf.copy_to_host(reg.as_mut_slice()).unwrap();
    drop(reg);
    assert_eq!(v, expect);
}

#[test]
fn registration_refuses_bad_input() {
    let dev = carve::require_gpu!();
    let mut empty: [u8; 0] = [];
    assert!(matches!(
        HostRegistration::new(&dev, &mut empty, PinnedFlags::NONE),
        Err(Error::ZeroSize)
    ));
    let mut some = vec![0u8; 4096];
    assert!(matches!(
        HostRegistration::new(&dev, &mut some, PinnedFlags::WRITE_COMBINED),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn bad_requests_and_frees_are_refused() {
    let dev = carve::require_gpu!();
    let mr = PinnedHostMemoryResource::new(&dev, PinnedFlags::PORTABLE).unwrap();
    let s = StreamRef::DEFAULT;
    assert!(matches!(mr.allocate(s, 0, 8), Err(Error::ZeroSize)));
    assert!(matches!(
        mr.allocate(s, 64, 2 * carve::resource::PINNED_ALIGNMENT),
        Err(Error::Unsupported(_))
    ));
    let p = mr.allocate(s, 10_000, 256).unwrap();
    assert_eq!(p.as_ptr() as usize % 256, 0);
    let mut local = 0u8;
    // SAFETY: deliberately bad frees, refused before the driver sees them.
    unsafe {
        assert!(matches!(
            mr.deallocate(s, NonNull::from(&mut local), 10_000, 256),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            mr.deallocate(s, p, 1, 256),
            Err(Error::SizeMismatch { .. })
        ));
        mr.deallocate(s, p, 10_000, 256).unwrap();
        assert!(matches!(
            mr.deallocate(s, p, 10_000, 256),
            Err(Error::UnknownPointer { .. })
        ));
    }
    assert!(matches!(
        PinnedHostMemoryResource::new(&Device::get(0).unwrap(), PinnedFlags::NONE)
            .unwrap()
            .device_pointer(NonNull::from(&mut local)),
        Err(Error::Unsupported(_))
    ));
}

#[test]
fn the_driver_records_every_flag_asked_for() {
    let dev = carve::require_gpu!();
    for flags in all_flag_sets() {
        let mr = PinnedHostMemoryResource::new(&dev, flags).unwrap();
        let buf = PinnedBuffer::<u8>::zeroed(&mr, 4096).unwrap();
        let got = buf.driver_flags().unwrap();
        // With unified addressing the driver may add portable and mapped; never write-combined.
        assert_eq!(
            got.alloc_bits() & flags.alloc_bits(),
            flags.alloc_bits(),
            "{flags:?}"
        );
        assert_eq!(got.write_combined, flags.write_combined, "{flags:?}");
    }
    let empty = PinnedBuffer::<u8>::zeroed(
        &PinnedHostMemoryResource::new(&dev, PinnedFlags::NONE).unwrap(),
        0,
    )
    .unwrap();
    assert!(matches!(empty.driver_flags(), Err(Error::ZeroSize)));
}
