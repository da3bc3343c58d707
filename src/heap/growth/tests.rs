use super::*;
use carve_kernels::heap_layout as layout;

const MIB: usize = 1 << 20;
const SLAB: HeapKind = HeapKind::Slab { block_size: 64 };
const CHECKED: u32 = layout::FLAG_CHECKED_FREES;

fn stats(capacity: u64, in_use: u64) -> HeapStats {
    HeapStats {
        capacity,
        in_use,
        ..HeapStats::empty(SLAB)
    }
}

#[test]
fn policy_grows_only_above_the_watermark() {
    let p = GrowthPolicy {
        watermark: 0.5,
        step: 0,
    };
    assert_eq!(policy_need(&p, &stats(100, 50), 0), 0, "at the mark");
    // 51 in use at a 0.5 mark wants 102 blocks.
    assert_eq!(policy_need(&p, &stats(100, 51), 0), 2);
    assert_eq!(policy_need(&p, &stats(100, 100), 0), 100);
    let full = GrowthPolicy {
        watermark: 1.0,
        step: 0,
    };
    assert_eq!(policy_need(&full, &stats(100, 100), 0), 0, "full is fine");
    // Failed requests count as wanted: 100 + 30 at mark 1.0 wants 130.
    assert_eq!(policy_need(&full, &stats(100, 100), 30), 30);
    // Failures always grow, even when the fill reads low.
    assert_eq!(policy_need(&full, &stats(100, 10), 1), 1);
    // A huge demand saturates instead of overflowing.
    assert_eq!(policy_need(&p, &stats(10, u64::MAX), 0), u64::MAX - 10);
}

#[test]
fn bad_policies_and_options_are_typed_errors() {
    for w in [0.0, -1.0, 1.5, f64::NAN, f64::INFINITY] {
        let p = GrowthPolicy {
            watermark: w,
            step: 0,
        };
        assert!(matches!(p.check(), Err(Error::InvalidArgument(_))), "{w}");
    }
    assert!(GrowthPolicy::default().check().is_ok());
    assert!(matches!(
        check_options(SLAB, &GrowOptions::new(0, 10)),
        Err(Error::ZeroSize)
    ));
    assert!(matches!(
        check_options(SLAB, &GrowOptions::new(MIB, 0)),
        Err(Error::ZeroSize)
    ));
    let general = HeapKind::General {
        bytes_per_class: 1 << 20,
    };
    assert!(matches!(
        check_options(general, &GrowOptions::new(MIB, 1)),
        Err(Error::Unsupported(_))
    ));
    assert!(matches!(units_for_bytes(SLAB, 0), Err(Error::ZeroSize)));
    assert_eq!(units_for_bytes(SLAB, 65).unwrap(), 2);
    assert_eq!(units_for_bytes(SLAB, 64).unwrap(), 1);
    assert_eq!(units_for_bytes(HeapKind::Bump, 1000).unwrap(), 1000);
}

#[test]
fn segments_double_so_chains_stay_short() {
    let mut total = 1000u64;
    let mut segments = 1;
    // Needs of one block at a time, a million times over: the chain grows logarithmically.
    while total < 1_000_000 {
        total += segment_capacity(total, 1, 0);
        segments += 1;
    }
    assert!(segments <= 12, "{segments} segments");
    assert_eq!(segment_capacity(10, 50, 0), 50, "the need wins");
    assert_eq!(segment_capacity(10, 5, 70), 70, "the step wins");
    assert_eq!(segment_capacity(10, 5, 0), 10, "doubling");
}

#[test]
fn segments_fill_their_chunks_and_respect_the_room() {
    let chunk = 2 * MIB;
    // 1000 blocks of 64 B take one chunk: the segment is grown to fill it.
    let c = plan_segment(SLAB, CHECKED, 1000, 1000, chunk, Some(8 * MIB)).unwrap();
    assert!(c > 30_000, "{c}");
    let raw = raw_bytes(SLAB, CHECKED, c).unwrap();
    assert!(raw <= chunk);
    assert!(
        raw_bytes(SLAB, CHECKED, c + 1).unwrap() > chunk,
        "the largest"
    );
    // The want does not fit but the need does: as much as the room holds.
    let want = 1 << 20; // 64 MiB of blocks
    let c = plan_segment(SLAB, CHECKED, want, 10, chunk, Some(5 * MIB)).unwrap();
    let raw = raw_bytes(SLAB, CHECKED, c).unwrap();
    assert!(
        raw <= 4 * MIB && raw > 4 * MIB - 4096,
        "{raw}: two whole chunks"
    );
    // Not even the need fits: typed out-of-memory.
    assert!(matches!(
        plan_segment(SLAB, CHECKED, want, want, chunk, Some(8 * MIB)),
        Err(Error::OutOfMemory { .. })
    ));
    assert!(matches!(
        plan_segment(SLAB, CHECKED, 10, 10, chunk, Some(MIB)),
        Err(Error::OutOfMemory { .. })
    ));
    assert!(matches!(
        plan_segment(SLAB, CHECKED, 10, 0, chunk, None),
        Err(Error::ZeroSize)
    ));
    // Over a plain resource (chunk 1, no room bound): exactly what was asked.
    assert_eq!(plan_segment(SLAB, CHECKED, 777, 5, 1, None).unwrap(), 777);
    assert!(matches!(
        plan_segment(SLAB, CHECKED, u64::MAX, u64::MAX, 1, None),
        Err(Error::SizeOverflow { .. })
    ));
    // Bump: bytes, filling the chunk.
    let b = plan_segment(HeapKind::Bump, 0, 4096, 4096, chunk, None).unwrap();
    assert!(b > chunk as u64 - 64 * 1024 && b < chunk as u64, "{b}");
    assert!(raw_bytes(HeapKind::Bump, 0, b).unwrap() <= chunk);
}

#[test]
fn fitted_capacity_is_the_largest_that_fits() {
    for kind in [
        SLAB,
        HeapKind::Slab { block_size: 48 },
        HeapKind::Slab { block_size: 4096 },
        HeapKind::Bump,
    ] {
        for bytes in [MIB, 2 * MIB, 6 * MIB, 64 * MIB] {
            let c = fit_capacity(kind, CHECKED, 1, bytes);
            assert!(raw_bytes(kind, CHECKED, c).unwrap() <= bytes, "{kind:?}");
            assert!(
                raw_bytes(kind, CHECKED, c + 1).unwrap() > bytes,
                "{kind:?} {bytes}: {c} + 1 also fits"
            );
        }
    }
}

#[test]
fn trim_keeps_the_first_segment_and_every_busy_one() {
    assert_eq!(trim_plan(&[0, 0, 5, 0]), vec![1, 3]);
    assert_eq!(trim_plan(&[0]), Vec::<usize>::new());
    assert_eq!(trim_plan(&[3, 1, 1]), Vec::<usize>::new());
    assert_eq!(trim_plan(&[]), Vec::<usize>::new());
}

#[test]
fn relinking_skips_removed_segments() {
    let ptrs = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000];
    // Remove 1 and 3: 0 -> 2 -> 4; 2's next was 3, now 4; 4 stays last.
    assert_eq!(relink(&ptrs, &[1, 3]), vec![(0, 0x3000), (2, 0x5000)]);
    // Remove the tail: the new last segment ends the chain.
    assert_eq!(relink(&ptrs, &[3, 4]), vec![(2, 0)]);
    // Everything but the first.
    assert_eq!(relink(&ptrs, &[1, 2, 3, 4]), vec![(0, 0)]);
    assert_eq!(relink(&ptrs, &[]), vec![]);
    // Walking the new links from the first segment visits the kept ones in order.
    let remove = [2, 3];
    let mut next: Vec<u64> = (0..ptrs.len())
        .map(|i| ptrs.get(i + 1).copied().unwrap_or(0))
        .collect();
    for (i, n) in relink(&ptrs, &remove) {
        next[i] = n;
    }
    let mut walk = vec![0usize];
    while next[*walk.last().unwrap()] != 0 {
        let p = next[*walk.last().unwrap()];
        walk.push(ptrs.iter().position(|&q| q == p).unwrap());
    }
    assert_eq!(walk, vec![0, 1, 4]);
}

#[test]
fn footprints_round_to_chunks() {
    let g = Growth {
        chunk: 2 * MIB,
        ..Growth::plain()
    };
    assert_eq!(g.footprint(1), 2 * MIB);
    assert_eq!(g.footprint(2 * MIB), 2 * MIB);
    assert_eq!(g.footprint(2 * MIB + 1), 4 * MIB);
    assert_eq!(Growth::plain().footprint(12345), 12345);
    let g = Growth::plain();
    assert_eq!(g.retired(), None);
    lock(&g.seen).retired = Some(stats(0, 0));
    lock(&g.seen).failed = 9;
    g.reset();
    assert_eq!((g.retired(), lock(&g.seen).failed), (None, 0));
}

mod models {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = HeapKind> {
        prop_oneof![
            (1u64..=256).prop_map(|k| HeapKind::Slab { block_size: 16 * k }),
            Just(HeapKind::Bump),
        ]
    }

    proptest! {
        /// A planned segment holds the need, fits the room once rounded to chunks, and fills
        /// them; a refusal means the need alone does not fit.
        #[test]
        fn planned_segments_hold_the_need_and_fit_the_room(
            kind in kind(),
            need in 1u64..1 << 24,
            extra in 0u64..1 << 24,
            chunk_log2 in 0u32..23,
            room in proptest::option::of(0usize..1 << 32),
        ) {
            let chunk = 1usize << chunk_log2;
            let want = need + extra;
            let rounded = |c: u64| raw_bytes(kind, 0, c).unwrap().next_multiple_of(chunk);
            match plan_segment(kind, 0, want, need, chunk, room) {
                Ok(c) => {
                    prop_assert!(c >= need);
                    prop_assert!(room.is_none_or(|r| rounded(c) <= r));
                    if chunk > 1 {
                        // Filling: one more unit would take another chunk or pass the room.
                        let more = rounded(c + 1);
                        prop_assert!(more > rounded(c) || room.is_some_and(|r| more > r));
                    }
                    if room.is_none_or(|r| rounded(want) <= r) {
                        prop_assert!(c >= want);
                    }
                }
                Err(Error::OutOfMemory { .. }) => {
                    prop_assert!(room.is_some_and(|r| rounded(need) > r));
                }
                Err(e) => prop_assert!(false, "{e}"),
            }
        }

        /// Relinking after removing any set of segments but the first leaves a chain that visits
        /// exactly the kept segments, in order.
        #[test]
        fn relinked_chains_visit_the_kept_segments(n in 1usize..40, bits in any::<u64>()) {
            let ptrs: Vec<u64> = (0..n as u64).map(|i| 0x1000 * (i + 1)).collect();
            let remove: Vec<usize> = (1..n).filter(|i| bits >> i & 1 == 1).collect();
            let mut next: Vec<u64> = (0..n).map(|i| ptrs.get(i + 1).copied().unwrap_or(0)).collect();
            for (i, nx) in relink(&ptrs, &remove) {
                prop_assert!(!remove.contains(&i), "a removed segment rewritten");
                next[i] = nx;
            }
            let mut walk = vec![0usize];
            while next[*walk.last().unwrap()] != 0 {
                let p = next[*walk.last().unwrap()];
                walk.push(ptrs.iter().position(|&q| q == p).unwrap());
                prop_assert!(walk.len() <= n);
            }
            let kept: Vec<usize> = (0..n).filter(|i| !remove.contains(i)).collect();
            prop_assert_eq!(walk, kept);
        }
    }
}
