//! A heap formatted the way another process does it (`ForeignHeapPlan`: a zeroed region plus one
//! handle copy) is a working heap: carve's own slab and bump code, run on CPU threads over host
//! memory, allocate from it, exhaust it exactly, and its statistics decode from the prefix.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashSet;

use carve::heap::ForeignHeapPlan;
use carve_kernels::heap_layout::HeapHandle;
use carve_kernels::warp::SoloLane;
use carve_kernels::{bump, slab};

/// A zeroed, aligned host region holding a heap formatted from `plan`.
struct Region {
    ptr: *mut u8,
    layout: Layout,
}

impl Region {
    fn format(plan: &ForeignHeapPlan) -> Region {
        let layout = Layout::from_size_align(plan.bytes(), plan.align() as usize).unwrap();
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null());
        let handle = plan.handle_bytes_at(ptr as u64).unwrap();
        // SAFETY: the region is at least 128 bytes long and nothing else uses it yet.
        unsafe { std::ptr::copy_nonoverlapping(handle.as_ptr(), ptr, handle.len()) };
        Region { ptr, layout }
    }

    fn handle(&self) -> &HeapHandle {
        // SAFETY: the region starts with the 8-aligned handle written by `format`.
        unsafe { &*(self.ptr as *const HeapHandle) }
    }

    fn stats(&self, plan: &ForeignHeapPlan) -> carve::HeapStats {
        // SAFETY: the prefix lies inside the region; no thread is allocating now.
        let prefix = unsafe { std::slice::from_raw_parts(self.ptr, plan.stats_bytes()) };
        plan.stats(prefix).unwrap()
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: allocated in `format` with this layout.
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

const THREADS: u64 = 8;

#[test]
fn slab_in_a_foreign_region_exhausts_exactly_and_frees() {
    let cap = 4096u64;
    let plan = ForeignHeapPlan::slab(cap, 48).unwrap();
    let region = Region::format(&plan);
    let h = region.handle();
    let got: Vec<u64> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                s.spawn(move || {
                    let warp = SoloLane { slot: t as u32 };
                    (0..cap * 2 / THREADS)
                        // SAFETY: `h` is a formatted slab that outlives the scope.
                        .map(|i| unsafe { slab::chain_alloc(h, &warp, t * 1000 + i) } as u64)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    let live: Vec<u64> = got.iter().copied().filter(|&p| p != 0).collect();
    assert_eq!(live.len() as u64, cap, "exactly K of 2K succeed");
    assert_eq!(live.iter().collect::<HashSet<_>>().len(), live.len());
    assert!(live
        .iter()
        .all(|&p| p >= h.data && p + 48 <= h.data + cap * 48));
    let s = region.stats(&plan);
    assert_eq!((s.in_use, s.failed_allocs), (cap, cap), "{s:?}");
    let warp = SoloLane::default();
    for &p in &live {
        // SAFETY: each block is freed once.
        unsafe { slab::chain_free(h, &warp, p as *mut u8) };
    }
    // SAFETY: a pointer outside the heap is counted, not trusted.
    unsafe { slab::chain_free(h, &warp, 16 as *mut u8) };
    let s = region.stats(&plan);
    assert_eq!(
        (s.in_use, s.double_frees, s.foreign_frees),
        (0, 0, 1),
        "{s:?}"
    );
    assert!(s.high_water >= cap);
}

#[test]
fn bump_in_a_foreign_region_serves_disjoint_aligned_ranges() {
    let cap = 1u64 << 20;
    let plan = ForeignHeapPlan::bump(cap).unwrap();
    let region = Region::format(&plan);
    let h = region.handle();
    let warp = SoloLane::default();
    let mut got = Vec::new();
    loop {
        // SAFETY: `h` is a formatted bump arena.
        let p = unsafe { bump::chain_alloc(h, &warp, 1000, 64) } as u64;
        if p == 0 {
            break;
        }
        got.push(p);
    }
    assert!(got.iter().all(|p| p % 64 == 0));
    got.sort_unstable();
    assert!(got.windows(2).all(|w| w[1] - w[0] >= 1000));
    assert!(got.len() as u64 >= cap / 1024 * 9 / 10, "{}", got.len());
    let s = region.stats(&plan);
    assert_eq!(s.failed_allocs, 1);
    assert!(s.in_use >= got.len() as u64 * 1000 && s.in_use <= cap);
}
