//! The gated cross-stream suite: a stream is held back by a `Gate` while work that writes a
//! block is queued behind it, the block is freed, and another stream gets it. A missing
//! stream-ordering wait then shows as the held work overwriting what the new owner wrote. One
//! helper per setup; each case builds its resource and runs a scenario. Skips without a GPU
//! (the two-device case without two).

use std::collections::HashSet;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use carve::cudarc::driver::sys;
use carve::resource::{Bin, FixedSizeOptions, PoolOptions};
use carve::testing::Gate;
use carve::{
    BinningMemoryResource, CudaMemoryResource, Device, FixedSizeMemoryResource,
    ManagedMemoryResource, MemoryResource, PoolMemoryResource, StreamRef,
};

const MIB: usize = 1 << 20;
/// Blocks thread A fills the resource with: every block thread B could get was written.
const BLOCKS: usize = 4;
/// What the held work writes, and what the new owner writes.
const HELD: u32 = 0xAAAA_AAAA;
const OWNER: u32 = 0x5555_5555;
/// How long the gate stays shut once B is under way: B's work must wait for it.
const HOLD: Duration = Duration::from_millis(200);

/// Four 1 MiB blocks and no more (one refill), over device memory.
fn fixed_over_cuda(dev: &Device) -> FixedSizeMemoryResource<CudaMemoryResource> {
    FixedSizeMemoryResource::new(
        CudaMemoryResource::new(dev),
        FixedSizeOptions::new(MIB)
            .blocks_per_refill(BLOCKS as u32)
            .max_refills(1),
    )
    .unwrap()
}

/// One 1 MiB bin holding four blocks and no more, over device memory.
fn binning_over_cuda(dev: &Device) -> BinningMemoryResource<CudaMemoryResource> {
    let bin = Bin {
        size: MIB,
        resource: Arc::new(fixed_over_cuda(dev)),
    };
    BinningMemoryResource::with_bins(CudaMemoryResource::new(dev), vec![bin]).unwrap()
}

/// A pool of exactly four 1 MiB blocks' worth of device memory.
fn pool_over_cuda(dev: &Device) -> PoolMemoryResource<CudaMemoryResource> {
    PoolMemoryResource::new(
        CudaMemoryResource::new(dev),
        PoolOptions::new(BLOCKS * MIB).maximum(BLOCKS * MIB),
    )
    .unwrap()
}

/// A pool of exactly four 1 MiB blocks' worth of managed memory, made on `dev`.
fn managed_pool(dev: &Device) -> PoolMemoryResource<ManagedMemoryResource> {
    PoolMemoryResource::new(
        ManagedMemoryResource::new(dev).unwrap(),
        PoolOptions::new(BLOCKS * MIB).maximum(BLOCKS * MIB),
    )
    .unwrap()
}

/// Queues a fill of `bytes` at `p` with `value` on `stream` (in the current context).
fn fill(p: usize, bytes: usize, value: u32, stream: StreamRef<'_>) {
    // SAFETY: `p` is a live block of at least `bytes` bytes; the stream is a special one or
    // live for the caller.
    unsafe { sys::cuMemsetD32Async(p as sys::CUdeviceptr, value, bytes / 4, stream.as_raw()) }
        .result()
        .unwrap();
}

/// Words at `p` that are not `want` (the device is idle).
fn wrong_words(p: usize, bytes: usize, want: u32) -> usize {
    let mut host = vec![0u32; bytes / 4];
    // SAFETY: `p` is a live block of `bytes` bytes; the copy is synchronous.
    unsafe { sys::cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), p as sys::CUdeviceptr, bytes) }
        .result()
        .unwrap();
    host.iter().filter(|&&w| w != want).count()
}

/// Thread A (on `a_dev`, stream `a_stream`) holds its stream with a gate, fills the resource
/// with blocks whose fills wait behind the gate, and frees them; thread B (on `b_dev`,
/// `b_stream`) allocates a block, which must be one of A's, writes it and synchronises its
/// stream. The main thread opens the gate a while after B started: if B's work did not wait for
/// A's, A's held fill lands after B's and B's pattern is gone.
fn handoff(
    mr: &(dyn MemoryResource + Sync),
    (a_dev, a_stream): (&Device, StreamRef<'static>),
    (b_dev, b_stream): (&Device, StreamRef<'static>),
) {
    let (gate_tx, gate_rx) = mpsc::channel::<Gate>();
    let (b_started_tx, b_started_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let q = std::thread::scope(|s| {
        // Dropped on the way out, even by a panic, so that A never waits forever.
        let done_tx = done_tx;
        // A stays alive (and its per-thread stream with it) until the end.
        let a = s.spawn(move || {
            a_dev.bind().unwrap();
            let gate = Gate::hold_raw(a_dev, a_stream).unwrap();
            let blocks: Vec<_> = (0..BLOCKS)
                .map(|_| mr.allocate(a_stream, MIB, 256).unwrap())
                .collect();
            for p in &blocks {
                fill(p.as_ptr() as usize, MIB, HELD, a_stream);
            }
            let addrs: HashSet<usize> = blocks.iter().map(|p| p.as_ptr() as usize).collect();
            for p in blocks {
                // SAFETY: allocated above from `mr`, freed once.
                unsafe { mr.deallocate(a_stream, p, MIB, 256) }.unwrap();
            }
            gate_tx.send(gate).unwrap();
            let _ = done_rx.recv();
            addrs
        });
        let gate = gate_rx.recv().unwrap();
        let b = s.spawn(move || {
            b_dev.bind().unwrap();
            b_started_tx.send(()).unwrap();
            // A correct resource may block here (a synchronisation) until the gate opens.
            let q = mr.allocate(b_stream, MIB, 256).unwrap();
            fill(q.as_ptr() as usize, MIB, OWNER, b_stream);
            // SAFETY: a special stream of the current context.
            unsafe { carve::cudarc::driver::result::stream::synchronize(b_stream.as_raw()) }
                .unwrap();
            q.as_ptr() as usize
        });
        b_started_rx.recv().unwrap();
        std::thread::sleep(HOLD);
        gate.open();
        let q = b.join().unwrap();
        done_tx.send(()).unwrap();
        let a_blocks = a.join().unwrap();
        assert!(
            a_blocks.contains(&q),
            "B should have been handed one of A's blocks"
        );
        std::ptr::NonNull::new(q as *mut u8).unwrap()
    });
    a_dev.synchronize().unwrap();
    b_dev.synchronize().unwrap();
    b_dev.bind().unwrap();
    let bad = wrong_words(q.as_ptr() as usize, MIB, OWNER);
    // SAFETY: B's block, from `mr`, freed once.
    unsafe { mr.deallocate(b_stream, q, MIB, 256) }.unwrap();
    assert_eq!(
        bad,
        0,
        "{bad} of {} words B wrote were overwritten by A's held work",
        MIB / 4
    );
}

/// Two threads, each on its own per-thread default stream of one device.
fn per_thread_handoff(dev: &Device, mr: &(dyn MemoryResource + Sync)) {
    handoff(
        mr,
        (dev, StreamRef::PER_THREAD),
        (dev, StreamRef::PER_THREAD),
    );
}

#[test]
fn fixed_size_orders_per_thread_streams_of_two_threads() {
    let dev = carve::require_gpu!();
    per_thread_handoff(&dev, &fixed_over_cuda(&dev));
}

#[test]
fn binning_orders_per_thread_streams_of_two_threads() {
    let dev = carve::require_gpu!();
    per_thread_handoff(&dev, &binning_over_cuda(&dev));
}

#[test]
fn pool_orders_per_thread_streams_of_two_threads() {
    let dev = carve::require_gpu!();
    per_thread_handoff(&dev, &pool_over_cuda(&dev));
}

/// One managed pool used from two devices' legacy default streams: two streams, though both
/// are `StreamRef::DEFAULT`.
#[test]
fn managed_pool_orders_the_default_streams_of_two_devices() {
    let (d0, d1) = carve::require_two_gpus!();
    let pool = managed_pool(&d0);
    handoff(&pool, (&d0, StreamRef::DEFAULT), (&d1, StreamRef::DEFAULT));
    // And the other way round.
    handoff(&pool, (&d1, StreamRef::DEFAULT), (&d0, StreamRef::DEFAULT));
}
