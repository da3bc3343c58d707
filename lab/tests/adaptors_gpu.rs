//! The adaptors over device memory. Each test skips (saying why) without a GPU, and fails
//! instead under CARVE_REQUIRE_GPU=1.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use carve::adaptor::{
    AlignedResourceAdaptor, FailureCallbackResourceAdaptor, LimitingResourceAdaptor,
    LoggingResourceAdaptor, PrefetchResourceAdaptor, StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
};
use carve::{
    require_gpu, CudaMemoryResource, Error, ManagedMemoryResource, MemoryResource, StreamRef,
};
use carve_lab::DeviceTestKernels;

#[test]
fn limiting_and_statistics_over_device_memory() {
    let dev = require_gpu!();
    let stats = StatisticsResourceAdaptor::new(CudaMemoryResource::new(&dev));
    let mr = LimitingResourceAdaptor::new(stats.clone(), 8 << 20);
    let s = dev.new_stream().unwrap();
    let a = mr.allocate(s.as_ref(), 6 << 20, 256).unwrap();
    let err = mr.allocate(s.as_ref(), 4 << 20, 256).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert_eq!(stats.allocations_counter().total, 1);
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(s.as_ref(), a, 6 << 20, 256) }.unwrap();
    let b = mr.allocate(s.as_ref(), 4 << 20, 256).unwrap();
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(s.as_ref(), b, 4 << 20, 256) }.unwrap();
    let bytes = stats.bytes_counter();
    assert_eq!(
        (bytes.value, bytes.peak, bytes.total),
        (0, 6 << 20, 10 << 20)
    );
}

#[test]
fn tracking_stops_a_device_double_free() {
    let dev = require_gpu!();
    let stats = StatisticsResourceAdaptor::new(CudaMemoryResource::new(&dev));
    let mr = TrackingResourceAdaptor::new(stats.clone(), true);
    let p = mr.allocate(StreamRef::DEFAULT, 1 << 20, 256).unwrap();
    assert_eq!(mr.allocation_count(), 1);
    // SAFETY: one correct free, then a double free that must stop at the tracking layer.
    unsafe {
        mr.deallocate(StreamRef::DEFAULT, p, 1 << 20, 256).unwrap();
        assert!(matches!(
            mr.deallocate(StreamRef::DEFAULT, p, 1 << 20, 256),
            Err(Error::DoubleFree { .. })
        ));
    }
    assert_eq!(stats.allocations_counter().total, 1);
    assert_eq!(
        stats.bytes_counter().value,
        0,
        "the driver saw exactly one free"
    );
}

#[test]
fn aligned_gives_the_cuda_resource_large_alignments() {
    let dev = require_gpu!();
    let cuda = CudaMemoryResource::new(&dev);
    assert!(cuda.allocate(StreamRef::DEFAULT, 4096, 65536).is_err());
    let mr = AlignedResourceAdaptor::new(cuda, 65536, 0).unwrap();
    let blocks: Vec<_> = (1..16)
        .map(|i| {
            (
                mr.allocate(StreamRef::DEFAULT, i * 10_000, 256).unwrap(),
                i * 10_000,
            )
        })
        .collect();
    let k = dev.test_kernels().unwrap();
    let s = dev.new_stream().unwrap();
    for (p, n) in &blocks {
        assert_eq!(p.as_ptr() as usize % 65536, 0);
        // SAFETY: `n` bytes of device memory from the aligned pointer; n/4 u32s fit.
        unsafe { k.smoke_fill(&s, p.as_ptr() as u64, (*n / 4) as u32) }.unwrap();
    }
    s.synchronize().unwrap();
    for (p, n) in blocks {
        // SAFETY: from `mr`, freed once, after the kernels finished.
        unsafe { mr.deallocate(StreamRef::DEFAULT, p, n, 256) }.unwrap();
    }
}

#[test]
fn failure_callback_recovers_from_a_device_limit() {
    let dev = require_gpu!();
    let limited = LimitingResourceAdaptor::new(CudaMemoryResource::new(&dev), 4 << 20);
    let held = limited.allocate(StreamRef::DEFAULT, 4 << 20, 256).unwrap();
    let held_addr = AtomicUsize::new(held.as_ptr().expose_provenance());
    let calls = Arc::new(AtomicUsize::new(0));
    let mr = {
        let (limited, calls) = (limited.clone(), calls.clone());
        FailureCallbackResourceAdaptor::new(limited.clone(), move |_| {
            calls.fetch_add(1, Ordering::SeqCst);
            let addr = held_addr.swap(0, Ordering::SeqCst);
            let Some(p) = NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(addr)) else {
                return false;
            };
            // SAFETY: the held block came from `limited` as 4 MiB and is freed once.
            unsafe { limited.deallocate(StreamRef::DEFAULT, p, 4 << 20, 256) }.is_ok()
        })
    };
    let p = mr.allocate(StreamRef::DEFAULT, 2 << 20, 256).unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(StreamRef::DEFAULT, p, 2 << 20, 256) }.unwrap();
    assert_eq!(limited.allocated_bytes(), 0);
}

#[test]
fn logging_records_real_streams() {
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let dir = std::env::temp_dir().join(format!("carve-gpu-log-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("log.csv");
    let mr = LoggingResourceAdaptor::to_file(CudaMemoryResource::new(&dev), &path, true).unwrap();
    let p = mr.allocate(s.as_ref(), 1000, 256).unwrap();
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(s.as_ref(), p, 1000, 256) }.unwrap();
    let events = carve_lab::replay::read_log(&path).unwrap();
    assert_eq!(events.len(), 2);
    assert_eq!(events[0].stream, s.as_ref().id().get() as u64);
    assert_eq!(events[0].ptr, p.as_ptr() as u64);
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn prefetch_moves_managed_memory_and_refuses_device_memory() {
    let dev = require_gpu!();
    let s = dev.new_stream().unwrap();
    let mr = PrefetchResourceAdaptor::new(ManagedMemoryResource::new(&dev).unwrap(), &dev);
    let p = mr.allocate(s.as_ref(), 1 << 20, 256).unwrap();
    let k = dev.test_kernels().unwrap();
    // SAFETY: 1 MiB of managed memory holds 2^18 u32s.
    unsafe { k.smoke_fill(&s, p.as_ptr() as u64, 1 << 18) }.unwrap();
    s.synchronize().unwrap();
    // SAFETY: managed memory is host-readable once the stream is idle.
    let first = unsafe { *(p.as_ptr() as *const u32).add(12345) };
    assert_eq!(first, carve_kernels::smoke::pattern(12345));
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(s.as_ref(), p, 1 << 20, 256) }.unwrap();

    // Plain device memory cannot be prefetched: the error comes back and the block is returned.
    let stats = StatisticsResourceAdaptor::new(CudaMemoryResource::new(&dev));
    let bad = PrefetchResourceAdaptor::new(stats.clone(), &dev);
    assert!(bad.allocate(s.as_ref(), 1 << 20, 256).is_err());
    assert_eq!(stats.bytes_counter().value, 0);
}

#[test]
fn stacked_adaptors_under_thread_stress() {
    let dev = require_gpu!();
    let stats = StatisticsResourceAdaptor::new(CudaMemoryResource::new(&dev));
    let tracked = TrackingResourceAdaptor::new(stats.clone(), false);
    let mr = LimitingResourceAdaptor::new(tracked.clone(), 256 << 20);
    std::thread::scope(|scope| {
        for t in 0..8usize {
            let (mr, dev) = (mr.clone(), dev.clone());
            scope.spawn(move || {
                let s = dev.new_stream().unwrap();
                let mut live = Vec::new();
                for i in 0..300usize {
                    if i % 3 == 2 {
                        if let Some((p, n)) = live.pop() {
                            // SAFETY: from `mr`, freed once.
                            unsafe { mr.deallocate(s.as_ref(), p, n, 256) }.unwrap();
                        }
                    } else {
                        let n = 1 + (i * 7919 + t * 104_729) % (2 << 20);
                        match mr.allocate(s.as_ref(), n, 256) {
                            Ok(p) => live.push((p, n)),
                            Err(e) => assert!(e.is_out_of_memory(), "{e}"),
                        }
                    }
                }
                for (p, n) in live {
                    // SAFETY: from `mr`, freed once.
                    unsafe { mr.deallocate(s.as_ref(), p, n, 256) }.unwrap();
                }
                s.synchronize().unwrap();
            });
        }
    });
    assert_eq!(tracked.allocation_count(), 0);
    assert_eq!(mr.allocated_bytes(), 0);
    let b = stats.bytes_counter();
    assert_eq!(b.value, 0);
    assert!(b.peak as usize <= 256 << 20);
}
