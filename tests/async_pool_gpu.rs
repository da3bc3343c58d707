//! The driver-pool resource: counters, trimming, the hard limit, wrapping and sharing pools.

use std::ptr::NonNull;
use std::sync::Arc;

use carve::resource::PoolAccess;
use carve::{
    AsyncMemoryResource, AsyncPoolOptions, Device, DeviceBuffer, Error, MemoryResource, StreamRef,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const MIB: usize = 1 << 20;

#[test]
fn counters_follow_allocations_and_trim_lowers_reserved() {
    let dev = carve::require_gpu!();
    let mr = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    assert!(mr.is_owned());
    let stream = dev.new_stream().unwrap();
    let s = stream.as_ref();
    let start = mr.stats().unwrap();
    assert_eq!(start.used, 0, "{start:?}");

    let a = mr.allocate(s, 8 * MIB, 256).unwrap();
    let one = mr.stats().unwrap();
    let b = mr.allocate(s, 8 * MIB, 256).unwrap();
    let two = mr.stats().unwrap();
    eprintln!("pool stats: start {start:?}\n  one {one:?}\n  two {two:?}");
    assert!(
        one.used >= 8 * MIB && two.used >= one.used + 8 * MIB,
        "{two:?}"
    );
    assert!(two.reserved >= two.used && two.free == two.reserved - two.used);
    assert!(two.used_high >= two.used && two.reserved_high >= two.reserved);
    assert_eq!(mr.allocated_bytes(), 16 * MIB);

    // SAFETY: allocated above with these sizes; nothing else uses them.
    unsafe { mr.deallocate(s, a, 8 * MIB, 256) }.unwrap();
    stream.synchronize().unwrap();
    let freed_one = mr.stats().unwrap();
    assert!(
        freed_one.used < two.used && freed_one.used >= 8 * MIB,
        "{freed_one:?}"
    );
    // SAFETY: as above.
    unsafe { mr.deallocate(s, b, 8 * MIB, 256) }.unwrap();
    stream.synchronize().unwrap();
    let empty = mr.stats().unwrap();
    assert_eq!(empty.used, 0, "{empty:?}");
    assert!(
        empty.reserved > 0,
        "the default threshold keeps memory: {empty:?}"
    );
    assert!(empty.used_high >= 16 * MIB);

    mr.trim_to(0).unwrap();
    let trimmed = mr.reserved_bytes().unwrap();
    eprintln!("reserved before trim {} after {trimmed}", empty.reserved);
    assert!(trimmed < empty.reserved);

    mr.reset_high_water().unwrap();
    assert!(mr.stats().unwrap().used_high < 16 * MIB);
    assert_eq!((mr.allocation_count(), mr.allocated_bytes()), (0, 0));
    assert_eq!(mr.peak_allocated_bytes(), 16 * MIB);
}

#[test]
fn initial_size_primes_and_threshold_is_set() {
    let dev = carve::require_gpu!();
    let opts = AsyncPoolOptions::new()
        .initial_size(32 * MIB)
        .release_threshold(64 * MIB);
    let mr = AsyncMemoryResource::new(&dev, &opts).unwrap();
    let st = mr.stats().unwrap();
    assert!(st.reserved >= 32 * MIB && st.used == 0, "{st:?}");
    assert_eq!(mr.release_threshold().unwrap(), 64 * MIB as u64);
    mr.set_release_threshold(MIB).unwrap();
    assert_eq!(mr.release_threshold().unwrap(), MIB as u64);
    let unset = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    assert_eq!(unset.release_threshold().unwrap(), u64::MAX);
}

#[test]
fn hard_limit_refuses_with_an_out_of_memory_error_naming_it() {
    let dev = carve::require_gpu!();
    let limit = 64 * MIB;
    let mr = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new().hard_limit(limit)).unwrap();
    eprintln!("driver cap on reserved bytes: {:?}", mr.driver_cap());
    let stream = dev.new_stream().unwrap();
    let s = stream.as_ref();
    let a = mr.allocate(s, 48 * MIB, 256).unwrap();
    let over = mr.allocate(s, 32 * MIB, 256).unwrap_err();
    assert!(over.is_out_of_memory(), "{over}");
    assert!(
        over.to_string()
            .contains(&format!("hard limit is {limit} bytes")),
        "{over}"
    );
    let alone = mr.allocate(s, limit + 1, 256).unwrap_err();
    assert!(matches!(alone, Error::OutOfMemory { bytes, .. } if bytes == limit + 1));
    assert_eq!(mr.allocation_count(), 1);
    // SAFETY: allocated above.
    unsafe { mr.deallocate(s, a, 48 * MIB, 256) }.unwrap();
    // Return the freed block to the driver, so a whole-limit block fits the pool's own cap.
    stream.synchronize().unwrap();
    mr.trim_to(0).unwrap();
    let whole = mr.allocate(s, limit, 256).unwrap();
    // SAFETY: allocated above.
    unsafe { mr.deallocate(s, whole, limit, 256) }.unwrap();
    stream.synchronize().unwrap();
    assert!(mr.peak_allocated_bytes() <= limit);

    assert!(matches!(
        AsyncMemoryResource::new(
            &dev,
            &AsyncPoolOptions::new()
                .initial_size(2 * limit)
                .hard_limit(limit)
        ),
        Err(Error::InvalidArgument(_))
    ));
}

#[test]
fn wraps_default_current_and_foreign_pools_without_owning_them() {
    let dev = carve::require_gpu!();
    let default = AsyncMemoryResource::default_pool(&dev).unwrap();
    let current = AsyncMemoryResource::current_pool(&dev).unwrap();
    assert!(!default.is_owned() && !current.is_owned());
    assert!(!default.handle().is_null());
    assert_eq!(default.handle(), current.handle());
    let stream = dev.new_stream().unwrap();
    let s = stream.as_ref();
    let p = default.allocate(s, MIB, 256).unwrap();
    // SAFETY: allocated above.
    unsafe { default.deallocate(s, p, MIB, 256) }.unwrap();

    // A second handle on an owned pool shares its memory and counters.
    let owner = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    // SAFETY: `owner` outlives `shared` and its block.
    let shared = unsafe { AsyncMemoryResource::from_raw(&dev, owner.handle(), Some(4 * MIB)) };
    let q = shared.allocate(s, 2 * MIB, 256).unwrap();
    assert!(owner.used_bytes().unwrap() >= 2 * MIB);
    assert_eq!(
        (owner.allocation_count(), shared.allocation_count()),
        (0, 1)
    );
    assert!(shared
        .allocate(s, 3 * MIB, 256)
        .unwrap_err()
        .is_out_of_memory());
    // The owner's ledger never saw the block: freeing it there is refused, harmlessly.
    // SAFETY: refused before the driver.
    let foreign = unsafe { owner.deallocate(s, q, 2 * MIB, 256) };
    assert!(matches!(foreign, Err(Error::UnknownPointer { .. })));
    // SAFETY: allocated above through `shared`.
    unsafe { shared.deallocate(s, q, 2 * MIB, 256) }.unwrap();
    stream.synchronize().unwrap();
    assert_eq!(owner.used_bytes().unwrap(), 0);
}

#[test]
fn access_ipc_and_bad_ordinals() {
    let dev = carve::require_gpu!();
    let count = Device::count().unwrap();
    let mr = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    assert_eq!(mr.access(dev.ordinal()).unwrap(), PoolAccess::ReadWrite);
    assert!(matches!(
        mr.set_access(count, PoolAccess::ReadWrite),
        Err(Error::InvalidDevice { ordinal, .. }) if ordinal == count
    ));
    assert!(matches!(
        mr.access(count + 1),
        Err(Error::InvalidDevice { .. })
    ));
    assert!(matches!(mr.export_fd(), Err(Error::Unsupported(_))));
    assert!(matches!(
        AsyncMemoryResource::on(count, &AsyncPoolOptions::new()),
        Err(Error::InvalidDevice { .. })
    ));

    let ipc = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new().ipc_export(true)).unwrap();
    let fd = ipc.export_fd().unwrap();
    eprintln!("exported pool as fd {fd:?}");
}

#[test]
fn foreign_double_and_mismatched_frees_are_refused() {
    let dev = carve::require_gpu!();
    let mr = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new()).unwrap();
    let s = StreamRef::DEFAULT;
    assert!(matches!(mr.allocate(s, 0, 256), Err(Error::ZeroSize)));
    assert!(matches!(
        mr.allocate(s, 64, 4096),
        Err(Error::Unsupported(_))
    ));
    let p = mr.allocate(s, 4096, 256).unwrap();
    let mut local = 0u8;
    // SAFETY: deliberately bad frees, refused before the driver.
    unsafe {
        assert!(matches!(
            mr.deallocate(s, NonNull::from(&mut local), 4096, 256),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            mr.deallocate(s, p, 1, 256),
            Err(Error::SizeMismatch { .. })
        ));
        mr.deallocate(s, p, 4096, 256).unwrap();
        assert!(matches!(
            mr.deallocate(s, p, 4096, 256),
            Err(Error::UnknownPointer { .. })
        ));
    }
}

/// Threads on their own streams allocate, fill with a kernel, check and free, while a hard
/// limit refuses some requests: no block is lost and no data is mixed.
#[test]
fn stress_threads_on_streams_under_a_limit() {
    let dev = carve::require_gpu!();
    let limit = 96 * MIB;
    let mr = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::new().hard_limit(limit)).unwrap();
    let shared: carve::SharedResource = Arc::new(mr.clone());
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let dev = dev.clone();
            let shared = shared.clone();
            std::thread::spawn(move || {
                let stream = dev.new_stream().unwrap();
                let kernels = dev.test_kernels().unwrap();
                let mut live = Vec::new();
                let mut refused = 0;
                for i in 0..300u64 {
                    let words = 1 + ((i * 7919 + t * 104_729) % (2 * MIB as u64)) as usize;
                    match DeviceBuffer::new(words * 4, &stream, shared.clone()) {
                        Ok(buf) => {
                            // SAFETY: `words` u32s, ordered on the buffer's stream.
                            unsafe { kernels.smoke_fill(&stream, buf.as_ptr(), words as u32) }
                                .unwrap();
                            live.push((buf, words));
                        }
                        Err(e) => {
                            assert!(e.is_out_of_memory(), "{e}");
                            refused += 1;
                        }
                    }
                    if i % 4 != 0 {
                        if let Some((buf, words)) = live.pop() {
                            if i % 16 == 1 {
                                let host = buf.to_host_vec().unwrap();
                                let got: &[u32] = bytemuck::cast_slice(&host);
                                let bad = (0..words).find(|&k| got[k] != pattern(k as u32));
                                assert_eq!(bad, None);
                            }
                            buf.free().unwrap();
                        }
                    }
                }
                drop(live);
                stream.synchronize().unwrap();
                refused
            })
        })
        .collect();
    let refused: usize = threads.into_iter().map(|h| h.join().unwrap()).sum();
    dev.synchronize().unwrap();
    eprintln!(
        "stress: {refused} requests refused by the {limit}-byte limit, peak {} bytes",
        mr.peak_allocated_bytes()
    );
    assert_eq!((mr.allocation_count(), mr.allocated_bytes()), (0, 0));
    assert_eq!(mr.used_bytes().unwrap(), 0);
    assert!(mr.peak_allocated_bytes() <= limit);
}
