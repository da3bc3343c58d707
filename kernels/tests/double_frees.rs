//! Double and foreign frees on slabs whose shard counts are cursors (a general heap's classes,
//! `FLAG_CURSOR_SHARDS`): a free there clears its bit and nothing else, so a cleared bit can be
//! claimed at once. A double free before reallocation, in one warp or across warps, must be
//! counted and change nothing; a foreign free likewise.
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::thread;

use carve_kernels::general::test_request_size;
use carve_kernels::heap_layout::*;
use carve_kernels::slab::Slab;
use carve_kernels::warp::{SoloLane, Warp};
use support::entry;
use support::general::HostGeneral;
use support::lockstep::{self, Lane};
use support::HostHeap;

/// A slab of `cap` blocks of 16 B whose shard counts are cursors.
fn cursor_slab(cap: u64) -> HostHeap {
    HostHeap::slab(cap, 16, Some(0), FLAG_CHECKED_FREES | FLAG_CURSOR_SHARDS)
}

/// The cursor view of `heap`.
fn view(heap: &HostHeap) -> Slab<'_> {
    // SAFETY: the test heap outlives every use, and blocks are used only by their owner.
    unsafe { Slab::new(&heap.handle) }.cursors(true)
}

/// A lane of a lock-step warp whose first `fetch_and` runs `then` (another warp's work) right
/// after it, and whose other lanes' `fetch_and`s wait for that: the interleaving where another
/// warp claims a block between two lanes' clears of it.
struct Hooked<'a, 'b> {
    lane: &'a Lane<'b>,
    first: &'a AtomicBool,
    done: &'a AtomicBool,
    then: &'a (dyn Fn() + Sync),
}

impl Warp for Hooked<'_, '_> {
    const TRACKS_ACTIVE: bool = true;
    fn active(&self) -> u32 {
        self.lane.active()
    }
    support::forward_collectives!(lane);
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        if !self.first.swap(true, Ordering::SeqCst) {
            let old = a.fetch_and(v, Ordering::Release);
            (self.then)();
            self.done.store(true, Ordering::SeqCst);
            return old;
        }
        while !self.done.load(Ordering::SeqCst) {
            thread::yield_now();
        }
        a.fetch_and(v, Ordering::Release)
    }
}

/// Two lanes of one warp free the same block while another warp allocates: the block is
/// cleared once, the other lane's free is counted as a double free, and the block the other
/// warp got stays its own (its bit set), however the clears and the claim interleave.
#[test]
fn a_double_free_in_one_warp_never_frees_the_next_owners_block() {
    let heap = cursor_slab(2);
    let w = SoloLane::default();
    let a = view(&heap).alloc(&w, 0, true);
    let b = view(&heap).alloc(&w, 0, true);
    assert!(!a.is_null() && !b.is_null() && a != b);
    let a = a as u64;
    let got = Mutex::new(0u64);
    let then = || *got.lock().unwrap() = view(&heap).alloc(&SoloLane { slot: 7 }, 0, true) as u64;
    let (first, done) = (AtomicBool::new(false), AtomicBool::new(false));
    lockstep::run(2, 0, |lane| {
        let hooked = Hooked {
            lane,
            first: &first,
            done: &done,
            then: &then,
        };
        let slab = view(&heap);
        slab.free_index(&hooked, slab.index_of(a as *mut u8).unwrap());
    });
    let got = *got.lock().unwrap();
    assert_eq!(got, a, "the other warp took the freed block");
    assert!(
        heap.is_claimed(heap.index_of(a as *mut u8).unwrap()),
        "its block was freed under it"
    );
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 1);
    assert_eq!(heap.bits_set(), 2);
    heap.check();
}

/// Warps of mixed classes: a second free of a block in the same call (two lanes), in a later
/// call (another warp), and frees of interior pointers and of pointers outside every class,
/// are all counted and change nothing; the blocks still in use stay in use, and what comes
/// back is handed out once.
#[test]
fn double_and_foreign_frees_in_mixed_warps_are_counted_and_harmless() {
    let heap = HostGeneral::new(1 << 18);
    let size = |l: u32| [16u64, 48, 256][l as usize % 3];
    let got = lockstep::run(32, 0, |w| heap.malloc(w, size(w.lane())) as u64);
    assert!(got.iter().all(|&p| p != 0));
    // Lanes 16.. free lanes 0..16's blocks too: each of those is freed twice in one call.
    lockstep::run(32, 0, |w| {
        let l = w.lane() as usize;
        heap.free(w, got[l % 16] as *mut u8)
    });
    assert_eq!(heap.total_double_frees(), 16);
    assert_eq!(heap.total_in_use(), 16);
    heap.check();
    // Another warp frees them again, with interior pointers and a pointer of no class.
    let outside = [0u64; 4];
    let outside = outside.as_ptr() as u64;
    lockstep::run(32, 0, |w| {
        let l = w.lane() as usize;
        let p = match l {
            0..16 => got[l],
            16..24 => got[l] + 8,
            _ => outside,
        };
        heap.free(w, p as *mut u8)
    });
    assert_eq!(heap.total_double_frees(), 32);
    let foreign: u64 = (0..heap.plan.nclasses).map(|c| heap.class_stats(c).3).sum();
    assert_eq!(foreign, 8, "interior pointers");
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 8, "outside");
    assert_eq!(heap.total_in_use(), 16);
    assert!(got[16..].iter().all(|&p| heap.is_claimed(p as *mut u8)));
    heap.check();
    // Two warps' worth comes back distinct, and never one of the blocks still in use.
    let mut all = got[16..].to_vec();
    for call in 1..3 {
        all.extend(lockstep::run(32, call, |w| {
            heap.malloc(w, size(w.lane())) as u64
        }));
    }
    assert_held_once(&heap, all);
}

/// `all`, blocks of `heap` that are in use: none null, none twice, and nothing else in use.
fn assert_held_once(heap: &HostGeneral, mut all: Vec<u64>) {
    assert!(all.iter().all(|&p| p != 0));
    let n = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), n, "a block handed out twice");
    assert_eq!(heap.total_in_use(), n as u64);
    heap.check();
}

/// A general heap's address as kernels pass it (addresses travel as `u64` between the lanes'
/// threads).
fn at(g: u64) -> *const GeneralHeader {
    g as *const GeneralHeader
}

/// `carve_free`'s entry point for whole warps of mixed classes (the path the PTX takes when all
/// 32 lanes call on one heap): the runs of a second free of everything, in the same order, are
/// counted block by block; two warps freeing the same runs at once clear each block once; a
/// second free of a block in the same call (two lanes), with null and interior pointers and
/// one of no class around it, is counted and changes nothing. What comes back is handed out
/// once.
#[test]
fn whole_mixed_warps_freeing_through_the_entry_point_count_every_double_free() {
    let heap = HostGeneral::new(1 << 18);
    let g = heap.ptr() as u64;
    let size = |l: u32| [16u64, 48, 256][l as usize % 3];
    let malloc = |call: u32| {
        lockstep::run(32, call, |w| {
            entry::malloc(at(g), w, size(w.lane()), call) as u64
        })
    };
    let free = |ptrs: &[u64]| {
        lockstep::run(32, 0, |w| {
            entry::free(at(g), w, ptrs[w.lane() as usize] as *mut u8)
        })
    };
    let got = malloc(0);
    assert!(got.iter().all(|&p| p != 0));
    free(&got);
    assert_eq!(heap.total_in_use(), 0);
    free(&got);
    assert_eq!(heap.total_double_frees(), 32, "a second free of each run");
    assert_eq!(heap.total_in_use(), 0);
    heap.check();
    // Two warps free the same runs at once: each block is cleared by one of them.
    let got = malloc(1);
    assert_eq!(heap.total_in_use(), 32);
    thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| free(&got));
        }
    });
    assert_eq!(
        heap.total_double_frees(),
        64,
        "one of the two frees of each block"
    );
    assert_eq!(heap.total_in_use(), 0);
    heap.check();
    // Lanes 16..24 free lanes 0..8's blocks again in the same call; lanes 24..28 pass interior
    // pointers of lanes 8..12's blocks, lanes 28..30 null, lanes 30.. a pointer of no class.
    let got = malloc(2);
    let outside = [0u64; 4];
    let outside = outside.as_ptr() as u64;
    let mixed: Vec<u64> = (0..32)
        .map(|l| match l {
            0..16 => got[l],
            16..24 => got[l - 16],
            24..28 => got[l - 16] + 8,
            28..30 => 0,
            _ => outside,
        })
        .collect();
    free(&mixed);
    assert_eq!(heap.total_double_frees(), 64 + 8);
    let interior: u64 = (0..heap.plan.nclasses).map(|c| heap.class_stats(c).3).sum();
    assert_eq!(interior, 4);
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 2);
    assert_eq!(heap.total_in_use(), 16);
    assert!(got[16..].iter().all(|&p| heap.is_claimed(p as *mut u8)));
    heap.check();
    let mut all = got[16..].to_vec();
    all.extend(malloc(3));
    all.extend(malloc(4));
    assert_held_once(&heap, all);
}

/// Real threads, each a warp of one lane: each allocates mixed sizes from classes all threads
/// share (160 B to 4 KiB), frees some of them as it goes, and frees blocks of a class of its own
/// (16 B to 128 B) twice: a double free before any reallocation, while the other threads
/// allocate and free around it. It checks the pattern of every block it holds after every
/// step: a block handed out twice shows as a pattern overwritten. Every double free is
/// counted, and the heap is empty and whole at the end.
#[test]
fn threads_double_freeing_never_share_a_block() {
    let heap = HostGeneral::new(1 << 20);
    let threads = 8u32;
    let rounds = 200u64;
    thread::scope(|s| {
        for t in 0..threads {
            let heap = &heap;
            s.spawn(move || {
                let w = SoloLane { slot: t };
                let own = 16 * (t as u64 + 1);
                let mut held: Vec<(*mut u8, u64, u8)> = Vec::new();
                for r in 0..rounds {
                    let bytes = 160 + test_request_size(r * 64 + t as u64, 5) % 3937;
                    let tag = (t as u8) << 4 | (r as u8 & 15);
                    for n in [bytes, own] {
                        let p = heap.malloc(&w, n);
                        assert!(!p.is_null(), "thread {t} round {r}");
                        // SAFETY: this thread's block, at least `n` long.
                        unsafe { p.write_bytes(tag, n as usize) };
                        held.push((p, n, tag));
                    }
                    // This thread's own class: freed twice, nobody can take it in between.
                    let (q, n, _) = held.pop().unwrap();
                    assert_eq!(n, own);
                    heap.free(&w, q);
                    heap.free(&w, q);
                    if r % 3 == 2 {
                        let (q, _, _) = held.swap_remove((r as usize * 7) % held.len());
                        heap.free(&w, q);
                    }
                    for &(q, n, tag) in &held {
                        // SAFETY: held by this thread.
                        let s = unsafe { std::slice::from_raw_parts(q, n as usize) };
                        assert!(
                            s.iter().all(|&b| b == tag),
                            "thread {t}: a block was shared"
                        );
                    }
                }
                for (q, _, _) in held {
                    heap.free(&w, q);
                }
            });
        }
    });
    assert_eq!(heap.total_double_frees(), threads as u64 * rounds);
    assert_eq!(heap.total_in_use(), 0);
    heap.check();
}

/// `Slab::free_blocks`, a mixed group leader's free of its run, refuses a run that is empty,
/// longer than 32 blocks or not inside the segment, changing nothing; a run inside it frees
/// its blocks across a word boundary and counts the ones that were free already.
#[test]
fn a_run_freed_by_its_leader_is_checked_and_counts_blocks_already_free() {
    let heap = cursor_slab(100);
    let slab = view(&heap);
    let w = SoloLane::default();
    for i in 0..100 {
        assert!(!slab.alloc(&w, i, true).is_null());
    }
    for (base, lanes) in [(0, 0), (0, 33), (90, 11), (u64::MAX, 2)] {
        assert!(!slab.free_blocks(&w, base, lanes), "{base} + {lanes}");
    }
    assert_eq!(heap.bits_set(), 100);
    assert!(slab.free_blocks(&w, 60, 8));
    assert_eq!(heap.bits_set(), 92);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    // Blocks 60..68 are free now: a run over 56..72 clears 8 and counts the other 8.
    assert!(slab.free_blocks(&w, 56, 16));
    assert_eq!(heap.bits_set(), 84);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 8);
    assert!(slab.free_blocks(&w, 68, 32));
    assert_eq!(heap.bits_set(), 56);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 8 + 4);
}
