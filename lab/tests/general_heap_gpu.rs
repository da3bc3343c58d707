//! The general heap (`carve_malloc` / `carve_free`) on the GPU: thread `i` allocates a hashed
//! size between 16 B and 4 KiB, fills it with its pattern; a second launch checks every pattern
//! (no two live blocks overlap) and frees; statistics are exact per class and in total. Skips
//! without a GPU (panics under `CARVE_REQUIRE_GPU=1`).

use std::sync::Arc;

use carve::heap::HeapKind;
use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, Error, SharedResource};
use carve_kernels::general::test_request_size;
use carve_kernels::size_class::{class_of, class_size, NUM_CLASSES};
use carve_lab::heap::HeapKernels;

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

/// Requests above 64 KiB: whole power-of-two blocks from the large classes, 4 KiB aligned,
/// distinct, counted per class; a class exhausts exactly and frees come back; sizes past the
/// largest class in use fail and are counted in the header.
#[test]
fn large_requests_take_whole_blocks_of_the_large_classes() {
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    // 32 MiB per class: every large class up to 16 MiB holds at least one block.
    let heap = DeviceHeap::general(cuda(&dev), &stream, 32 << 20).unwrap();
    let classes = heap.class_stats().unwrap();
    assert_eq!(classes.len(), NUM_CLASSES);
    let k = HeapKernels::new(&stream);
    for (bytes, n) in [
        (65_537u64, 256u64),
        (300_000, 64),
        (3 << 20, 16),
        (16 << 20, 4),
    ] {
        let c = class_of(bytes as u32).unwrap() as usize;
        let size = class_size(c as u32) as u64;
        assert_eq!(size, bytes.next_power_of_two());
        let cap = classes[c].capacity;
        // Ask for more than the class holds: exactly `cap` are served.
        let want = n.max(cap + 3);
        let p = DeviceVec::<u64>::zeroed(want as usize, &stream, cuda(&dev)).unwrap();
        // SAFETY: p holds `want` u64s; the heap lives until the end.
        unsafe { k.general_malloc_one_bench(want, heap.device_ptr(), p.as_ptr(), want, bytes) }
            .unwrap();
        let mut got: Vec<u64> = p
            .to_vec()
            .unwrap()
            .into_iter()
            .filter(|&a| a != 0)
            .collect();
        assert_eq!(got.len() as u64, cap.min(want), "{bytes} B");
        got.sort_unstable();
        assert!(got.iter().all(|a| a % 4096 == 0), "{bytes} B: alignment");
        assert!(
            got.windows(2).all(|w| w[1] - w[0] >= size),
            "{bytes} B: overlap"
        );
        let s = heap.class_stats().unwrap()[c];
        assert_eq!(
            (s.in_use, s.failed_allocs),
            (cap, want - cap),
            "{bytes} B: {s:?}"
        );
        // SAFETY: frees exactly what the launch above handed out (0 is ignored).
        unsafe { k.general_free_bench(want, heap.device_ptr(), p.as_ptr(), want) }.unwrap();
        assert_eq!(heap.class_stats().unwrap()[c].in_use, 0);
    }
    // Past the largest class: null, counted in the header's failures.
    let before = heap.stats().unwrap().failed_allocs;
    let p = DeviceVec::<u64>::zeroed(32, &stream, cuda(&dev)).unwrap();
    // SAFETY: as above.
    unsafe { k.general_malloc_one_bench(32, heap.device_ptr(), p.as_ptr(), 32, (16 << 20) + 1) }
        .unwrap();
    assert!(p.to_vec().unwrap().iter().all(|&a| a == 0));
    let s = heap.stats().unwrap();
    assert_eq!((s.failed_allocs - before, s.in_use), (32, 0));
}

/// The general heap under stress at 2^24 threads: mixed sizes (16 B to 4 KiB), lanes of a warp
/// diverging between allocation, free and nothing, blocks freed by other warps in later
/// launches (every round permutes which thread works on which slot), exhaustion at first and
/// regrowth by the policy between launches. After every round: no block handed out twice (no
/// two live ranges overlap), every live block's contents intact (checked as it is freed, and at
/// the end), and the statistics exactly what the kernels saw.
#[test]
fn stress_2_24_threads_cross_warp_frees_exhaustion_and_regrowth() {
    use carve::heap::GrowOptions;
    const N: u64 = 1 << 24;
    const SEED: u32 = 11;
    let dev = carve::require_gpu!();
    let stream = dev.new_stream().unwrap();
    // Each class starts with one 2 MiB chunk: the first round exhausts most classes.
    let kind = HeapKind::General {
        bytes_per_class: 2 << 20,
    };
    let mut heap = DeviceHeap::growable(kind, &stream, GrowOptions::new(48 << 30, 1)).unwrap();
    let k = HeapKernels::new(&stream);
    let slots = DeviceVec::<u64>::zeroed(N as usize, &stream, cuda(&dev)).unwrap();
    let sizes: Vec<u64> = (0..N).map(|j| test_request_size(j, SEED)).collect();
    let (mut nulls, mut allocs, mut frees) = (0u64, 0u64, 0u64);
    let mut failing_rounds = 0;
    for round in 0..8u32 {
        let counts = DeviceVec::<u32>::zeroed(4, &stream, cuda(&dev)).unwrap();
        // An odd multiplier per round: slot j is handled by a different thread each time.
        let mult = 0x9E37_79B9u64.wrapping_mul(2 * round as u64 + 1) | 1;
        // SAFETY: `slots` holds N u64s of blocks this kernel allocated (or 0); counts is 4 u32s.
        unsafe {
            k.general_churn(
                N,
                heap.device_ptr(),
                slots.as_ptr(),
                N,
                SEED,
                round,
                mult,
                counts.as_ptr(),
            )
        }
        .unwrap();
        let c = counts.to_vec().unwrap();
        assert_eq!(c[0], 0, "round {round}: a block's contents changed");
        nulls += c[1] as u64;
        allocs += c[2] as u64;
        frees += c[3] as u64;
        let live: Vec<(u64, u64)> = slots
            .to_vec()
            .unwrap()
            .into_iter()
            .enumerate()
            .filter(|&(_, p)| p != 0)
            .map(|(j, p)| (p, sizes[j]))
            .collect();
        assert_eq!(live.len() as u64, allocs - frees, "round {round}");
        let mut sorted = live.clone();
        sorted.sort_unstable();
        for w in sorted.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "round {round}: {w:x?} overlap");
        }
        let s = heap.stats().unwrap();
        assert_eq!(
            (s.in_use, s.failed_allocs, s.double_frees, s.foreign_frees),
            (allocs - frees, nulls, 0, 0),
            "round {round}: {s:?}"
        );
        let grew = match heap.after_launch() {
            Ok(r) => format!(
                "grew {} segments, {} MiB in {:?}",
                r.segments_added,
                r.bytes_added >> 20,
                r.elapsed
            ),
            // At the maximum: the heap stays as it is, and says so.
            Err(e @ Error::OutOfMemory { .. }) => format!("did not grow: {e}"),
            Err(e) => panic!("round {round}: {e}"),
        };
        heap.check_invariants().unwrap();
        eprintln!(
            "round {round}: {} allocs, {} null, {} frees, {} live; {grew}",
            c[2],
            c[1],
            c[3],
            live.len(),
        );
        if round == 0 {
            assert!(c[1] > 0, "the first round should exhaust the small classes");
        }
        if c[1] > 0 {
            failing_rounds += 1;
        }
    }
    assert!(failing_rounds < 8, "the heap never grew enough");
    // Every block left is intact and goes back; the heap ends empty.
    let bad = DeviceVec::<u32>::zeroed(1, &stream, cuda(&dev)).unwrap();
    // SAFETY: slot j holds slot j's block (or 0), filled with test_request_size(j, SEED).
    unsafe { k.general_check_free(N, heap.device_ptr(), slots.as_ptr(), N, SEED, bad.as_ptr()) }
        .unwrap();
    assert_eq!(bad.to_vec().unwrap()[0], 0);
    let s = heap.stats().unwrap();
    assert_eq!(
        (s.in_use, s.double_frees, s.foreign_frees),
        (0, 0, 0),
        "{s:?}"
    );
    let t = heap.trim().unwrap();
    eprintln!("trim: {t:?}");
    heap.check_invariants().unwrap();
}
