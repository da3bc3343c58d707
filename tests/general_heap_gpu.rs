//! The general heap (`carve_malloc` / `carve_free`) on the GPU: thread `i` allocates a hashed
//! size between 16 B and 4 KiB, fills it with its pattern; a second launch checks every pattern
//! (no two live blocks overlap) and frees; statistics are exact per class and in total. Skips
//! without a GPU (panics under `CARVE_REQUIRE_GPU=1`).

use std::sync::Arc;

use carve::heap::{HeapKernels, HeapKind};
use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, Error, SharedResource};
use carve_kernels::general::test_request_size;
use carve_kernels::size_class::{class_of, class_size, NUM_CLASSES};

const N: u64 = 1 << 16;
const BYTES_PER_CLASS: u64 = 1 << 27;

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

#[test]
fn mixed_sizes_never_overlap_and_all_come_back() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    let heap = DeviceHeap::general(cuda(&dev), &stream, BYTES_PER_CLASS).unwrap();
    assert_eq!(
        heap.kind(),
        HeapKind::General {
            bytes_per_class: BYTES_PER_CLASS
        }
    );
    let k = HeapKernels::new(&stream);
    let p = DeviceVec::<u64>::zeroed(N as usize, &stream, cuda(&dev)).unwrap();
    let bad = DeviceVec::<u32>::zeroed(1, &stream, cuda(&dev)).unwrap();
    let empty = heap.stats().unwrap();
    assert_eq!((empty.in_use, empty.failed_allocs), (0, 0));
    let capacity = empty.capacity;
    for seed in [1u32, 2, 3] {
        let sizes: Vec<u64> = (0..N).map(|i| test_request_size(i, seed)).collect();
        let mut per_class = vec![0u64; NUM_CLASSES];
        for &s in &sizes {
            per_class[class_of(s as u32).unwrap() as usize] += 1;
        }
        // SAFETY: p holds N u64s; the heap is a live general heap.
        unsafe { k.general_malloc(N, heap.device_ptr(), p.as_ptr(), N, seed) }.unwrap();
        let ptrs = p.to_vec().unwrap();
        assert!(
            ptrs.iter().all(|&x| x != 0),
            "seed {seed}: a request failed"
        );
        let mut live: Vec<(u64, u64)> = ptrs.iter().copied().zip(sizes.iter().copied()).collect();
        live.sort_unstable();
        assert!(
            live.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
            "seed {seed}: blocks overlap"
        );
        let classes = heap.class_stats().unwrap();
        assert_eq!(classes.len(), NUM_CLASSES);
        for (c, s) in classes.iter().enumerate() {
            assert_eq!(
                s.kind,
                HeapKind::Slab {
                    block_size: class_size(c as u32) as u64
                }
            );
            assert_eq!(s.in_use, per_class[c], "seed {seed}, class {c}");
            assert!(s.high_water >= per_class[c], "seed {seed}, class {c}");
        }
        let st = heap.stats().unwrap();
        assert_eq!((st.in_use, st.capacity, st.failed_allocs), (N, capacity, 0));
        // SAFETY: p holds what general_malloc wrote with this seed; bad is one u32.
        unsafe { k.general_check_free(N, heap.device_ptr(), p.as_ptr(), N, seed, bad.as_ptr()) }
            .unwrap();
        assert_eq!(
            bad.to_vec().unwrap()[0],
            0,
            "seed {seed}: a pattern was overwritten"
        );
        let st = heap.stats().unwrap();
        assert_eq!(
            (
                st.in_use,
                st.failed_allocs,
                st.double_frees,
                st.foreign_frees
            ),
            (0, 0, 0, 0),
            "seed {seed}"
        );
    }
    heap.reset().unwrap();
    assert_eq!(heap.stats().unwrap().high_water, 0);
}

#[test]
fn bad_general_heaps_are_errors() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    assert!(matches!(
        DeviceHeap::general(cuda(&dev), &stream, 0),
        Err(Error::ZeroSize)
    ));
    assert!(matches!(
        DeviceHeap::general(cuda(&dev), &stream, u64::MAX),
        Err(Error::InvalidArgument(_))
    ));
    let mut heap = DeviceHeap::general(cuda(&dev), &stream, 1).unwrap();
    assert_eq!(
        heap.kind(),
        HeapKind::General {
            bytes_per_class: 1 << 17
        }
    );
    assert!(matches!(heap.grow(1), Err(Error::Unsupported(_))));
}
