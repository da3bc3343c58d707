//! `carve_malloc`'s entry point (`entry::malloc`, as the PTX runs it) for a whole warp: one match
//! on heap and class sends a warp asking one class of one heap down the class's straight-line
//! slab path; any other warp (another class, 0 bytes, a null heap, a class the heap lacks) takes
//! the generic path and gets what that path gives.

use super::*;
use carve_kernels::entry::{heap_class_key, KEY_UNALIGNED};
use carve_kernels::slab::warp_hint;
use support::entry;

/// The block index of `p` in class `c`.
fn index_in(heap: &HostGeneral, c: usize, p: u64) -> u64 {
    let h = heap.class(c);
    (p - h.data) / h.block_size
}

/// A heap's address as kernels pass it (addresses travel as `u64` between the lanes' threads).
fn at(g: u64) -> *const GeneralHeader {
    g as *const GeneralHeader
}

/// Aligned heaps: one key per (heap, class); an unaligned heap's key is no aligned heap's.
#[test]
fn heap_class_keys_tell_heaps_and_classes_apart() {
    let heaps = [0u64, 4096, 8192, 0x7f00_0000_1000];
    let mut keys: Vec<u64> = heaps
        .iter()
        .flat_map(|&h| (0..=NO_CLASS).map(move |c| heap_class_key(h, c)))
        .collect();
    let n = keys.len();
    keys.sort_unstable();
    keys.dedup();
    assert_eq!(keys.len(), n);
    for h in [8u64, 4096 + 16, 4096 + 63] {
        let k = heap_class_key(h, 3);
        assert_eq!(k & 63, KEY_UNALIGNED);
        assert!(!keys.contains(&k), "{h:#x}");
    }
}

/// A warp asking one class of one heap: lane `l` gets block `warp_hint(seed) + l` of the class,
/// one run claimed straight-line, for several classes and warps of a grid.
#[test]
fn a_warp_asking_one_class_gets_the_run_at_its_hint() {
    let heap = HostGeneral::new(1 << 18);
    let g = heap.ptr() as u64;
    for bytes in [16u64, 48, 64, 1024, 4096] {
        let c = general::request_class(bytes) as usize;
        for seed in [0u32, 1, 5, 77] {
            let got = lockstep::run(32, 0, |w| entry::malloc(at(g), w, bytes, seed) as u64);
            let hint = warp_hint(seed, heap.class(c).capacity);
            for (l, &p) in got.iter().enumerate() {
                assert!(p != 0, "{bytes} B, seed {seed}, lane {l}");
                assert_eq!(heap.block_of(p as *mut u8).map(|b| b.0), Some(c));
                assert!(heap.is_claimed(p as *mut u8));
                // Unless the class is too small for the run, which then goes on out of line.
                if hint + 32 <= heap.class(c).capacity {
                    assert_eq!(
                        index_in(&heap, c, p),
                        hint + l as u64,
                        "{bytes} B, lane {l}"
                    );
                }
            }
            lockstep::run(32, 0, |w| {
                entry::free(at(g), w, got[w.lane() as usize] as *mut u8)
            });
        }
    }
    assert_eq!(heap.total_in_use(), 0);
    assert_eq!(heap.total_double_frees(), 0);
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 0);
    heap.check();
}

/// Warps that are not one class of one heap fall back: one lane of another class, one asking 0
/// bytes, one passing a null heap, every lane past the largest class. Each lane gets a block of
/// its own class or null, and the failures are counted once each.
#[test]
fn warps_of_more_than_one_class_or_heap_fall_back() {
    let heap = HostGeneral::new(1 << 18);
    let g = heap.ptr() as u64;
    type Call = fn(u32) -> (bool, u64);
    let cases: [(&str, Call); 4] = [
        ("another class", |l| (true, if l == 7 { 256 } else { 64 })),
        ("0 bytes", |l| (true, if l == 31 { 0 } else { 64 })),
        ("a null heap", |l| (l != 0, 64)),
        ("past every class", |_| (true, (16 << 20) + 1)),
    ];
    let mut failed = 0;
    for (what, call) in cases {
        let got = lockstep::run(32, 0, |w| {
            let (own, bytes) = call(w.lane());
            entry::malloc(at(if own { g } else { 0 }), w, bytes, 3) as u64
        });
        for (l, &p) in got.iter().enumerate() {
            let (own, bytes) = call(l as u32);
            let served = own && general::request_class(bytes) < heap.plan.nclasses as u32;
            if served {
                heap.assert_block_of(p as *mut u8, bytes);
                assert!(heap.is_claimed(p as *mut u8), "{what}, lane {l}");
            } else {
                assert_eq!(p, 0, "{what}, lane {l}");
                failed += own as u64;
            }
        }
        assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), failed, "{what}");
        let mut live: Vec<u64> = got.iter().copied().filter(|&p| p != 0).collect();
        let n = live.len();
        live.sort_unstable();
        live.dedup();
        assert_eq!(live.len(), n, "{what}: a block handed out twice");
        lockstep::run(32, 0, |w| {
            let (own, _) = call(w.lane());
            let p = got[w.lane() as usize] as *mut u8;
            entry::free(at(if own { g } else { 0 }), w, p)
        });
        assert_eq!(heap.total_in_use(), 0, "{what}");
    }
    assert_eq!(failed, 1 + 32);
    assert_eq!(heap.total_double_frees(), 0);
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 0);
    heap.check();
}

/// Warps on threads of their own at once, each asking one class (two warps per class, so runs
/// of one class race), some rounds with a lane of another class: every block is handed out once,
/// and everything frees back to an empty heap.
#[test]
fn concurrent_one_class_warps_hand_out_each_block_once() {
    const SIZES: [u64; 3] = [16, 64, 1024];
    let heap = HostGeneral::new(1 << 18);
    let g = heap.ptr() as u64;
    for round in 0..4u32 {
        let got: Vec<Vec<u64>> = std::thread::scope(|s| {
            let warps: Vec<_> = (0..6u32)
                .map(|k| {
                    s.spawn(move || {
                        lockstep::run(32, k, |w| {
                            let mixed = round % 2 == 1 && w.lane() == 5;
                            let bytes = if mixed { 256 } else { SIZES[k as usize % 3] };
                            // Seeds 0 and 2^31 share a hint: their runs collide.
                            let seed = (k / 3) << 31;
                            entry::malloc(at(g), w, bytes, seed) as u64
                        })
                    })
                })
                .collect();
            warps.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let mut all: Vec<u64> = got.iter().flatten().copied().collect();
        assert!(
            all.iter().all(|&p| heap.is_claimed(p as *mut u8)),
            "round {round}"
        );
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 6 * 32, "round {round}: a block handed out twice");
        assert_eq!(heap.total_in_use(), 6 * 32);
        heap.check();
        std::thread::scope(|s| {
            for (k, ptrs) in got.iter().enumerate() {
                s.spawn(move || {
                    lockstep::run(32, k as u32, |w| {
                        entry::free(at(g), w, ptrs[w.lane() as usize] as *mut u8)
                    });
                });
            }
        });
        assert_eq!(heap.total_in_use(), 0, "round {round}");
    }
    assert_eq!(heap.total_double_frees(), 0);
    assert_eq!(heap.header_counter(COUNTER_FAILED_ALLOCS), 0);
    heap.check();
}
