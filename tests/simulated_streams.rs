//! A simulated stream is a fake handle: every call that would pass it to the driver refuses it
//! with `Error::InvalidArgument` before touching the driver, so the same holds with no driver
//! at all (and the GPU cases skip without a device).

use carve::driver::capture;
use carve::resource::{AsyncPoolOptions, CudaOrder, StreamOrder};
use carve::{
    AsyncMemoryResource, CudaMemoryResource, Error, ManagedMemoryResource, MemoryResource,
    StreamRef,
};

const FAKE: StreamRef<'static> = StreamRef::simulated(7);

fn assert_refused<T: std::fmt::Debug>(what: &str, r: carve::Result<T>) {
    assert!(
        matches!(r, Err(Error::InvalidArgument(_))),
        "{what}: a simulated stream should be refused with InvalidArgument, got {r:?}"
    );
}

#[test]
fn capture_queries_refuse_a_simulated_stream_without_a_driver() {
    assert_refused("capture_id", capture::capture_id(FAKE));
    // Real special streams are still queried (no driver here: not captured).
    if !carve::driver::is_available() {
        assert_eq!(capture::capture_id(StreamRef::DEFAULT).unwrap(), None);
        assert_eq!(capture::capture_id(StreamRef::PER_THREAD).unwrap(), None);
    }
}

#[test]
fn driver_resources_refuse_a_simulated_stream() {
    let dev = carve::require_gpu!();
    let cuda = CudaMemoryResource::new(&dev);
    assert_refused(
        "CudaMemoryResource::allocate",
        cuda.allocate(FAKE, 256, 256),
    );
    let managed = ManagedMemoryResource::new(&dev).unwrap();
    assert_refused(
        "ManagedMemoryResource::allocate",
        managed.allocate(FAKE, 256, 256),
    );
    let pool = AsyncMemoryResource::new(&dev, &AsyncPoolOptions::default()).unwrap();
    assert_refused(
        "AsyncMemoryResource::allocate",
        pool.allocate(FAKE, 256, 256),
    );
    let p = pool.allocate(StreamRef::DEFAULT, 256, 256).unwrap();
    // SAFETY: `p` is from `pool`; a refused free leaves it allocated.
    assert_refused("AsyncMemoryResource::deallocate", unsafe {
        pool.deallocate(FAKE, p, 256, 256)
    });
    // SAFETY: `p` is from `pool` and still live, freed once.
    unsafe { pool.deallocate(StreamRef::DEFAULT, p, 256, 256) }.unwrap();
    let order = CudaOrder::new(&dev);
    assert_refused("CudaOrder::mark", order.mark(FAKE));
    assert_refused("CudaOrder::synchronize", order.synchronize(FAKE));
    assert_refused(
        "CudaOrder::wait_for_mark",
        order.wait_for_mark(FAKE, StreamRef::DEFAULT.id()),
    );
    dev.synchronize().unwrap();
}
