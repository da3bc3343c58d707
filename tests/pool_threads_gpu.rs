//! The sharded pool on a real device: 16 threads, each on its own stream, allocate, fill with a
//! kernel, check and free; a quarter of the blocks are freed by another thread on another
//! stream (cross-shard frees), and a bounded variant runs out so that shards gather free
//! memory (device-wide synchronisation) while other threads keep working. No data is mixed,
//! nothing is lost, and the invariants hold. Skips (saying so) without a GPU.

use std::sync::{Arc, Mutex};

use carve::resource::PoolOptions;
use carve::{CudaMemoryResource, DeviceBuffer, PoolMemoryResource, SharedResource};
use carve_kernels::smoke::pattern;
use carve_lab::DeviceTestKernels;

const MIB: usize = 1 << 20;
const THREADS: u64 = 16;

fn hammer(pool: &PoolMemoryResource<CudaMemoryResource>, dev: &carve::Device, bounded: bool) {
    let shared: SharedResource = Arc::new(pool.clone());
    let handoff: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());
    let refused: usize = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (dev, shared, handoff) = (dev.clone(), shared.clone(), &handoff);
                scope.spawn(move || {
                    let stream = dev.new_stream().unwrap();
                    let kernels = dev.test_kernels().unwrap();
                    let mut live: Vec<(DeviceBuffer, usize)> = Vec::new();
                    let mut refused = 0;
                    for i in 0..200u64 {
                        let words = 1 + ((i * 7919 + t * 104_729) % (MIB as u64 / 2)) as usize;
                        match DeviceBuffer::new(words * 4, &stream, shared.clone()) {
                            Ok(buf) => {
                                // SAFETY: `words` u32s, ordered on the buffer's stream.
                                unsafe { kernels.smoke_fill(&stream, buf.as_ptr(), words as u32) }
                                    .unwrap();
                                live.push((buf, words));
                            }
                            Err(e) if bounded && e.is_out_of_memory() => refused += 1,
                            Err(e) => panic!("thread {t}: {e}"),
                        }
                        if i % 3 != 0 {
                            if let Some((buf, words)) = live.pop() {
                                if i % 8 == 1 {
                                    let host = buf.to_host_vec().unwrap();
                                    let got: &[u32] = bytemuck::cast_slice(&host);
                                    let bad = (0..words).find(|&k| got[k] != pattern(k as u32));
                                    assert_eq!(bad, None, "thread {t}, step {i}");
                                }
                                buf.free().unwrap();
                            }
                        }
                    }
                    for (buf, words) in live {
                        let host = buf.to_host_vec().unwrap();
                        let got: &[u32] = bytemuck::cast_slice(&host);
                        assert!((0..words).all(|k| got[k] == pattern(k as u32)));
                    }
                    // Blocks for another thread to check and free on its own stream (so in
                    // another shard): filled here, then this stream's work waited for.
                    for k in 0..8u64 {
                        let words = 1 + ((k * 7919 + t * 31) % 4096) as usize;
                        match carve::MemoryResource::allocate(pool, stream.as_ref(), words * 4, 256)
                        {
                            Ok(p) => {
                                let p = p.as_ptr() as u64;
                                // SAFETY: `words` u32s of a live block, ordered on `stream`.
                                unsafe { kernels.smoke_fill(&stream, p, words as u32) }.unwrap();
                                handoff.lock().unwrap().push((p, words));
                            }
                            Err(e) if bounded && e.is_out_of_memory() => refused += 1,
                            Err(e) => panic!("thread {t}: {e}"),
                        }
                    }
                    stream.synchronize().unwrap();
                    refused
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    // Freed by this thread, on a stream of its own, through another shard.
    let other = dev.new_stream().unwrap();
    dev.bind().unwrap();
    for (ptr, words) in handoff.into_inner().unwrap() {
        let mut got = vec![0u32; words];
        // SAFETY: a live block of `words` u32s; its writer's stream is idle (synchronised).
        unsafe { carve::cudarc::driver::result::memcpy_dtoh_sync(&mut got, ptr) }.unwrap();
        assert!((0..words).all(|k| got[k] == pattern(k as u32)));
        // SAFETY: allocated with `words * 4` bytes, freed once; no work uses it any more.
        unsafe {
            carve::MemoryResource::deallocate(
                pool,
                other.as_ref(),
                std::ptr::NonNull::new(ptr as *mut u8).unwrap(),
                words * 4,
                256,
            )
        }
        .unwrap();
    }
    dev.synchronize().unwrap();
    eprintln!(
        "pool threads (bounded: {bounded}): {refused} refused; {:?}",
        pool.stats()
    );
    pool.check_invariants().unwrap();
    assert_eq!(pool.stats().bytes_in_use, 0);
}

#[test]
fn sixteen_threads_on_their_own_streams() {
    let dev = carve::require_gpu!();
    let pool = PoolMemoryResource::new(CudaMemoryResource::new(&dev), PoolOptions::new(0)).unwrap();
    hammer(&pool, &dev, false);
    assert!(pool.release().unwrap() > 0);
}

#[test]
fn sixteen_threads_in_a_bounded_pool_gather_across_shards() {
    let dev = carve::require_gpu!();
    let opts = PoolOptions::new(0).maximum(64 * MIB);
    let pool = PoolMemoryResource::new(CudaMemoryResource::new(&dev), opts).unwrap();
    hammer(&pool, &dev, true);
    assert!(pool.stats().pool_size <= 64 * MIB);
}
