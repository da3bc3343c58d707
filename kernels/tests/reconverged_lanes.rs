//! Lanes that enter the general heap apart and meet again inside it. On the GPU, lanes of one
//! warp that called `carve_malloc` or `carve_free` at different times (diverged around the
//! call) can reconverge inside the allocator, and `activemask` read there names all of them.
//! Lanes that agreed on one class must then keep to their own: a collective over every lane
//! found there would run one class's claim or free for the lanes of another.
//!
//! The warp here reads `activemask` as such a warp would: its own lanes at the first read (the
//! entry), both groups at every later one.
#![cfg(not(carve_loom))]

mod support;

use std::cell::Cell;

use carve_kernels::size_class::class_of;
use carve_kernels::sync::atomic::AtomicU64;
use carve_kernels::warp::Warp;
use support::general::HostGeneral;
use support::lockstep::{self, Lane};

/// A lane whose `active()` is `own` at its first read and `met` at every later one.
struct Reconverging<'a, 'b> {
    lane: &'a Lane<'b>,
    own: u32,
    met: u32,
    reads: Cell<u32>,
}

impl<'a, 'b> Reconverging<'a, 'b> {
    fn new(lane: &'a Lane<'b>, own: u32, met: u32) -> Self {
        Reconverging {
            lane,
            own,
            met,
            reads: Cell::new(0),
        }
    }
}

impl Warp for Reconverging<'_, '_> {
    const TRACKS_ACTIVE: bool = true;
    fn active(&self) -> u32 {
        let n = self.reads.get();
        self.reads.set(n + 1);
        if n == 0 {
            self.own
        } else {
            self.met
        }
    }
    support::forward_collectives!(lane);
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        self.lane.fetch_or_acquire(a, v)
    }
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        self.lane.fetch_and_release(a, v)
    }
}

/// Lanes 0..16 and 16..32: the two groups that entered apart.
const LOW: u32 = 0x0000_FFFF;
const HIGH: u32 = 0xFFFF_0000;

fn own(lane: u32) -> u32 {
    if lane < 16 {
        LOW
    } else {
        HIGH
    }
}

/// Every block of the class of `bytes`, taken by whole warps until the class has none left.
fn take_all(heap: &HostGeneral, bytes: u64) -> Vec<u64> {
    let mut all = Vec::new();
    for call in 0.. {
        let got = lockstep::run(32, call, |w| heap.malloc(w, bytes) as u64);
        let n = all.len();
        all.extend(got.into_iter().filter(|&p| p != 0));
        if all.len() == n {
            return all;
        }
    }
    unreachable!()
}

/// Two groups, each asking one class of its own, meet inside `malloc`: each lane's block is a
/// block of its own class, claimed there, and each class has exactly its group's blocks in use.
#[test]
fn groups_of_two_classes_that_meet_inside_malloc_claim_each_in_its_own() {
    let heap = HostGeneral::new(1 << 18);
    let size = |l: u32| if l < 16 { 256u64 } else { 1024 };
    let got = lockstep::run(32, 0, |w| {
        let l = w.lane();
        heap.malloc(&Reconverging::new(w, own(l), u32::MAX), size(l)) as u64
    });
    for (l, &p) in got.iter().enumerate() {
        let want = class_of(size(l as u32) as u32).unwrap() as usize;
        assert_eq!(
            heap.block_of(p as *mut u8).map(|b| b.0),
            Some(want),
            "lane {l}: {p:#x}"
        );
        assert!(heap.is_claimed(p as *mut u8), "lane {l}: not claimed");
    }
    for bytes in [256u64, 1024] {
        let c = class_of(bytes as u32).unwrap() as usize;
        assert_eq!(heap.class_stats(c).0, 16, "{bytes} B: blocks in use");
    }
    heap.check();
}

/// Two groups, each freeing a run of its own class, meet inside `free`, their runs laid out so
/// that the second continues the first's block indices: each class loses exactly its group's
/// blocks, and every other block of both classes stays in use.
#[test]
fn groups_of_two_classes_that_meet_inside_free_free_each_in_its_own() {
    let heap = HostGeneral::new(1 << 18);
    let (low, high) = (256u64, 1024u64);
    let mut a = take_all(&heap, low);
    let mut b = take_all(&heap, high);
    a.sort_unstable();
    b.sort_unstable();
    assert!(a.len() >= 64 && b.len() >= 64);
    // Blocks 0..16 of the first class and 16..32 of the second: as one run, indices 0..32.
    let ptrs: Vec<u64> = a[..16].iter().chain(&b[16..32]).copied().collect();
    lockstep::run(32, 0, |w| {
        let l = w.lane();
        heap.free(
            &Reconverging::new(w, own(l), u32::MAX),
            ptrs[l as usize] as *mut u8,
        )
    });
    for (v, gone, name) in [(&a, 0..16, "first"), (&b, 16..32, "second")] {
        for (i, &p) in v.iter().enumerate() {
            assert_eq!(
                heap.is_claimed(p as *mut u8),
                !gone.contains(&i),
                "{name} class, block {i}"
            );
        }
    }
    assert_eq!(heap.total_double_frees(), 0);
    heap.check();
}
