//! The suballocator suites over `CudaMemoryResource` on a real device, with real streams:
//! random allocate/free sequences against the model (alignment, no overlap in address ranges,
//! invariants after each step), then a kernel writes a distinct pattern into every live
//! allocation and a second kernel verifies them all, proving on the device that nothing
//! overlaps. Skips (saying so) without a GPU.

mod common;

use std::sync::Arc;

use carve::cudarc::driver::{LaunchConfig, PushKernelArg};
use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, CudaMemoryResource, Device, DeviceVec,
    FixedSizeMemoryResource, MemoryResource, PoolMemoryResource, Stream, StreamRef,
};
use carve_lab::DeviceTestKernels;
use common::rng::{seeded, RngExt};
use common::Model;

/// Random ops on `streams`, then the device pattern check on what is live, then frees.
fn suite(
    dev: &Device,
    mr: &dyn MemoryResource,
    streams: &[Stream],
    max_bytes: usize,
    check: &dyn Fn() -> Result<(), String>,
    in_use: &dyn Fn() -> usize,
) {
    let mut rng = seeded(42);
    let mut model = Model::default();
    let refs: Vec<StreamRef<'_>> = streams.iter().map(Stream::as_ref).collect();
    for round in 0..3 {
        for _ in 0..400 {
            let s = refs[rng.random_range(0..refs.len())];
            if model.live.is_empty() || rng.random_bool(0.6) {
                let bytes = rng.random_range(4..=max_bytes);
                let p = mr.allocate(s, bytes, 256).unwrap();
                model.add(p, bytes, 256, false);
            } else {
                let (p, bytes, align) = model.take(rng.random_range(0..usize::MAX), false).unwrap();
                // SAFETY: live block of `mr`, freed once.
                unsafe { mr.deallocate(s, p, bytes, align) }.unwrap();
            }
            check().unwrap();
        }
        dev.synchronize().unwrap();
        let bad = pattern_check(dev, &streams[0], &model);
        assert_eq!(
            bad, 0,
            "round {round}: {bad} words overwritten by an overlapping block"
        );
    }
    while let Some((p, bytes, align)) = model.take(0, false) {
        // SAFETY: as above.
        unsafe { mr.deallocate(refs[0], p, bytes, align) }.unwrap();
    }
    check().unwrap();
    assert_eq!(in_use(), 0);
}

/// Fills every live block with its own pattern, then counts mismatching words on the device.
fn pattern_check(dev: &Device, stream: &Stream, model: &Model) -> u32 {
    let plain: carve::SharedResource = Arc::new(CudaMemoryResource::new(dev));
    let ptrs: Vec<u64> = model.live.keys().map(|&a| a as u64).collect();
    let words: Vec<u32> = model
        .live
        .values()
        .map(|&(n, _, _)| (n / 4) as u32)
        .collect();
    let n = ptrs.len() as u32;
    let d_ptrs = DeviceVec::from_slice(&ptrs, stream, plain.clone()).unwrap();
    let d_words = DeviceVec::from_slice(&words, stream, plain.clone()).unwrap();
    let d_bad = DeviceVec::<u32>::zeroed(1, stream, plain).unwrap();
    let k = dev.test_kernels().unwrap();
    let cfg = LaunchConfig {
        grid_dim: (n.max(1), 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (p, w, b) = (d_ptrs.as_ptr(), d_words.as_ptr(), d_bad.as_ptr());
    let fill = k.function("carve_fill_blocks").unwrap();
    let verify = k.function("carve_check_blocks").unwrap();
    // SAFETY: signatures match the kernels in kernels/src/entry.rs; every pointer is a live
    // block of at least words*4 bytes, and all allocation work was synchronised before.
    unsafe {
        let mut l = stream.cudarc().launch_builder(&fill);
        l.arg(&p).arg(&w).arg(&n);
        l.launch(cfg).unwrap();
        let mut l = stream.cudarc().launch_builder(&verify);
        l.arg(&p).arg(&w).arg(&n).arg(&b);
        l.launch(cfg).unwrap();
    }
    stream.synchronize().unwrap();
    d_bad.to_vec().unwrap()[0]
}

fn streams(dev: &Device) -> Vec<Stream> {
    (0..3).map(|_| dev.new_stream().unwrap()).collect()
}

#[test]
fn pool_on_the_device() {
    let dev = carve::require_gpu!();
    let up = CudaMemoryResource::new(&dev);
    let pool = PoolMemoryResource::new(up, PoolOptions::new(8 << 20)).unwrap();
    suite(
        &dev,
        &pool,
        &streams(&dev),
        200_000,
        &|| pool.check_invariants(),
        &|| pool.stats().bytes_in_use,
    );
    // The suite's streams are destroyed by now, with blocks freed on them in the pool. A new
    // stream allocates (from free global memory or by growing: the dead streams' unmarked
    // blocks are reached only by a device-wide synchronisation, which the pool keeps for
    // running out), and release returns every chunk, without naming a dead stream.
    let fresh = dev.new_stream().unwrap();
    let p = pool.allocate(fresh.as_ref(), 1 << 20, 256).unwrap();
    // SAFETY: allocated just above, freed once.
    unsafe { pool.deallocate(fresh.as_ref(), p, 1 << 20, 256) }.unwrap();
    pool.check_invariants().unwrap();
    let size = pool.stats().pool_size;
    assert_eq!(pool.release().unwrap(), size, "every chunk was empty");
    assert_eq!(pool.stats().pool_size, 0);
    fresh.synchronize().unwrap();
}

#[test]
fn fixed_size_on_the_device() {
    let dev = carve::require_gpu!();
    let opts = FixedSizeOptions::new(4096).blocks_per_refill(64);
    let mr = FixedSizeMemoryResource::new(CudaMemoryResource::new(&dev), opts).unwrap();
    suite(
        &dev,
        &mr,
        &streams(&dev),
        4096,
        &|| mr.check_invariants(),
        &|| mr.stats().blocks_in_use,
    );
}

#[test]
fn binning_on_the_device() {
    let dev = carve::require_gpu!();
    let mr = BinningMemoryResource::new(CudaMemoryResource::new(&dev), 8, 16).unwrap();
    suite(&dev, &mr, &streams(&dev), 100_000, &|| Ok(()), &|| 0);
}

#[test]
fn arena_on_the_device() {
    let dev = carve::require_gpu!();
    let opts = ArenaOptions {
        superblock_size: 1 << 20,
        ..Default::default()
    };
    let mr = ArenaMemoryResource::new(CudaMemoryResource::new(&dev), opts).unwrap();
    suite(
        &dev,
        &mr,
        &streams(&dev),
        400_000,
        &|| mr.check_invariants(),
        &|| mr.stats().bytes_in_use,
    );
}

#[test]
fn the_pattern_check_catches_an_overlap() {
    // Guards the guard: two model entries sharing memory must be reported.
    let dev = carve::require_gpu!();
    let up = CudaMemoryResource::new(&dev);
    let p = up.allocate(StreamRef::DEFAULT, 8192, 256).unwrap();
    let mut model = Model::default();
    model.live.insert(p.as_ptr() as usize, (8192, 256, 1));
    model
        .live
        .insert(p.as_ptr() as usize + 4096, (4096, 256, 2));
    let bad = pattern_check(&dev, &dev.default_stream(), &model);
    assert!(bad > 0);
    // SAFETY: allocated above, freed once.
    unsafe { up.deallocate(StreamRef::DEFAULT, p, 8192, 256) }.unwrap();
}
