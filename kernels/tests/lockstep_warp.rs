//! The host lock-step warp (`support::lockstep`): its collectives, then the slab's multi-lane
//! allocation and free paths run by 32 lanes at once through the PTX entry points' own code
//! (`carve_kernels::entry`).
#![cfg(not(carve_loom))]

mod support;

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use carve_kernels::heap_layout::*;
use carve_kernels::slab;
use carve_kernels::warp::{Among, Warp};
use support::entry;
use support::lockstep::{self, Lane};
use support::HostHeap;

fn full(n: u32) -> u32 {
    (u64::MAX >> (64 - n)) as u32
}

fn mask_where(n: u32, f: impl Fn(u32) -> bool) -> u32 {
    (0..n).filter(|&l| f(l)).fold(0, |m, l| m | 1 << l)
}

// ---- the emulation itself ----

#[test]
fn shfl_reads_every_source_lane() {
    for n in [32, 7, 1] {
        lockstep::run(n, 0, |w| {
            let all = w.active();
            assert_eq!(all, full(n));
            for src in 0..n {
                assert_eq!(w.shfl(all, w.lane() * 7 + 1, src), src * 7 + 1);
                let v = u64::MAX - w.lane() as u64;
                assert_eq!(w.shfl64(all, v, src), u64::MAX - src as u64);
            }
        });
    }
}

#[test]
fn ballot_and_match_group_the_lanes() {
    for n in [32, 6, 1] {
        lockstep::run(n, 0, |w| {
            let all = w.active();
            let l = w.lane();
            assert_eq!(w.ballot(all, l % 3 == 0), mask_where(n, |x| x % 3 == 0));
            assert_eq!(w.ballot(all, false), 0);
            assert_eq!(
                w.match_any(all, (l % 4) as u64 | 1 << 40),
                mask_where(n, |x| x % 4 == l % 4)
            );
            assert!(w.match_all(all, 0xABCD_0000_0000));
            assert_eq!(w.match_all(all, l as u64), n == 1);
            // Differs only in the high half: 64-bit values are compared whole.
            assert_eq!(w.match_all(all, (l as u64 % 2) << 33), n == 1);
            assert_eq!(
                w.or_reduce(all, 1 << (2 * l)),
                (0..n).fold(0u64, |m, x| m | 1 << (2 * x))
            );
        });
    }
}

/// `active()` inside a branch is the lanes that took it; a lane that finished leaves the mask;
/// a subset runs collectives of its own while the rest wait at one over the whole warp.
#[test]
fn active_follows_divergence_and_exits() {
    let got = lockstep::run(32, 0, |w| {
        let l = w.lane();
        let mut seen = Vec::new();
        if l % 3 == 1 {
            let m = w.active();
            seen.push(m);
            // Collectives of the subset only.
            seen.push(w.ballot(m, l > 16));
            seen.push(w.match_any(m, (l % 2) as u64));
        }
        w.sync();
        seen.push(w.active());
        if l >= 20 {
            return seen;
        }
        w.sync();
        seen.push(w.active());
        seen
    });
    let branch = mask_where(32, |x| x % 3 == 1);
    for (l, seen) in got.iter().enumerate() {
        let l = l as u32;
        let mut want = Vec::new();
        if l % 3 == 1 {
            want.push(branch);
            want.push(branch & mask_where(32, |x| x > 16));
            want.push(branch & mask_where(32, |x| x % 2 == l % 2));
        }
        want.push(u32::MAX);
        if l < 20 {
            want.push(full(20));
        }
        assert_eq!(*seen, want, "lane {l}");
    }
}

/// Lanes waiting on each other at calls with different masks: every lane panics, none hangs.
#[test]
#[should_panic(expected = "deadlocked")]
fn mismatched_masks_are_reported_not_hung() {
    lockstep::run(3, 0, |w| {
        let mask = [0b011, 0b111, 0b110][w.lane() as usize];
        w.ballot(mask, true);
    });
}

/// A lane that returned never arrives: a collective whose mask names it fails the test (whether
/// the lane returns before the others reach it or while they wait), as it is undefined
/// behaviour on the GPU.
#[test]
#[should_panic(expected = "returned")]
fn a_collective_naming_a_lane_that_returned_fails() {
    lockstep::run(4, 0, |w| {
        if w.lane() == 3 {
            return;
        }
        w.ballot(0b1111, true);
    });
}

// ---- the slab, 32 lanes at once ----

/// `carve_slab_alloc` on a heap handle of the test.
fn entry_alloc(h: &HeapHandle, w: &Lane<'_>, seed: u32) -> *mut u8 {
    entry::slab_alloc(h, w, seed)
}

/// `carve_slab_free` on a heap handle of the test.
fn entry_free(h: &HeapHandle, w: &Lane<'_>, ptr: *mut u8) {
    entry::slab_free(h, w, ptr)
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// What the lanes of one test share: who owns each block, and the live and failed counts.
struct Ledger<'a> {
    heap: &'a HostHeap,
    bs: u64,
    owner: Vec<AtomicU32>,
    live: AtomicU64,
    nulls: AtomicU64,
}

impl<'a> Ledger<'a> {
    fn new(heap: &'a HostHeap, bs: u64) -> Self {
        Ledger {
            heap,
            bs,
            owner: (0..heap.handle.capacity)
                .map(|_| AtomicU32::new(0))
                .collect(),
            live: AtomicU64::new(0),
            nulls: AtomicU64::new(0),
        }
    }

    /// Checks a block just handed to `tag`'s owner: in the heap, at a block start, nobody
    /// else's; writes `tag` through it.
    fn take(&self, p: *mut u8, tag: u32) {
        if p.is_null() {
            self.nulls.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let off = (p as u64)
            .checked_sub(self.heap.data_start())
            .expect("below the heap");
        assert_eq!(off % self.bs, 0, "{p:?} not at a block start");
        assert_eq!(p as u64 % 16, 0, "{p:?} not 16-byte aligned");
        let idx = (off / self.bs) as usize;
        assert!(idx < self.owner.len(), "{p:?} past the heap");
        assert_eq!(
            self.owner[idx].swap(tag, Ordering::Relaxed),
            0,
            "block {idx} handed out twice"
        );
        for k in 0..self.bs / 4 {
            // SAFETY: the block is this lane's until it frees it.
            unsafe {
                (p as *mut u32)
                    .add(k as usize)
                    .write_volatile(tag ^ k as u32)
            };
        }
        self.live.fetch_add(1, Ordering::Relaxed);
    }

    /// Checks a block about to be freed still holds `tag`'s words, and gives it up.
    fn give(&self, p: *mut u8, tag: u32) {
        for k in 0..self.bs / 4 {
            // SAFETY: as for `take`.
            let v = unsafe { (p as *const u32).add(k as usize).read_volatile() };
            assert_eq!(v, tag ^ k as u32, "block {p:?} overwritten");
        }
        let idx = ((p as u64 - self.heap.data_start()) / self.bs) as usize;
        assert_eq!(self.owner[idx].swap(0, Ordering::Relaxed), tag);
        self.live.fetch_sub(1, Ordering::Relaxed);
    }

    /// Between rounds (every lane past a `sync`): the heap's counts are exact.
    fn check_quiet(&self) {
        let live = self.live.load(Ordering::Relaxed);
        assert_eq!(self.heap.in_use(), live, "shard counts");
        assert_eq!(self.heap.bits_set(), live, "bitmap");
        assert_eq!(
            self.heap.counter(COUNTER_FAILED_ALLOCS),
            self.nulls.load(Ordering::Relaxed),
            "failed allocations"
        );
    }
}

/// 32 lanes, many rounds: whole-warp allocations and frees (the fast paths), and rounds where
/// a random subset allocates or frees random blocks (the generic paths, grouped frees). No block
/// is handed out twice, every free is reusable, and the counts are exact between rounds.
#[test]
fn slab_32_lanes_diverge_never_share_a_block_and_keep_exact_counts() {
    let cap = 1500u64; // not a multiple of 64
    let bs = 48u64; // not a power of two
    let heap = HostHeap::slab(cap, bs, Some(1), FLAG_CHECKED_FREES);
    let ledger = Ledger::new(&heap, bs);
    // Miri runs a few rounds of the same schedule.
    let rounds = if cfg!(miri) { 8 } else { 160 };
    lockstep::run(32, 3, |w| {
        let l = w.lane();
        let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ ((l as u64 + 1) * 0x1234_5678);
        let mut held: Vec<(*mut u8, u32)> = Vec::new();
        for round in 0..rounds {
            let tag = (l + 1) << 24 | round;
            // The round stands for the warp index: one hint for every lane.
            let seed = round;
            match round % 4 {
                // Every lane allocates.
                0 => {
                    let p = entry_alloc(&heap.handle, w, seed);
                    ledger.take(p, tag);
                    if !p.is_null() {
                        held.push((p, tag));
                    }
                }
                // Every lane frees what it got last round (in rank order: `free_run`).
                1 => {
                    let (p, tag) = held.pop().unwrap_or((std::ptr::null_mut(), 0));
                    if !p.is_null() {
                        ledger.give(p, tag);
                    }
                    entry_free(&heap.handle, w, p);
                }
                // A random subset allocates.
                2 => {
                    if held.len() < 30 && !xorshift(&mut rng).is_multiple_of(3) {
                        let p = entry_alloc(&heap.handle, w, seed);
                        ledger.take(p, tag);
                        if !p.is_null() {
                            held.push((p, tag));
                        }
                    }
                }
                // A random subset frees a random block.
                _ => {
                    if !held.is_empty() && xorshift(&mut rng).is_multiple_of(2) {
                        let j = (xorshift(&mut rng) % held.len() as u64) as usize;
                        let (p, tag) = held.swap_remove(j);
                        ledger.give(p, tag);
                        entry_free(&heap.handle, w, p);
                    }
                }
            }
            w.sync();
            if l == 0 {
                ledger.check_quiet();
            }
            w.sync();
        }
        for (p, tag) in held {
            ledger.give(p, tag);
            entry_free(&heap.handle, w, p);
        }
    });
    ledger.check_quiet();
    assert_eq!(heap.in_use(), 0);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 0);
    assert!(heap.peak_sum() >= 32 && heap.peak_sum() <= cap);
}

/// A heap of fewer blocks than the requests: exactly `capacity` requests succeed, the rest get
/// null and are counted; the blocks a subset frees all come back; nothing is corrupted.
#[test]
fn slab_32_lanes_exhaust_exactly_and_recover() {
    let cap = 100u64; // two shards of one word, the second partial
    let bs = 32u64;
    let heap = HostHeap::slab(cap, bs, Some(0), FLAG_CHECKED_FREES);
    let ledger = Ledger::new(&heap, bs);
    let served = AtomicU64::new(0);
    lockstep::run(32, 0, |w| {
        let l = w.lane();
        let mut held: Vec<(*mut u8, u32)> = Vec::new();
        // 5 rounds of 32 requests for 100 blocks, then more with every hint.
        for round in 0..8u32 {
            let p = entry_alloc(&heap.handle, w, round);
            let tag = (l + 1) << 24 | round;
            ledger.take(p, tag);
            if !p.is_null() {
                held.push((p, tag));
            }
            w.sync();
        }
        served.fetch_add(held.len() as u64, Ordering::Relaxed);
        w.sync();
        if l == 0 {
            assert_eq!(
                served.load(Ordering::Relaxed),
                cap,
                "exactly capacity served"
            );
            assert_eq!(ledger.nulls.load(Ordering::Relaxed), 8 * 32 - cap);
            ledger.check_quiet();
        }
        w.sync();
        // Odd lanes free all theirs, one block per call (divergent frees).
        let freed = if l % 2 == 1 { held.len() as u64 } else { 0 };
        if l % 2 == 1 {
            for (p, tag) in held.drain(..) {
                ledger.give(p, tag);
                entry_free(&heap.handle, w, p);
            }
        }
        w.sync();
        if l == 0 {
            ledger.check_quiet();
        }
        // Every freed block comes back, and no more.
        w.sync();
        let mut again = 0u64;
        for round in 0..8u32 {
            let p = entry_alloc(&heap.handle, w, round + 8);
            let tag = (l + 1) << 24 | (round + 8);
            ledger.take(p, tag);
            if !p.is_null() {
                held.push((p, tag));
                again += 1;
            }
            w.sync();
        }
        served.fetch_sub(freed, Ordering::Relaxed);
        served.fetch_add(again, Ordering::Relaxed);
        w.sync();
        if l == 0 {
            assert_eq!(
                served.load(Ordering::Relaxed),
                cap,
                "the freed blocks all came back"
            );
            ledger.check_quiet();
        }
        w.sync();
        for (p, tag) in held {
            ledger.give(p, tag);
            entry_free(&heap.handle, w, p);
        }
    });
    ledger.check_quiet();
    assert_eq!(heap.in_use(), 0);
    assert_eq!(heap.counter(COUNTER_DOUBLE_FREES), 0);
    assert_eq!(heap.counter(COUNTER_FOREIGN_FREES), 0);
}

/// Two segments: the lanes the first cannot serve move on to the second (the generic path);
/// frees of each segment, one segment per call, leave each one's counts and bitmap exact.
#[test]
fn slab_32_lanes_chain_of_two_segments() {
    let (a, b) = two_segments();
    let head = chain(&a, &b);
    let got = lockstep::run(32, 0, |w| {
        let held = fill_two_segments(&head, w);
        // One block of `a` (round 0), then one of `b` (round 2), per lane.
        entry_free(&head, w, held[0] as *mut u8);
        w.sync();
        entry_free(&head, w, held[2] as *mut u8);
        w.sync();
        held
    });
    check_two_segments(&a, &b, &got, (32, 32));
}

/// As above, but even lanes free a block of `a` and odd lanes one of `b` in the same call.
/// Lanes freeing into `a` and into `b` may reach the segment's free converged (this emulator's
/// `active()` groups every lane waiting there; `activemask` on the GPU may do the same):
/// `chain_free_each` must group them by segment before it groups by bitmap word. (Before it
/// did, the head lane cleared the whole run in its own segment: blocks of `a` that odd lanes
/// still held were freed, and `b` kept the blocks they gave back.)
#[test]
fn slab_32_lanes_free_into_two_segments_in_one_call() {
    let (a, b) = two_segments();
    let head = chain(&a, &b);
    let got = lockstep::run(32, 0, |w| {
        let held = fill_two_segments(&head, w);
        let p = held[if w.lane() % 2 == 0 { 0 } else { 2 }] as *mut u8;
        entry_free(&head, w, p);
        w.sync();
        held
    });
    check_two_segments(&a, &b, &got, (16, 16));
}

/// Segments of 64 and 48 blocks.
fn two_segments() -> (HostHeap, HostHeap) {
    (
        HostHeap::slab(64, 16, None, FLAG_CHECKED_FREES),
        HostHeap::slab(48, 16, None, FLAG_CHECKED_FREES),
    )
}

/// A copy of `a`'s handle that chains `b` after it (taken once the heaps stay put: moving a
/// `HostHeap` moves its boxed handle, which Miri treats as invalidating the address).
fn chain(a: &HostHeap, b: &HostHeap) -> HeapHandle {
    let mut head = *a.handle;
    head.next = &*b.handle as *const HeapHandle as u64;
    head
}

/// Five whole-warp rounds for 112 blocks: rounds 0 and 1 fill `a`, 2 and 3 fill `b`.
fn fill_two_segments(head: &HeapHandle, w: &Lane<'_>) -> Vec<u64> {
    let mut held = Vec::new();
    for round in 0..5u32 {
        let p = entry_alloc(head, w, round);
        if !p.is_null() {
            held.push(p as u64);
        }
        w.sync();
    }
    assert!(held.len() >= 3, "lane {}: {held:x?}", w.lane());
    held
}

/// Every block once; `freed` blocks of `a` and of `b` free again; counts match bitmaps.
fn check_two_segments(a: &HostHeap, b: &HostHeap, got: &[Vec<u64>], freed: (u64, u64)) {
    let mut all: Vec<u64> = got.iter().flatten().copied().collect();
    assert_eq!(all.len(), 64 + 48);
    all.sort_unstable();
    all.dedup();
    assert_eq!(all.len(), 64 + 48, "no block twice");
    assert_eq!(b.counter(COUNTER_FAILED_ALLOCS), 5 * 32 - 64 - 48);
    assert_eq!(
        a.counter(COUNTER_FAILED_ALLOCS),
        0,
        "counted at the last segment"
    );
    assert_eq!(a.bits_set(), 64 - freed.0, "segment a's bitmap");
    assert_eq!(b.bits_set(), 48 - freed.1, "segment b's bitmap");
    assert_eq!(a.bits_set(), a.in_use(), "segment a");
    assert_eq!(b.bits_set(), b.in_use(), "segment b");
    assert_eq!(
        a.counter(COUNTER_DOUBLE_FREES) + b.counter(COUNTER_DOUBLE_FREES),
        0
    );
    assert_eq!(a.counter(COUNTER_FOREIGN_FREES), 0);
}

/// A fixed set of lanes (`Among`, as the general heap's class groups call) that the first
/// segment serves only in part: the rest go on to the next segment as a warp of their own.
/// (Before they did, they ran the next segment's collectives under the whole group's mask, with
/// the served lanes gone and its leader among them: every one of them got null.)
#[test]
fn a_fixed_group_runs_on_through_the_chain() {
    let a = HostHeap::slab(20, 16, None, FLAG_CHECKED_FREES);
    let b = HostHeap::slab(48, 16, None, FLAG_CHECKED_FREES);
    let head = chain(&a, &b);
    for (bump_a, bump_b, bump) in [(None, None, false), (Some(20 * 16), Some(48 * 16), true)] {
        let (ba, bb) = (
            HostHeap::bump(bump_a.unwrap_or(16), 0, 0),
            HostHeap::bump(bump_b.unwrap_or(16), 0, 0),
        );
        let bump_head = chain(&ba, &bb);
        let got = lockstep::run(32, 0, |w| {
            let group = Among {
                warp: w,
                mask: w.active(),
            };
            // SAFETY: formatted host chains; every lane of the group calls.
            let p = unsafe {
                if bump {
                    carve_kernels::bump::chain_alloc(&bump_head, &group, 16, 16)
                } else {
                    slab::chain_alloc(&head, &group, 0)
                }
            };
            p as u64
        });
        assert!(got.iter().all(|&p| p != 0), "bump {bump}: {got:x?}");
        let mut all = got.clone();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), 32, "no block twice");
        let (first, second) = if bump { (&ba, &bb) } else { (&a, &b) };
        let in_first = got
            .iter()
            .filter(|&&p| p >= first.data_start() && p < first.data_start() + 20 * 16)
            .count();
        if bump {
            // A warp's reservation is whole: 512 bytes do not fit the first arena's 320.
            assert_eq!(in_first, 0);
            assert_eq!(second.bump_offset(), 32 * 16);
        } else {
            assert_eq!(in_first, 20);
        }
        assert_eq!(first.counter(COUNTER_FAILED_ALLOCS), 0);
        assert_eq!(second.counter(COUNTER_FAILED_ALLOCS), 0);
        if !bump {
            assert_eq!((a.bits_set(), b.bits_set()), (20, 12));
        }
    }
}
