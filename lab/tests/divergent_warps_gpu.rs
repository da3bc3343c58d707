//! The device heap on the GPU with warps whose lanes pass different arguments, as
//! `kernels/carve_heap.h` allows: null heaps and heaps of another kind, two heaps in each warp,
//! interior, misaligned and foreign pointers, double frees, in one call
//! (`carve_test_heap_per_lane`). Each lane's block must come from its own heap; bad frees are
//! counted and free nothing; every heap's counts are exact after each launch. Run under
//! compute-sanitizer (tests/gpu/sanitize.sh) for synccheck and racecheck. Skips without a GPU.

use std::sync::Arc;

use carve::{CudaMemoryResource, Device, DeviceHeap, DeviceVec, SharedResource, Stream};
use carve_lab::heap::HeapKernels;

/// Threads per launch: 64 warps.
const N: usize = 2048;

const SLAB_ALLOC: u32 = 0;
const SLAB_FREE: u32 = 1;
const BUMP_ALLOC: u32 = 2;
const MALLOC: u32 = 3;
const FREE: u32 = 4;

fn cuda(dev: &Device) -> SharedResource {
    Arc::new(CudaMemoryResource::new(dev))
}

struct Gpu {
    dev: Device,
    stream: Stream,
}

impl Gpu {
    fn new(dev: Device) -> Self {
        let stream = dev.new_stream().unwrap();
        Gpu { dev, stream }
    }

    fn slab(&self, capacity: u64, block_size: u64) -> DeviceHeap {
        DeviceHeap::slab(cuda(&self.dev), &self.stream, capacity, block_size).unwrap()
    }

    fn general(&self) -> DeviceHeap {
        DeviceHeap::general(cuda(&self.dev), &self.stream, 1 << 20).unwrap()
    }

    /// One launch: thread `i` makes call `op` on `heaps[i]` with `args[i]`; the results.
    fn call(&self, op: u32, heaps: &[u64], args: &[u64]) -> Vec<u64> {
        assert_eq!(heaps.len(), args.len());
        let n = heaps.len();
        let h = DeviceVec::from_slice(heaps, &self.stream, cuda(&self.dev)).unwrap();
        let a = DeviceVec::from_slice(args, &self.stream, cuda(&self.dev)).unwrap();
        let out = DeviceVec::<u64>::zeroed(n, &self.stream, cuda(&self.dev)).unwrap();
        let k = HeapKernels::new(&self.stream);
        // SAFETY: three arrays of n u64s; every heap is 0 or a live heap of this test.
        unsafe { k.per_lane(n as u64, op, h.as_ptr(), a.as_ptr(), out.as_ptr(), n as u64) }
            .unwrap();
        out.to_vec().unwrap()
    }

    /// Every lane allocates from `heap` (a slab or a general heap, 64 bytes).
    fn fill(&self, heap: &DeviceHeap, general: bool) -> Vec<u64> {
        let op = if general { MALLOC } else { SLAB_ALLOC };
        let got = self.call(op, &vec![heap.device_ptr(); N], &vec![64; N]);
        assert!(got.iter().all(|&p| p != 0));
        got
    }
}

/// `p` is a block start of the slab `heap`.
fn in_slab(heap: &DeviceHeap, p: u64) -> bool {
    let h = heap.handle();
    p >= h.data && p < h.data + h.capacity * h.block_size && (p - h.data) % h.block_size == 0
}

fn assert_distinct(got: &[u64]) {
    let mut live: Vec<u64> = got.iter().copied().filter(|&p| p != 0).collect();
    let n = live.len();
    live.sort_unstable();
    live.dedup();
    assert_eq!(live.len(), n, "a block handed out twice");
}

/// (in use, failed, double frees, foreign frees).
fn counts(heap: &DeviceHeap) -> (u64, u64, u64, u64) {
    let s = heap.stats().unwrap();
    (s.in_use, s.failed_allocs, s.double_frees, s.foreign_frees)
}

#[test]
fn null_and_wrong_kind_lanes_get_null_and_the_rest_are_served() {
    let gpu = Gpu::new(carve::require_gpu!());
    let slab = gpu.slab(4096, 64);
    let bump = DeviceHeap::bump(cuda(&gpu.dev), &gpu.stream, 1 << 20).unwrap();
    let general = gpu.general();
    let (s, b, g) = (slab.device_ptr(), bump.device_ptr(), general.device_ptr());
    // Lane i's heap: its own kind, null, its own kind, another kind.
    let pick = |own: u64, other: u64| -> Vec<u64> {
        (0..N).map(|i| [own, 0, own, other][i % 4]).collect()
    };
    let served = |i: usize| i % 2 == 0;

    let got = gpu.call(SLAB_ALLOC, &pick(s, b), &vec![0; N]);
    for (i, &p) in got.iter().enumerate() {
        assert_eq!(served(i), in_slab(&slab, p), "lane {i}: {p:#x}");
        assert!(served(i) || p == 0, "lane {i}: {p:#x}");
    }
    assert_distinct(&got);
    assert_eq!(counts(&slab), (N as u64 / 2, 0, 0, 0));
    // Lanes without a slab pass their neighbour's block: ignored, as null heaps are.
    let frees: Vec<u64> = (0..N).map(|i| got[i & !1]).collect();
    gpu.call(SLAB_FREE, &pick(s, b), &frees);
    assert_eq!(counts(&slab), (0, 0, 0, 0));

    let got = gpu.call(BUMP_ALLOC, &pick(b, s), &vec![48; N]);
    let (start, end) = (bump.handle().data, bump.handle().data + bump.capacity());
    let mut live = Vec::new();
    for (i, &p) in got.iter().enumerate() {
        if served(i) {
            assert!(
                p >= start && p + 48 <= end && p % 16 == 0,
                "lane {i}: {p:#x}"
            );
            live.push(p);
        } else {
            assert_eq!(p, 0, "lane {i}");
        }
    }
    live.sort_unstable();
    assert!(live.windows(2).all(|w| w[1] - w[0] >= 48), "ranges overlap");
    assert_eq!(bump.stats().unwrap().failed_allocs, 0);

    let got = gpu.call(MALLOC, &pick(g, s), &vec![64; N]);
    assert!(got.iter().enumerate().all(|(i, &p)| served(i) == (p != 0)));
    assert_distinct(&got);
    assert_eq!(counts(&general), (N as u64 / 2, 0, 0, 0));
    let frees: Vec<u64> = (0..N).map(|i| got[i & !1]).collect();
    gpu.call(FREE, &pick(g, s), &frees);
    assert_eq!(counts(&general), (0, 0, 0, 0));
    assert_eq!(
        counts(&slab),
        (0, 0, 0, 0),
        "the slab passed as another kind"
    );
}

#[test]
fn two_heaps_in_every_warp_alloc_and_free_each_in_its_own() {
    let gpu = Gpu::new(carve::require_gpu!());
    let (a, b) = (gpu.slab(4096, 64), gpu.slab(4096, 64));
    let alternate: Vec<u64> = (0..N)
        .map(|i| [a.device_ptr(), b.device_ptr()][i % 2])
        .collect();
    let got = gpu.call(SLAB_ALLOC, &alternate, &vec![0; N]);
    for (i, &p) in got.iter().enumerate() {
        let own = if i % 2 == 0 { &a } else { &b };
        assert!(in_slab(own, p), "lane {i}: {p:#x} is no block of its heap");
    }
    assert_distinct(&got);
    assert_eq!(counts(&a), (N as u64 / 2, 0, 0, 0));
    assert_eq!(counts(&b), (N as u64 / 2, 0, 0, 0));
    gpu.call(SLAB_FREE, &alternate, &got);
    assert_eq!(counts(&a), (0, 0, 0, 0));
    assert_eq!(counts(&b), (0, 0, 0, 0));

    // Whole warps fill each heap; then, in every warp, lanes 0..16 free their run of `a` and
    // lanes 16..32 the same places of `b`: each heap loses exactly its own lanes' blocks.
    let (in_a, in_b) = (gpu.fill(&a, false), gpu.fill(&b, false));
    let lower = |i: usize| i % 32 < 16;
    let heaps: Vec<u64> = (0..N)
        .map(|i| {
            if lower(i) {
                a.device_ptr()
            } else {
                b.device_ptr()
            }
        })
        .collect();
    let ptrs: Vec<u64> = (0..N)
        .map(|i| if lower(i) { in_a[i] } else { in_b[i] })
        .collect();
    gpu.call(SLAB_FREE, &heaps, &ptrs);
    assert_eq!(counts(&a), (N as u64 / 2, 0, 0, 0));
    assert_eq!(counts(&b), (N as u64 / 2, 0, 0, 0));
    let heaps: Vec<u64> = (0..N)
        .map(|i| {
            if lower(i) {
                b.device_ptr()
            } else {
                a.device_ptr()
            }
        })
        .collect();
    let ptrs: Vec<u64> = (0..N)
        .map(|i| if lower(i) { in_b[i] } else { in_a[i] })
        .collect();
    gpu.call(SLAB_FREE, &heaps, &ptrs);
    assert_eq!(counts(&a), (0, 0, 0, 0));
    assert_eq!(counts(&b), (0, 0, 0, 0));

    // Two general heaps, one size: the class's straight-line paths would serve a whole warp.
    let (g, h) = (gpu.general(), gpu.general());
    let alternate: Vec<u64> = (0..N)
        .map(|i| [g.device_ptr(), h.device_ptr()][i % 2])
        .collect();
    let got = gpu.call(MALLOC, &alternate, &vec![64; N]);
    assert!(got.iter().all(|&p| p != 0));
    assert_distinct(&got);
    assert_eq!(counts(&g), (N as u64 / 2, 0, 0, 0));
    assert_eq!(counts(&h), (N as u64 / 2, 0, 0, 0));
    gpu.call(FREE, &alternate, &got);
    assert_eq!(counts(&g), (0, 0, 0, 0));
    assert_eq!(counts(&h), (0, 0, 0, 0));
}

/// Lane `i`'s free, by `i % 8`: its block, an interior pointer, a misaligned one, a block of
/// another heap, an address outside every heap, null, its block with a null heap, its block.
fn bad_frees(heap: u64, mine: &[u64], theirs: &[u64]) -> (Vec<u64>, Vec<u64>) {
    (0..N)
        .map(|i| match i % 8 {
            1 => (heap, mine[i] + 8),
            2 => (heap, mine[i] + 1),
            3 => (heap, theirs[i]),
            4 => (heap, 0x10),
            5 => (heap, 0),
            6 => (0, mine[i]),
            _ => (heap, mine[i]),
        })
        .unzip()
}

#[test]
fn bad_pointers_in_one_warp_are_counted_and_free_nothing() {
    let gpu = Gpu::new(carve::require_gpu!());
    let n = N as u64;
    for general in [false, true] {
        let (a, b) = if general {
            (gpu.general(), gpu.general())
        } else {
            (gpu.slab(4096, 64), gpu.slab(4096, 64))
        };
        let (mine, theirs) = (gpu.fill(&a, general), gpu.fill(&b, general));
        let (heaps, ptrs) = bad_frees(a.device_ptr(), &mine, &theirs);
        gpu.call(if general { FREE } else { SLAB_FREE }, &heaps, &ptrs);
        // Freed: lanes 0 and 7 of every 8; counted: lanes 1 to 4.
        assert_eq!(counts(&a), (n - n / 4, 0, 0, n / 2), "general {general}");
        assert_eq!(counts(&b), (n, 0, 0, 0), "general {general}");
        // The rest, once each.
        let (heaps, ptrs): (Vec<u64>, Vec<u64>) = (0..N)
            .map(|i| match i % 8 {
                0 | 7 => (0, 0),
                _ => (a.device_ptr(), mine[i]),
            })
            .unzip();
        gpu.call(if general { FREE } else { SLAB_FREE }, &heaps, &ptrs);
        assert_eq!(counts(&a), (0, 0, 0, n / 2), "general {general}");
    }
}

#[test]
fn double_frees_in_one_warp_and_across_launches_are_counted() {
    let gpu = Gpu::new(carve::require_gpu!());
    let n = N as u64;
    for general in [false, true] {
        let (a, b) = if general {
            (gpu.general(), gpu.general())
        } else {
            (gpu.slab(4096, 64), gpu.slab(4096, 64))
        };
        let free = if general { FREE } else { SLAB_FREE };
        let (in_a, in_b) = (gpu.fill(&a, general), gpu.fill(&b, general));
        // Lanes 0..16 of a warp on `a`, 16..32 on `b`; lane 1 frees lane 0's block again, and
        // lane 17 lane 16's.
        let heaps: Vec<u64> = (0..N)
            .map(|i| [a.device_ptr(), b.device_ptr()][i % 32 / 16])
            .collect();
        let ptrs: Vec<u64> = (0..N)
            .map(|i| {
                let j = if i % 16 == 1 { i - 1 } else { i };
                [in_a[j], in_b[j]][i % 32 / 16]
            })
            .collect();
        gpu.call(free, &heaps, &ptrs);
        // Each warp frees 15 distinct blocks of each heap, one of them twice.
        let warps = n / 32;
        let held = n - 15 * warps;
        assert_eq!(counts(&a), (held, 0, warps, 0), "general {general}");
        assert_eq!(counts(&b), (held, 0, warps, 0), "general {general}");
        // A later launch frees lane 0's block a third time and lane 1's for the first.
        let ptrs: Vec<u64> = (0..N)
            .map(|i| match i % 16 {
                0 | 1 => [in_a[i], in_b[i]][i % 32 / 16],
                _ => 0,
            })
            .collect();
        gpu.call(free, &heaps, &ptrs);
        assert_eq!(counts(&a), (n / 2, 0, 2 * warps, 0), "general {general}");
        assert_eq!(counts(&b), (n / 2, 0, 2 * warps, 0), "general {general}");
    }
}
