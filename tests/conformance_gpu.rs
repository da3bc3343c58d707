//! The conformance suite on the GPU: the driver-backed resources (cuda, managed, pinned, the
//! driver pool), suballocators over device memory, and the prefetch adaptor. Every test skips,
//! saying why, without a GPU, and fails instead under `CARVE_REQUIRE_GPU=1`.
//!
//! Stream ordering is checked with real streams: stream A is held by a host function while a
//! copy into block X waits behind it; X is freed on A; stream B allocates until it gets X back
//! and copies into it; then A is released. If the resource handed X to B without ordering B
//! after A, A's copy lands last and B reads A's bytes.
//!
//! To test a new resource, write a factory below and add one line to the list at the end.

mod common;
#[macro_use]
mod conformance;

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use carve::adaptor::PrefetchResourceAdaptor;
use carve::cudarc::driver::sys;
use carve::resource::{
    ArenaOptions, CudaBacking, CudaBackingOptions, CudaOrder, ExpandableOptions, FixedSizeOptions,
    PoolOptions, StreamOrder, VirtualOptions,
};
use carve::{
    ArenaMemoryResource, AsyncMemoryResource, AsyncPoolOptions, CudaMemoryResource, Device, Error,
    ExpandableMemoryResource, FixedSizeMemoryResource, GraphSafeMemoryResource,
    ManagedMemoryResource, MemoryResource, PinnedFlags, PinnedHostMemoryResource,
    PoolMemoryResource, Stream, StreamRef, VirtualMemoryResource,
};
use conformance::{note, Env, Subject, Usage, STREAMS};

/// One test's world: device 0 and its own streams.
struct Gpu {
    dev: Device,
    streams: Vec<Stream>,
}

fn gpu() -> Option<Gpu> {
    let dev = carve::testing::gpu_or_skip(&carve::testing::test_name())?;
    let streams = (0..STREAMS).map(|_| dev.new_stream().unwrap()).collect();
    Some(Gpu { dev, streams })
}

impl Gpu {
    fn order(&self) -> Arc<dyn StreamOrder> {
        Arc::new(CudaOrder::new(&self.dev))
    }
}

impl Env for Gpu {
    fn stream(&self, i: usize) -> StreamRef<'_> {
        self.streams[i].as_ref()
    }

    fn synchronize(&self) {
        self.dev.synchronize().unwrap();
    }

    fn stream_order<R: MemoryResource>(&self, name: &str, make: &dyn Fn() -> Subject<R>) {
        gated_stream_order(name, self, make);
    }
}

fn pool_usage<R: MemoryResource>(p: &PoolMemoryResource<R>) -> Usage {
    let s = p.stats();
    Usage::new(s.bytes_in_use, s.live_blocks)
}

// The driver-backed resources.

fn cuda(env: &Gpu) -> Subject<CudaMemoryResource> {
    Subject::new(CudaMemoryResource::new(&env.dev))
        .max_align(256)
        .no_usage("cuMemAlloc keeps no count of its own")
        .size_mismatch_accepted("cuMemFree takes no size")
        .double_free_unchecked(
            "a freed address may already be another allocation's in this process; cuMemFree \
             cannot tell, so the caller must not free twice",
        )
        .sibling_accepted("every CudaMemoryResource of a device frees any cuMemAlloc pointer")
}

fn managed(env: &Gpu) -> Subject<ManagedMemoryResource> {
    Subject::new(ManagedMemoryResource::new(&env.dev).unwrap())
        .max_align(256)
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
}

fn pinned(env: &Gpu) -> Subject<PinnedHostMemoryResource> {
    Subject::new(PinnedHostMemoryResource::new(&env.dev, PinnedFlags::PORTABLE).unwrap())
        .max_align(carve::resource::PINNED_ALIGNMENT)
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
}

fn pinned_mapped(env: &Gpu) -> Subject<PinnedHostMemoryResource> {
    Subject::new(PinnedHostMemoryResource::new(&env.dev, PinnedFlags::DEVICE_MAPPED).unwrap())
        .max_align(carve::resource::PINNED_ALIGNMENT)
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
}

fn async_pool(env: &Gpu) -> Subject<AsyncMemoryResource> {
    Subject::new(AsyncMemoryResource::new(&env.dev, &AsyncPoolOptions::new()).unwrap())
        .max_align(256)
        .usage(|r| Usage::new(r.allocated_bytes(), r.allocation_count()))
}

// Suballocators over device memory, ordered by events.

fn pool_over_cuda(env: &Gpu) -> Subject<PoolMemoryResource<CudaMemoryResource>> {
    let opts = PoolOptions::new(0).order(env.order());
    Subject::new(PoolMemoryResource::new(CudaMemoryResource::new(&env.dev), opts).unwrap())
        .usage(pool_usage)
        .invariants(|r| r.check_invariants())
}

fn fixed_size_over_cuda(env: &Gpu) -> Subject<FixedSizeMemoryResource<CudaMemoryResource>> {
    let opts = FixedSizeOptions::new(4096)
        .blocks_per_refill(16)
        .max_refills(2)
        .order(env.order());
    let mr = FixedSizeMemoryResource::new(CudaMemoryResource::new(&env.dev), opts).unwrap();
    Subject::new(mr)
        .max_bytes(4096)
        .max_align(256)
        .usage(|r| {
            let s = r.stats();
            Usage::new(s.blocks_in_use * s.block_size, s.blocks_in_use)
        })
        .invariants(|r| r.check_invariants())
        .size_mismatch_accepted("blocks are one size: any size up to the block's frees it")
}

fn arena_over_cuda(env: &Gpu) -> Subject<ArenaMemoryResource<CudaMemoryResource>> {
    let opts = ArenaOptions {
        superblock_size: 1 << 20,
        arenas: 4,
        global: PoolOptions::new(0).order(env.order()),
    };
    Subject::new(ArenaMemoryResource::new(CudaMemoryResource::new(&env.dev), opts).unwrap())
        .usage(|r| Usage::bytes(r.stats().bytes_in_use))
        .invariants(|r| r.check_invariants())
}

// The virtual-memory resources and graph-safe allocation.

fn virtual_on_device(env: &Gpu) -> Subject<VirtualMemoryResource<CudaBacking>> {
    let opts = VirtualOptions::new().maximum(1 << 30).order(env.order());
    let mr = VirtualMemoryResource::on_device(&env.dev, CudaBackingOptions::default(), opts);
    Subject::new(mr.unwrap())
        .usage(|r| {
            let s = r.stats();
            Usage::new(s.bytes_in_use, s.live_blocks)
        })
        .invariants(|r| r.check_invariants())
        .size_mismatch_unchecked("blocks are whole chunks: a size of the same chunk count frees it")
}

fn expandable_on_device(env: &Gpu) -> Subject<ExpandableMemoryResource<CudaBacking>> {
    let opts = ExpandableOptions {
        maximum: Some(512 << 20),
        order: Some(env.order()),
        ..ExpandableOptions::default()
    };
    let mr = ExpandableMemoryResource::on_device(&env.dev, CudaBackingOptions::default(), opts);
    Subject::new(mr.unwrap())
        .usage(|r| {
            let s = r.stats();
            Usage::new(s.bytes_in_use(), s.live_blocks())
        })
        .invariants(|r| r.check_invariants())
}

/// Outside any capture, graph-safe allocation is its upstream's (here cuMemAlloc's).
fn graph_safe_over_cuda(env: &Gpu) -> Subject<GraphSafeMemoryResource<CudaMemoryResource>> {
    Subject::new(GraphSafeMemoryResource::new(CudaMemoryResource::new(
        &env.dev,
    )))
    .max_align(256)
    .no_usage("cuMemAlloc keeps no count of its own")
    .size_mismatch_accepted("cuMemFree takes no size")
    .double_free_unchecked("as cuMemFree: the caller must not free twice")
    .sibling_accepted("every CudaMemoryResource of a device frees any cuMemAlloc pointer")
}

// Adaptors that need a GPU.

fn prefetch_over_managed(env: &Gpu) -> Subject<PrefetchResourceAdaptor<ManagedMemoryResource>> {
    let managed = ManagedMemoryResource::new(&env.dev).unwrap();
    Subject::new(PrefetchResourceAdaptor::new(managed, &env.dev))
        .max_align(256)
        .usage(|r| {
            Usage::new(
                r.upstream().allocated_bytes(),
                r.upstream().allocation_count(),
            )
        })
}

conformance_suite! { gpu;
    cuda => cuda,
    managed => managed,
    pinned => pinned,
    pinned_mapped => pinned_mapped,
    async_pool => async_pool,
    pool_over_cuda => pool_over_cuda,
    fixed_size_over_cuda => fixed_size_over_cuda,
    arena_over_cuda => arena_over_cuda,
    virtual_on_device => virtual_on_device,
    expandable_on_device => expandable_on_device,
    graph_safe_over_cuda => graph_safe_over_cuda,
    prefetch_over_managed => prefetch_over_managed,
}

// ---------------------------------------------------------------- the stream-order check

/// How long a held stream waits to be released. Resources that synchronise on free (cuMemFree,
/// a pool's device-wide synchronisation) wait this long for the held stream; a correct resource
/// passes however long it is.
const HOLD_MAX: Duration = Duration::from_secs(1);

/// Releases a stream held by [`hold`].
struct Gate {
    open: Mutex<bool>,
    cv: Condvar,
}

impl Gate {
    fn new() -> Arc<Gate> {
        Arc::new(Gate {
            open: Mutex::new(false),
            cv: Condvar::new(),
        })
    }

    fn release(&self) {
        *self.open.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }
}

/// The host function that holds a stream: waits for its gate (at most [`HOLD_MAX`]). It makes
/// no CUDA call, as host functions must not, and never unwinds into the driver.
extern "C" fn wait_for_gate(user: *mut c_void) {
    // SAFETY: `user` is the `Arc<Gate>` that `hold` leaked for exactly this one call.
    let gate = unsafe { Arc::from_raw(user.cast_const().cast::<Gate>()) };
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let open = gate.open.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = gate.cv.wait_timeout_while(open, HOLD_MAX, |open| !*open);
    }));
}

/// Queues [`wait_for_gate`] on `stream`: work queued after it waits for the gate.
fn hold(stream: &Stream, gate: &Arc<Gate>) {
    let user = Arc::into_raw(gate.clone()).cast_mut().cast::<c_void>();
    let raw = stream.as_ref().as_raw();
    // SAFETY: `stream` is alive (borrowed); `wait_for_gate` takes ownership of `user` when it
    // runs.
    let r = unsafe { sys::cuLaunchHostFunc(raw, Some(wait_for_gate), user) };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver refused the launch, so the host function never runs: reclaim.
        drop(unsafe { Arc::from_raw(user.cast_const().cast::<Gate>()) });
        panic!("cuLaunchHostFunc failed: {r:?}");
    }
}

/// `bytes` bytes of device memory set to `value`, for copies from.
fn filled(env: &Gpu, bytes: usize, value: u8) -> (CudaMemoryResource, NonNull<u8>) {
    let mr = CudaMemoryResource::new(&env.dev);
    let p = mr.allocate(StreamRef::DEFAULT, bytes, 256).unwrap();
    // SAFETY: `bytes` bytes of device memory just allocated; a synchronous memset.
    unsafe { sys::cuMemsetD8_v2(p.as_ptr() as sys::CUdeviceptr, value, bytes) }
        .result()
        .unwrap();
    (mr, p)
}

/// Queues a copy of `bytes` bytes from `src` into `dst` on `stream` (unified addressing: either
/// may be device, managed or pinned memory).
fn copy_async(dst: NonNull<u8>, src: NonNull<u8>, bytes: usize, stream: &Stream) {
    let raw = stream.as_ref().as_raw();
    // SAFETY: both ranges are live blocks of at least `bytes` bytes that the driver can reach;
    // the stream is alive (borrowed).
    unsafe {
        sys::cuMemcpyAsync(
            dst.as_ptr() as sys::CUdeviceptr,
            src.as_ptr() as sys::CUdeviceptr,
            bytes,
            raw,
        )
    }
    .result()
    .unwrap();
}

/// The first `bytes` bytes at `src`, read after all work is done.
fn read(src: NonNull<u8>, bytes: usize) -> Vec<u8> {
    let mut host = vec![0u8; bytes];
    // SAFETY: `src` is a live block of `bytes` bytes; `host` has room; the copy is synchronous.
    unsafe {
        sys::cuMemcpy(
            host.as_mut_ptr() as sys::CUdeviceptr,
            src.as_ptr() as sys::CUdeviceptr,
            bytes,
        )
    }
    .result()
    .unwrap();
    host
}

/// See the module documentation. A resource that never gives X back (it grows instead) passes
/// with a note: nothing crossed streams.
fn gated_stream_order<R: MemoryResource>(name: &str, env: &Gpu, make: &dyn Fn() -> Subject<R>) {
    const A_BYTE: u8 = 0xA5;
    const B_BYTE: u8 = 0x5B;
    let s = make();
    let bytes = s.max_bytes.min(1 << 20);
    let (sa, sb) = (&env.streams[1], &env.streams[2]);
    let (a, b) = (sa.as_ref(), sb.as_ref());
    env.dev.bind().unwrap();
    let (src_mr, src_a) = filled(env, bytes, A_BYTE);
    let (_, src_b) = filled(env, bytes, B_BYTE);

    let x = s.mr.allocate(a, bytes, 256).unwrap();
    let gate = Gate::new();
    hold(sa, &gate);
    copy_async(x, src_a, bytes, sa);
    // SAFETY: freed once; the only work on it is A's copy, queued on A.
    unsafe { s.mr.deallocate(a, x, bytes, 256) }.unwrap();

    let mut ys = Vec::new();
    let mut reused = false;
    for _ in 0..64 {
        let y = match s.mr.allocate(b, bytes, 256) {
            Ok(y) => y,
            Err(Error::OutOfMemory { .. }) => break,
            Err(e) => panic!("{name}: allocating on stream B: {e}"),
        };
        copy_async(y, src_b, bytes, sb);
        ys.push(y);
        let (xa, ya) = (x.as_ptr() as usize, y.as_ptr() as usize);
        if ya < xa + bytes && xa < ya + bytes {
            reused = true;
            break;
        }
    }
    gate.release();
    env.synchronize();
    for &y in &ys {
        let got = read(y, bytes);
        if let Some(i) = got.iter().position(|&v| v != B_BYTE) {
            panic!(
                "{name}: block {y:?} was handed to stream B while stream A's copy into it (freed \
                 on A) was still queued: byte {i} is {:#x}, B wrote {B_BYTE:#x}",
                got[i]
            );
        }
    }
    for y in ys {
        // SAFETY: allocated above, freed once; B's copy is done.
        unsafe { s.mr.deallocate(b, y, bytes, 256) }.unwrap();
    }
    env.synchronize();
    for p in [src_a, src_b] {
        // SAFETY: the scratch blocks, freed once, all work done.
        unsafe { src_mr.deallocate(StreamRef::DEFAULT, p, bytes, 256) }.unwrap();
    }
    note(
        name,
        if reused {
            "stream B got stream A's freed block back, ordered after A's work"
        } else {
            "stream B never got stream A's freed block back: nothing crossed streams"
        },
    );
    s.assert_invariants(name, "after the stream-order check");
}
