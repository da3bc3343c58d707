//! Warps whose lanes ask for several classes in one call: consecutive runs per class group,
//! lost runs, exhausted classes, class chains and random frees among them.

use super::*;

/// Set bits in class `c`'s bitmap (blocks in use as the bitmap sees them).
fn bitmap_ones(heap: &HostGeneral, c: usize) -> u64 {
    let h = heap.class(c);
    (0..h.nwords as usize)
        // SAFETY: `words` holds `nwords` atomics inside the region.
        .map(|i| unsafe { &*(h.words as *const AtomicU64).add(i) })
        .map(|w| w.load(Ordering::Relaxed).count_ones() as u64)
        .sum()
}

/// The block index of `p` in class `c`.
fn index_in(heap: &HostGeneral, c: usize, p: u64) -> u64 {
    let h = heap.class(c);
    (p - h.data) / h.block_size
}

/// Mixed warps on a fresh heap: each class group takes the run where its shard's count stands,
/// so the groups of successive calls line up run after run, and the sixth run of 11 crosses from
/// one bitmap word into the next. Frees in the order blocks were handed out clear whole runs; a
/// second free of everything is counted as double frees, block by block.
#[test]
fn mixed_warps_take_consecutive_runs_and_free_them_whole() {
    // Lanes 0, 3, 6, ... ask 16 B (11 lanes), 1, 4, ... 256 B (11), 2, 5, ... 1 KiB (10).
    const SIZES: [u64; 3] = [16, 256, 1024];
    let heap = HostGeneral::new(1 << 18);
    let classes: Vec<usize> = SIZES
        .iter()
        .map(|&b| class_of(b as u32).unwrap() as usize)
        .collect();
    let mut rounds = Vec::new();
    for round in 0..7u32 {
        let got = lockstep::run(32, round, |w| {
            let bytes = SIZES[w.lane() as usize % 3];
            let p = heap.malloc(w, bytes);
            assert!(!p.is_null(), "lane {}", w.lane());
            // SAFETY: the block is this lane's, at least `bytes` long.
            unsafe { p.write_bytes(round as u8 ^ w.lane() as u8, bytes as usize) };
            p as u64
        });
        for (l, &p) in got.iter().enumerate() {
            heap.assert_block_of(p as *mut u8, SIZES[l % 3]);
        }
        rounds.push(got);
    }
    for (k, &c) in classes.iter().enumerate() {
        let lanes = (k..32).step_by(3).count() as u64;
        let first = index_in(&heap, c, rounds[0][k]);
        for (round, got) in rounds.iter().enumerate() {
            let idx: Vec<u64> = got
                .iter()
                .skip(k)
                .step_by(3)
                .map(|&p| index_in(&heap, c, p))
                .collect();
            let want: Vec<u64> = (0..lanes)
                .map(|r| first + round as u64 * lanes + r)
                .collect();
            assert_eq!(
                idx, want,
                "class {c}, round {round}: one run, after the last"
            );
        }
        assert_eq!(first % 64, 0, "a shard starts at a word");
        assert_eq!(heap.class_stats(c).0, 7 * lanes);
        assert_eq!(bitmap_ones(&heap, c), 7 * lanes);
    }
    // The 16 B group's run of round 5 covers blocks 55..66 of its shard: two words.
    let c16 = index_in(&heap, classes[0], rounds[5][0]) % 64;
    assert_eq!(c16, 55);
    let mut all: Vec<(u64, u64)> = rounds
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, &p)| (p, SIZES[i % 32 % 3]))
        .collect();
    assert!(disjoint(&mut all), "overlap");
    for (round, got) in rounds.iter().enumerate() {
        for (l, &p) in got.iter().enumerate() {
            // SAFETY: written above by this lane in this round; nobody else holds it.
            let s = unsafe { std::slice::from_raw_parts(p as *const u8, SIZES[l % 3] as usize) };
            assert!(s.iter().all(|&b| b == round as u8 ^ l as u8), "{round}/{l}");
        }
    }
    // Free each round in the order it was handed out: each group clears its run whole.
    for (round, got) in rounds.iter().enumerate() {
        lockstep::run(32, round as u32, |w| {
            heap.free(w, got[w.lane() as usize] as *mut u8)
        });
    }
    for &c in &classes {
        assert_eq!(heap.class_stats(c).0, 0, "class {c}");
        assert_eq!(bitmap_ones(&heap, c), 0, "class {c}: bits left set");
    }
    // A round again, the crossing one: each block a double free, none taken from the counts.
    lockstep::run(32, 0, |w| {
        heap.free(w, rounds[5][w.lane() as usize] as *mut u8)
    });
    let doubles: u64 = classes.iter().map(|&c| heap.class_stats(c).4).sum();
    assert_eq!(doubles, 32);
    assert_eq!(heap.total_in_use(), 0);
    assert_eq!(heap.header_counter(COUNTER_FOREIGN_FREES), 0);
}

/// Blocks in shard 0 of class `c` (its cursor wraps there).
fn shard_blocks(heap: &HostGeneral, c: usize) -> u64 {
    64 << heap.class(c).shard_words_log2
}

/// Fills shard 0 of the 48 B class with warps whose lanes below 16 ask 48 B (the rest 64 B), so that the class's cursor has gone once round the shard; returns each call's
/// pointers and the class.
fn fill_shard_of_48(heap: &HostGeneral) -> (Vec<Vec<u64>>, usize) {
    let c = class_of(48).unwrap() as usize;
    let calls = shard_blocks(heap, c) / 16;
    let mut got = Vec::new();
    for call in 0..calls as u32 {
        got.push(lockstep::run(32, call, |w| {
            let bytes = if w.lane() < 16 { 48 } else { 64 };
            let p = heap.malloc(w, bytes);
            assert!(!p.is_null());
            // SAFETY: the block is this lane's, at least its size long.
            unsafe { p.write_bytes(call as u8 ^ (w.lane() as u8) << 3, bytes as usize) };
            p as u64
        }));
    }
    assert_eq!(index_in(heap, c, got[0][0]), 0, "shard 0 first");
    assert_eq!(bitmap_ones(heap, c), shard_blocks(heap, c), "shard 0 full");
    (got, c)
}

/// Frees lanes `lanes` of `ptrs` (48 B blocks) in one call.
fn free_lanes(heap: &HostGeneral, ptrs: &[u64], lanes: core::ops::Range<u32>) {
    lockstep::run(32, 0, |w| {
        let p = if lanes.contains(&w.lane()) {
            ptrs[w.lane() as usize]
        } else {
            0
        };
        heap.free(w, p as *mut u8)
    });
}

/// Once a class's cursor has gone round its shard, a group's run lies on blocks still in use:
/// the leader's retry takes the blocks freed in the run's word, among its clear bits, in the
/// same step, rank by rank.
#[test]
fn a_group_whose_run_is_lost_takes_the_clear_bits_of_its_word() {
    let heap = HostGeneral::new(1 << 18);
    let (mut got, c) = fill_shard_of_48(&heap);
    let per = shard_blocks(&heap, c);
    // Call 1's sixteen blocks (16..32) back; the cursor points at 0, where call 0's lie.
    free_lanes(&heap, &got[1], 0..16);
    let again = lockstep::run(32, 99, |w| {
        let bytes = if w.lane() < 16 { 48 } else { 64 };
        heap.malloc(w, bytes) as u64
    });
    let idx: Vec<u64> = again[..16].iter().map(|&p| index_in(&heap, c, p)).collect();
    assert_eq!(
        idx,
        (16..32).collect::<Vec<u64>>(),
        "the freed blocks in rank order, none other"
    );
    assert_eq!(heap.class_stats(c).0, per);
    assert_eq!(bitmap_ones(&heap, c), per);
    heap.check();
    got[1][..16].fill(0);
    got.push(again);
    for ptrs in &got {
        lockstep::run(32, 0, |w| heap.free(w, ptrs[w.lane() as usize] as *mut u8));
    }
    assert_eq!(heap.total_in_use(), 0);
    assert_eq!(heap.total_double_frees(), 0);
    heap.check();
}

/// A class whose head segment runs out under a mixed warp goes on down its chain (as a grown
/// heap links it): the lanes the head left without a block take the next segment's, every block
/// of both is handed out once, and each lane left without one is counted once as failed.
#[test]
fn a_mixed_warp_goes_on_down_a_class_chain() {
    let c = class_of(4096).unwrap() as usize;
    let (head, tail) = linked_chain(c);
    let cap = head.class(c).capacity + tail.class(c).capacity;
    let calls = (cap / 16 + 2) as u32;
    let mut got_big: Vec<u64> = Vec::new();
    for call in 0..calls {
        let got = lockstep::run(32, call, |w| {
            let bytes = if w.lane() % 2 == 0 { 4096 } else { 16 };
            head.malloc(w, bytes) as u64
        });
        assert!(got.iter().skip(1).step_by(2).all(|&p| p != 0));
        got_big.extend(got.iter().step_by(2).filter(|&&p| p != 0));
    }
    let in_seg = |g: &HostGeneral, p: u64| {
        let h = g.class(c);
        p >= h.data
            && p < h.data + h.capacity * h.block_size
            && (p - h.data).is_multiple_of(h.block_size)
    };
    assert!(got_big
        .iter()
        .all(|&p| in_seg(&head, p) || in_seg(&tail, p)));
    let mut uniq = got_big.clone();
    uniq.sort_unstable();
    uniq.dedup();
    assert_eq!((uniq.len() as u64, got_big.len() as u64), (cap, cap));
    let failed = 16 * calls as u64 - cap;
    assert_eq!(
        head.class_stats(c).2 + tail.class_stats(c).2,
        failed,
        "each failure counted once"
    );
    assert_eq!(head.class_stats(c).0 + tail.class_stats(c).0, cap);
}

/// The head of a class chain linked to `tail`'s class `c`, both in host memory.
fn linked_chain(c: usize) -> (HostGeneral, HostGeneral) {
    let (head, tail) = (HostGeneral::new(1 << 16), HostGeneral::new(1 << 16));
    // SAFETY: class `c`'s handle lies in `head`'s region, which nothing else reads now.
    unsafe {
        let h = head.base.add(head.plan.class_offset(c)) as *mut HeapHandle;
        (*h).next = tail.class(c) as *const HeapHandle as u64;
    }
    (head, tail)
}

/// A group whose cursor run wins nothing in a chain's full head goes on down the chain first;
/// when the rest of the chain is full too, it takes the clear bits left in the head after all,
/// and no lane that got a block is counted as failed.
#[test]
fn a_group_lost_in_a_full_head_tries_the_chain_then_the_heads_clear_bits() {
    let c = class_of(4096).unwrap() as usize;
    let (head, tail) = linked_chain(c);
    let cap = head.class(c).capacity + tail.class(c).capacity;
    let mixed = |call: u32, big: u32| {
        lockstep::run(32, call, |w| {
            let bytes = if w.lane() < big { 4096 } else { 16 };
            head.malloc(w, bytes) as u64
        })
    };
    // Fill both segments, one big block per call, then hand one of the head's back.
    let mut big = Vec::new();
    for call in 0..cap as u32 {
        let p = mixed(call, 1)[0];
        assert_ne!(p, 0, "call {call}");
        big.push(p);
    }
    let in_head = |p: u64| {
        let h = head.class(c);
        p >= h.data && p < h.data + h.capacity * h.block_size
    };
    let hole = *big.iter().find(|&&p| in_head(p)).unwrap();
    lockstep::run(32, 0, |w| {
        head.free(w, if w.lane() == 0 { hole } else { 0 } as *mut u8)
    });
    let failed_before = head.class_stats(c).2 + tail.class_stats(c).2;
    let again = mixed(900, 1)[0];
    assert_eq!(again, hole, "the head's one clear block");
    assert_eq!(head.class_stats(c).2 + tail.class_stats(c).2, failed_before);
    // Now every block is in use: a lane left without one is counted once.
    assert_eq!(mixed(901, 1)[0], 0);
    assert_eq!(
        head.class_stats(c).2 + tail.class_stats(c).2,
        failed_before + 1
    );
    assert_eq!(head.class_stats(c).0 + tail.class_stats(c).0, cap);
}

/// A group's run is lost at its cursor and its word has no clear bit: the lanes take a run at
/// the cursor of the next shard with room, not the clear bits ahead of their own cursor, which
/// stay for that cursor's later runs: the group whose run reaches them takes them first.
#[test]
fn a_group_lost_at_its_cursor_takes_the_next_shards_cursor_run() {
    let heap = HostGeneral::new(1 << 18);
    let (mut got, c) = fill_shard_of_48(&heap);
    let per = shard_blocks(&heap, c);
    // Eight of call 5's blocks (80..88, word 1) back; word 0, under the cursor, stays full.
    free_lanes(&heap, &got[5], 0..8);
    let mut last = Vec::new();
    // Runs at 0, 16, 32 and 48 of shard 0 are lost; the one at 64 reaches word 1.
    for call in 77..82u32 {
        last.push(lockstep::run(32, call, |w| {
            let bytes = if w.lane() < 16 { 48 } else { 64 };
            let p = heap.malloc(w, bytes);
            assert!(!p.is_null());
            // SAFETY: as in `fill_shard_of_48`.
            unsafe { p.write_bytes(call as u8 ^ (w.lane() as u8) << 3, bytes as usize) };
            p as u64
        }));
    }
    let idx: Vec<Vec<u64>> = last
        .iter()
        .map(|l| l[..16].iter().map(|&p| index_in(&heap, c, p)).collect())
        .collect();
    let mut want: Vec<Vec<u64>> = (0..4)
        .map(|k| (per + 16 * k..per + 16 * (k + 1)).collect())
        .collect();
    want.push((80..88).chain(per + 64..per + 72).collect());
    assert_eq!(
        idx, want,
        "the next shard's cursor, then word 1's clear bits"
    );
    assert_eq!(heap.class_stats(c).0, per + 72);
    assert_eq!(bitmap_ones(&heap, c), per + 72);
    heap.check();
    got[5][..8].fill(0);
    let calls = got.len();
    got.extend(last);

    let mut all: Vec<(u64, u64)> = Vec::new();
    for (call, ptrs) in got.iter().enumerate() {
        let call = if call >= calls {
            77 + call - calls
        } else {
            call
        };
        for (l, &p) in ptrs.iter().enumerate().filter(|&(_, &p)| p != 0) {
            let bytes = if l < 16 { 48 } else { 64 };
            heap.assert_block_of(p as *mut u8, bytes);
            // SAFETY: written above by this lane; nobody else holds it.
            let s = unsafe { std::slice::from_raw_parts(p as *const u8, bytes as usize) };
            assert!(s.iter().all(|&b| b == call as u8 ^ (l as u8) << 3));
            all.push((p, bytes));
        }
    }
    assert!(disjoint(&mut all), "overlap");
    for ptrs in &got {
        lockstep::run(32, 0, |w| heap.free(w, ptrs[w.lane() as usize] as *mut u8));
    }
    assert_eq!(heap.total_in_use(), 0);
    assert_eq!(bitmap_ones(&heap, c), 0);
    assert_eq!(heap.total_double_frees(), 0);
    heap.check();
}

/// Mixed warps with frees in random order between calls, so that runs are lost, retried,
/// cross words and go out of line in every mix: no block is handed out twice, contents stay
/// intact, and the counts and bitmaps match the blocks live at every step.
#[test]
fn mixed_warps_among_random_frees_keep_every_block() {
    const SIZES: [u64; 5] = [16, 48, 80, 256, 1024];
    let heap = HostGeneral::new(1 << 18);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || support::xorshift(&mut rng);
    // (pointer, size, tag) of each live block.
    let mut live: Vec<(u64, u64, u8)> = Vec::new();
    for call in 0..48u32 {
        let mix = next();
        let sizes: Vec<u64> = (0..32)
            .map(|l| SIZES[((mix >> (2 * l)) % 5) as usize])
            .collect();
        let got = lockstep::run(32, call, |w| {
            let bytes = sizes[w.lane() as usize];
            let p = heap.malloc(w, bytes);
            assert!(!p.is_null(), "call {call}, lane {}", w.lane());
            // SAFETY: the block is this lane's, at least `bytes` long.
            unsafe { p.write_bytes(call as u8 ^ w.lane() as u8, bytes as usize) };
            p as u64
        });
        live.extend(
            got.iter()
                .zip(&sizes)
                .enumerate()
                .map(|(l, (&p, &b))| (p, b, call as u8 ^ l as u8)),
        );
        // Free 16 to 32 blocks picked at random: some 8 more live after each call.
        let n = 16 + (next() % 17) as usize;
        let freed = take_at_random(&mut live, n, &mut next);
        for &(p, b, tag) in &freed {
            // SAFETY: a live block of `b` bytes written with `tag`; nobody else holds it.
            let s = unsafe { std::slice::from_raw_parts(p as *const u8, b as usize) };
            assert!(
                s.iter().all(|&x| x == tag),
                "call {call}: block {p:#x} overwritten"
            );
        }
        lockstep::run(32, call, |w| {
            let p = freed.get(w.lane() as usize).map_or(0, |f| f.0);
            heap.free(w, p as *mut u8)
        });
        let mut sorted: Vec<(u64, u64)> = live.iter().map(|&(p, b, _)| (p, b)).collect();
        assert!(disjoint(&mut sorted), "call {call}: overlap");
        for &b in &SIZES {
            let c = class_of(b as u32).unwrap() as usize;
            let n = live.iter().filter(|l| l.1 == b).count() as u64;
            assert_eq!(heap.class_stats(c).0, n, "call {call}, {b} B: count");
            assert_eq!(bitmap_ones(&heap, c), n, "call {call}, {b} B: bitmap");
        }
    }
    for chunk in live.chunks(32) {
        lockstep::run(32, 0, |w| {
            let p = chunk.get(w.lane() as usize).map_or(0, |f| f.0);
            heap.free(w, p as *mut u8)
        });
    }
    assert_eq!(heap.total_in_use(), 0);
    assert_eq!(heap.total_double_frees(), 0);
}

/// A group's run that would reach past the end of its shard is taken where the cursor stands
/// after it instead, in the same step (no lane goes out of line): its blocks are consecutive,
/// one run for the leader of its free, and the run after it follows on. The blocks the cursor
/// passed over are handed out on its next lap.
#[test]
fn a_run_that_would_pass_its_shards_end_is_taken_after_it() {
    let heap = HostGeneral::new(1 << 18);
    let c = class_of(48).unwrap() as usize;
    let per = shard_blocks(&heap, c);
    let call = |lanes: u32, slot: u32| {
        lockstep::run(32, slot, |w| {
            let bytes = if w.lane() < lanes { 48 } else { 64 };
            heap.malloc(w, bytes) as u64
        })
    };
    let give_back = |calls: &[Vec<u64>]| {
        for ptrs in calls {
            lockstep::run(32, 0, |w| heap.free(w, ptrs[w.lane() as usize] as *mut u8));
        }
        assert_eq!(heap.total_in_use(), 0);
    };
    let indices = |ptrs: &[u64], lanes: usize| -> Vec<u64> {
        ptrs[..lanes]
            .iter()
            .map(|&p| index_in(&heap, c, p))
            .collect()
    };
    // The cursor of shard 0 to 8 blocks before its end, every block back.
    let mut warm = vec![call(8, 0)];
    warm.extend((1..per / 16).map(|k| call(16, k as u32)));
    give_back(&warm);
    let runs = [call(16, 500), call(16, 501)];
    assert_eq!(indices(&runs[0], 16), (8..24).collect::<Vec<u64>>());
    assert_eq!(indices(&runs[1], 16), (24..40).collect::<Vec<u64>>());
    for (l, &p) in runs[0].iter().enumerate() {
        heap.assert_block_of(p as *mut u8, if l < 16 { 48 } else { 64 });
    }
    heap.check();
    give_back(&runs);
    // Round the shard again to where the first move began: the blocks it passed over are next.
    let lap: Vec<Vec<u64>> = (0..(per - 48) / 16)
        .map(|k| call(16, 600 + k as u32))
        .collect();
    give_back(&lap);
    let tail = [call(8, 700), call(8, 701)];
    assert_eq!(indices(&tail[0], 8), (per - 8..per).collect::<Vec<u64>>());
    assert_eq!(indices(&tail[1], 8), (0..8).collect::<Vec<u64>>());
    give_back(&tail);
    assert_eq!(heap.total_double_frees(), 0);
    heap.check();
}
