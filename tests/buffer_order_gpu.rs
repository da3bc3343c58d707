//! Stream order for buffers, on a real device. Work that cudarc queues on a `DeviceVec` from
//! another stream must be done before the block is reused, and the host writes a block only
//! after the work queued on it is done. A [`Gate`] holds the other stream back, so a missing
//! wait shows as overwritten data instead of passing by luck.
//!
//! The tests share the device's context (and its recorded-error slot, which the failed-bind
//! tests fill on purpose), so they run one at a time.

use std::sync::{mpsc, Arc, Mutex, MutexGuard, PoisonError};
use std::thread;
use std::time::Duration;

use carve::cudarc::driver::{sys, DriverError};
use carve::resource::{HostBuffer, PoolOptions};
use carve::testing::Gate;
use carve::{
    CudaMemoryResource, Device, DeviceBuffer, DeviceVec, ManagedBuffer, ManagedMemoryResource,
    MemoryResource, PoolMemoryResource, SharedResource,
};

/// u32 words per block: 1 MiB, at least a pool's smallest slab.
const N: usize = 1 << 18;
const BYTES: usize = N * 4;
const PATTERN: u32 = 0xC0FF_EE11;

/// How long a test lets the thread that writes the reused block run before it opens the gate.
/// Without the missing wait that thread is done at once; with it, the thread waits for the
/// gate. Either way the data decides: this only bounds the wait.
const GRACE: Duration = Duration::from_secs(2);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `work` on a thread, opens `gate` once it is done or after [`GRACE`], and returns what
/// it returned.
fn run_then_open<T: Send + 'static>(gate: &Gate, work: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, finished) = mpsc::channel();
    let worker = thread::spawn(move || {
        let r = work();
        let _ = done.send(());
        r
    });
    let _ = finished.recv_timeout(GRACE);
    gate.open();
    worker.join().expect("the worker panicked")
}

/// A pool of exactly one block's worth of device memory, so that a block freed and allocated
/// again on one stream is the same block.
fn one_block_pool(dev: &Device) -> SharedResource {
    let options = PoolOptions::new(BYTES).maximum(BYTES).shards(1);
    Arc::new(PoolMemoryResource::new(CudaMemoryResource::new(dev), options).unwrap())
}

#[derive(Clone, Copy, Debug)]
enum ForeignWrite {
    MemsetZeros,
    CopyZeros,
}

/// A `DeviceVec` on S1 is written by cudarc on S2 while S2 is held, then dropped; its block,
/// allocated again on S1, gets a pattern. S2's late write must land before the pattern, not
/// after it.
fn foreign_write_is_done_before_the_block_is_reused(op: ForeignWrite) {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mr = one_block_pool(&dev);
    let zeros = DeviceVec::<u32>::zeroed(N, &s2, Arc::new(CudaMemoryResource::new(&dev))).unwrap();
    let mut v = DeviceVec::<u32>::new(N, &s1, mr.clone()).unwrap();
    let block = v.as_ptr();
    s1.synchronize().unwrap();
    s2.synchronize().unwrap();

    let gate = Gate::hold(&s2).unwrap();
    let c2 = s2.cudarc();
    match op {
        ForeignWrite::MemsetZeros => c2.memset_zeros(&mut v).unwrap(),
        ForeignWrite::CopyZeros => c2.memcpy_dtod(&zeros, &mut v).unwrap(),
    }
    drop(v);
    let w = DeviceVec::<u32>::new(N, &s1, mr.clone()).unwrap();
    assert_eq!(
        w.as_ptr(),
        block,
        "the pool did not give the block back: nothing to check"
    );
    let w = run_then_open(&gate, move || {
        let mut w = w;
        w.copy_from_host(&vec![PATTERN; N]).unwrap();
        w
    });
    s2.synchronize().unwrap();
    s1.synchronize().unwrap();
    let bad = w
        .to_vec()
        .unwrap()
        .iter()
        .filter(|&&x| x != PATTERN)
        .count();
    assert_eq!(
        bad, 0,
        "{op:?} queued on S2 overwrote {bad} of {N} words after the block went back to S1"
    );
}

#[test]
fn cudarc_memset_on_another_stream_is_done_before_the_block_is_reused() {
    foreign_write_is_done_before_the_block_is_reused(ForeignWrite::MemsetZeros);
}

#[test]
fn cudarc_copy_on_another_stream_is_done_before_the_block_is_reused() {
    foreign_write_is_done_before_the_block_is_reused(ForeignWrite::CopyZeros);
}

/// A write on the buffer's own stream after a foreign one is ordered after it too.
#[test]
fn own_stream_writes_follow_a_foreign_write() {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let (s1, s2) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let mr: SharedResource = Arc::new(CudaMemoryResource::new(&dev));
    let mut v = DeviceVec::<u32>::new(N, &s1, mr).unwrap();
    s1.synchronize().unwrap();
    let gate = Gate::hold(&s2).unwrap();
    s2.cudarc().memset_zeros(&mut v).unwrap();
    let v = run_then_open(&gate, move || {
        let mut v = v;
        v.copy_from_host(&vec![PATTERN; N]).unwrap();
        v
    });
    s2.synchronize().unwrap();
    let bad = v
        .to_vec()
        .unwrap()
        .iter()
        .filter(|&&x| x != PATTERN)
        .count();
    assert_eq!(
        bad, 0,
        "S2's memset overwrote {bad} of {N} words of S1's later copy"
    );
}

/// Threads copy one `DeviceVec` into their own, each on a stream of its own (half of them the
/// per-thread default stream, one handle for a different stream on every thread), while
/// sharing it by reference. Each copy follows the source's fill on its own stream, and each
/// destination's read on its own stream follows the copy into it.
#[test]
fn concurrent_foreign_copies_follow_the_fill_and_precede_own_stream_reads() {
    const THREADS: usize = 4;
    const ROUNDS: u32 = 20;
    let dev = carve::require_gpu!();
    let _serial = serial();
    let own = dev.new_stream().unwrap();
    let mr: SharedResource = Arc::new(CudaMemoryResource::new(&dev));
    let mut src = DeviceVec::<u32>::new(N, &own, mr.clone()).unwrap();
    for round in 0..ROUNDS {
        src.copy_from_host(&vec![PATTERN ^ round; N]).unwrap();
        let src = &src;
        thread::scope(|scope| {
            for t in 0..THREADS {
                let (own, mr, dev) = (&own, mr.clone(), &dev);
                scope.spawn(move || {
                    let mut dst = DeviceVec::<u32>::zeroed(N, own, mr).unwrap();
                    let stream = match t % 2 {
                        0 => dev.context().per_thread_stream(),
                        _ => dev.new_stream().unwrap().cudarc().clone(),
                    };
                    stream.memcpy_dtod(src, &mut dst).unwrap();
                    let got = dst.to_vec().unwrap();
                    let bad = got.iter().filter(|&&x| x != PATTERN ^ round).count();
                    assert_eq!(bad, 0, "thread {t}, round {round}: a stale copy");
                });
            }
        });
    }
}

/// A managed block written by stream A while A is held, then freed on A, goes to the default
/// stream after one event wait (the pool seals it: allocated on a stream of the other shard).
/// `HostBuffer::zeroed` gets it and zeroes it from the host: its zeros must survive A's write.
#[test]
fn host_buffer_zeroed_waits_for_work_queued_on_its_block() {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let (c, a) = (dev.new_stream().unwrap(), dev.new_stream().unwrap());
    let managed = ManagedMemoryResource::new(&dev).unwrap();
    // Two shards, assigned round robin by first use: C gets shard 0, A shard 1, the default
    // stream shard 0 again.
    let options = PoolOptions::new(BYTES).maximum(BYTES).shards(2);
    let pool = PoolMemoryResource::new(managed, options).unwrap();
    let x = pool.allocate(c.as_ref(), BYTES, 256).unwrap();
    c.synchronize().unwrap();

    let gate = Gate::hold(&a).unwrap();
    dev.bind().unwrap();
    // SAFETY: `x` is a live block of BYTES bytes; the memset is ordered on A before its free.
    unsafe {
        sys::cuMemsetD8Async(
            x.as_ptr() as sys::CUdeviceptr,
            0xAB,
            BYTES,
            a.as_ref().as_raw(),
        )
    }
    .result()
    .unwrap();
    // SAFETY: allocated above with these arguments, freed once; A's memset is queued on A.
    unsafe { pool.deallocate(a.as_ref(), x, BYTES, 256) }.unwrap();

    let from = pool.clone();
    let buf = run_then_open(&gate, move || {
        HostBuffer::<u32, _>::zeroed(&from, N).unwrap()
    });
    assert_eq!(
        buf.host_ptr(),
        Some(x),
        "the pool did not hand the block to the default stream: nothing to check"
    );
    a.synchronize().unwrap();
    dev.synchronize().unwrap();
    let bad = buf.as_slice().iter().filter(|&&w| w != 0).count();
    assert_eq!(
        bad, 0,
        "A's queued memset overwrote {bad} of {N} zeroed words"
    );
}

/// Plants an error in the context's recorded-error slot, which the next bind returns (and
/// clears), as an earlier failed cudarc call would have left it.
fn plant_error(dev: &Device) {
    let e = DriverError(sys::cudaError_enum::CUDA_ERROR_LAUNCH_FAILED);
    dev.context().record_err::<()>(Err(e));
}

/// A free whose bind fails keeps the block; dropping the buffer tries again and frees it.
#[test]
fn device_buffer_free_with_a_failed_bind_keeps_the_block_for_a_retry() {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let managed = ManagedMemoryResource::new(&dev).unwrap();
    let s = dev.new_stream().unwrap();
    let buf = DeviceBuffer::new(BYTES, &s, Arc::new(managed.clone())).unwrap();
    s.synchronize().unwrap();
    plant_error(&dev);
    assert!(buf.free().is_err(), "the planted error was not reported");
    s.synchronize().unwrap();
    assert_eq!(
        managed.allocation_count(),
        0,
        "the block was lost: neither freed nor kept"
    );
    let _ = carve::take_deferred_error();
}

/// As above, for a `HostBuffer` (whose free synchronises the default stream first).
#[test]
fn host_buffer_free_with_a_failed_bind_keeps_the_block_for_a_retry() {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let managed = ManagedMemoryResource::new(&dev).unwrap();
    let buf = ManagedBuffer::<u32>::zeroed(&managed, N).unwrap();
    plant_error(&dev);
    assert!(buf.free().is_err(), "the planted error was not reported");
    assert_eq!(
        managed.allocation_count(),
        0,
        "the block was lost: neither freed nor kept"
    );
    let _ = carve::take_deferred_error();
}

/// Dropping with a failed bind: one retry frees the block, and the error is recorded.
#[test]
fn device_buffer_drop_with_a_failed_bind_retries() {
    let dev = carve::require_gpu!();
    let _serial = serial();
    let managed = ManagedMemoryResource::new(&dev).unwrap();
    let s = dev.new_stream().unwrap();
    let buf = DeviceBuffer::new(BYTES, &s, Arc::new(managed.clone())).unwrap();
    s.synchronize().unwrap();
    let _ = carve::take_deferred_error();
    plant_error(&dev);
    drop(buf);
    s.synchronize().unwrap();
    assert_eq!(managed.allocation_count(), 0, "the block was lost");
    assert!(
        carve::take_deferred_error().is_some(),
        "the failed first try was not recorded"
    );
}
