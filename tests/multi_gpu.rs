//! Two GPUs: resources on device 1 used while device 0 is current, peer access for pools and
//! driver pools, copies between devices, and device checks. Each test skips with a reason on a
//! machine with fewer than two GPUs (`CARVE_REQUIRE_GPUS=2` makes that a failure).

use std::sync::Arc;

use carve::resource::{PoolAccess, PoolOptions};
use carve::{
    AsyncMemoryResource, AsyncPoolOptions, CudaMemoryResource, Device, DeviceBuffer, Error,
    MemoryResource, PoolMemoryResource, SharedResource,
};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const MIB: usize = 1 << 20;

fn words(buf: &DeviceBuffer) -> Vec<u32> {
    bytemuck::cast_slice(&buf.to_host_vec().unwrap()).to_vec()
}

fn expected(n: usize) -> Vec<u32> {
    (0..n as u32).map(pattern).collect()
}

/// The pool orders streams of its own device (1), not the current one (0): a block handed
/// from one stream of device 1 to another, with a kernel still writing it, is never reused
/// early, and synchronous allocation waits for device 1's default stream. Every pool call
/// runs with device 0 current.
#[test]
fn a_pool_over_device_1_while_device_0_is_current() {
    let (d0, d1) = carve::require_two_gpus!();
    d0.bind().unwrap();
    // Bounded and one shard, so each stream must reuse what the other freed.
    let opts = PoolOptions::new(16 * MIB).maximum(16 * MIB).shards(1);
    let pool = PoolMemoryResource::new(CudaMemoryResource::new(&d1), opts).unwrap();
    assert_eq!(pool.device(), Some(d1.clone()));
    let (a, b) = (d1.new_stream().unwrap(), d1.new_stream().unwrap());
    let kernels = d1.test_kernels().unwrap();
    let n = 16 * MIB / 4;
    for round in 0..20u32 {
        // Alternate streams: each round takes the block the other stream freed while its
        // kernels may still be queued.
        let s = if round % 2 == 0 { &a } else { &b };
        d0.bind().unwrap();
        let p = pool.allocate(s.as_ref(), 16 * MIB, 256).unwrap();
        let addr = p.as_ptr() as u64;
        // SAFETY: `n` u32s of the block, ordered on `s`.
        unsafe { kernels.smoke_fill(s, addr, n as u32) }.unwrap();
        // SAFETY: as above; adds `round` to each word.
        unsafe { kernels.smoke_add(s, addr, n as u32, round) }.unwrap();
        if round % 5 == 4 {
            s.synchronize().unwrap();
            d1.bind().unwrap();
            let mut got = vec![0u32; n];
            // SAFETY: `n` u32s of a live block; its stream is idle.
            unsafe { carve::cudarc::driver::result::memcpy_dtoh_sync(&mut got, addr) }.unwrap();
            assert!(
                (0..n).all(|i| got[i] == pattern(i as u32).wrapping_add(round)),
                "round {round}"
            );
        }
        d0.bind().unwrap();
        // SAFETY: allocated above, freed once; only work queued on `s` uses it.
        unsafe { pool.deallocate(s.as_ref(), p, 16 * MIB, 256) }.unwrap();
    }
    pool.check_invariants().unwrap();
    d0.bind().unwrap();
    let p = pool.allocate_sync(MIB, 256).unwrap();
    // SAFETY: from `allocate_sync` above, unused.
    unsafe { pool.deallocate_sync(p, MIB, 256) }.unwrap();
}

/// A buffer on device 0 copied into one on device 1 and back (`cuMemcpyPeerAsync`).
#[test]
fn copies_between_buffers_on_two_devices() {
    let (d0, d1) = carve::require_two_gpus!();
    let (s0, s1) = (d0.new_stream().unwrap(), d1.new_stream().unwrap());
    let data: Vec<u8> = (0..3 * MIB).map(|i| (i * 7 + 1) as u8).collect();
    let src = DeviceBuffer::from_slice(&data, &s0, Arc::new(CudaMemoryResource::new(&d0))).unwrap();
    let mut dst =
        DeviceBuffer::new(data.len(), &s1, Arc::new(CudaMemoryResource::new(&d1))).unwrap();
    dst.copy_from_buffer(&src).unwrap();
    assert_eq!(dst.to_host_vec().unwrap(), data);
    let mut back =
        DeviceBuffer::new(data.len(), &s0, Arc::new(CudaMemoryResource::new(&d0))).unwrap();
    back.copy_from_buffer(&dst).unwrap();
    assert_eq!(back.to_host_vec().unwrap(), data);
    let mut small = DeviceBuffer::new(10, &s1, Arc::new(CudaMemoryResource::new(&d1))).unwrap();
    assert!(matches!(
        small.copy_from_buffer(&src),
        Err(Error::InvalidArgument(_))
    ));
}

/// A kernel on device 0 writes into a pool block on device 1 once peer access is on.
#[test]
fn peer_access_lets_device_0_write_a_pool_block_on_device_1() {
    let (d0, d1) = carve::require_two_gpus!();
    if !d0.can_access_peer(&d1).unwrap() {
        eprintln!("SKIPPED peer access: device 0 cannot access device 1");
        return;
    }
    d0.enable_peer_access(&d1).unwrap();
    d0.enable_peer_access(&d1).unwrap(); // idempotent
    let pool = PoolMemoryResource::new(CudaMemoryResource::new(&d1), PoolOptions::new(0)).unwrap();
    let (s0, s1) = (d0.new_stream().unwrap(), d1.new_stream().unwrap());
    let n = MIB / 4;
    let buf = DeviceBuffer::new(MIB, &s1, Arc::new(pool)).unwrap();
    s0.wait_for(&s1).unwrap();
    // SAFETY: `n` u32s of device 1 memory, reachable from device 0 (peer access enabled);
    // ordered after the allocation, and the buffer's stream waits for it below.
    unsafe {
        d0.test_kernels()
            .unwrap()
            .smoke_fill(&s0, buf.as_ptr(), n as u32)
    }
    .unwrap();
    s1.wait_for(&s0).unwrap();
    assert_eq!(words(&buf), expected(n));
}

/// A driver pool on device 1 grants device 0 access (`cuMemPoolSetAccess`); a kernel on
/// device 0 then writes its blocks.
#[test]
fn driver_pool_access_for_another_device() {
    let (d0, d1) = carve::require_two_gpus!();
    let mr = AsyncMemoryResource::new(&d1, &AsyncPoolOptions::new()).unwrap();
    assert_eq!(mr.access(1).unwrap(), PoolAccess::ReadWrite);
    if !d0.can_access_peer(&d1).unwrap() {
        eprintln!("SKIPPED pool access: device 0 cannot access device 1");
        return;
    }
    mr.set_access(0, PoolAccess::ReadWrite).unwrap();
    assert_eq!(mr.access(0).unwrap(), PoolAccess::ReadWrite);
    let (s0, s1) = (d0.new_stream().unwrap(), d1.new_stream().unwrap());
    let n = MIB / 4;
    let buf = DeviceBuffer::new(MIB, &s1, Arc::new(mr.clone())).unwrap();
    s0.wait_for(&s1).unwrap();
    // SAFETY: `n` u32s of the pool's memory, which device 0 may now access; ordered after the
    // allocation, and the buffer's stream waits for the kernel below.
    unsafe {
        d0.test_kernels()
            .unwrap()
            .smoke_fill(&s0, buf.as_ptr(), n as u32)
    }
    .unwrap();
    s1.wait_for(&s0).unwrap();
    assert_eq!(words(&buf), expected(n));
    drop(buf);
    mr.set_access(0, PoolAccess::None).unwrap();
    assert_eq!(mr.access(0).unwrap(), PoolAccess::None);
}

/// Device-only memory of device 1 is refused for a device 0 stream and as device 0's current
/// resource; device 1 takes it.
#[test]
fn device_only_memory_stays_on_its_device() {
    let (d0, d1) = carve::require_two_gpus!();
    let on1: SharedResource = Arc::new(CudaMemoryResource::new(&d1));
    let s0 = d0.new_stream().unwrap();
    assert!(matches!(
        DeviceBuffer::new(256, &s0, on1.clone()),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        carve::current::set(0, on1.clone()),
        Err(Error::InvalidArgument(_))
    ));
    let previous = carve::current::set(1, on1.clone()).unwrap();
    assert_eq!(carve::current::get(1).unwrap().device(), Some(d1.clone()));
    carve::current::set(1, previous).unwrap();
    // Per-device current resources: device 0's is untouched.
    assert_eq!(carve::current::get(0).unwrap().device(), Some(d0));
}

/// Every device's pool orders its own streams: two pools, one per device, used from threads
/// that never bind a context themselves.
#[test]
fn pools_on_both_devices_from_threads_that_bind_nothing() {
    let (d0, d1) = carve::require_two_gpus!();
    let pools: Vec<SharedResource> = [&d0, &d1]
        .iter()
        .map(|d| {
            Arc::new(
                PoolMemoryResource::new(CudaMemoryResource::new(d), PoolOptions::new(8 * MIB))
                    .unwrap(),
            ) as SharedResource
        })
        .collect();
    std::thread::scope(|scope| {
        for t in 0..4usize {
            let dev: Device = if t % 2 == 0 { d0.clone() } else { d1.clone() };
            let pool = pools[t % 2].clone();
            scope.spawn(move || {
                let s = dev.new_stream().unwrap();
                let kernels = dev.test_kernels().unwrap();
                for i in 0..50usize {
                    let n = 1 + (i * 7919 + t * 31) % (MIB / 4);
                    let buf = DeviceBuffer::new(n * 4, &s, pool.clone()).unwrap();
                    // SAFETY: `n` u32s of the buffer, ordered on its stream.
                    unsafe { kernels.smoke_fill(&s, buf.as_ptr(), n as u32) }.unwrap();
                    if i % 10 == 0 {
                        assert_eq!(words(&buf)[..n], expected(n)[..]);
                    }
                }
            });
        }
    });
}
