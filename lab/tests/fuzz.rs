//! Fuzzing with proptest: arbitrary and mutated inputs for every parser and decoder, and
//! arbitrary operation sequences, misuse included, on every suballocator. Nothing may panic;
//! bad input is a typed error; suballocator invariants hold after every step.
//!
//! CI runs the default case counts (a few seconds each). Long runs: `PROPTEST_CASES=100000
//! cargo test --release -p carve-lab --test fuzz` (see RELIABILITY.md). A failure prints its
//! minimal input; proptest stores it in `lab/tests/fuzz.proptest-regressions`, which is
//! committed, so it is re-run first from then on. Fixed crashes also get a named test at the end of this file.

#[path = "../../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::ptr::NonNull;

use carve::heap::ForeignHeapPlan;
use carve::resource::{ArenaOptions, FixedSizeOptions, PoolOptions};
use carve::snapshot::{Action, Block, BlockState, Segment, Snapshot, TraceEntry};
use carve::{
    ArenaMemoryResource, BinningMemoryResource, Error, FixedSizeMemoryResource, HostMemoryResource,
    MemoryResource, PoolMemoryResource, StreamRef,
};
use carve_lab::replay::torch::{parse_events, LogFormat};
use carve_lab::replay::{build_target, parse_log, plan, replay, ResourceKind, ResourceOptions};
use carve_lab::snapshot::ReadSnapshot;
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn config(default: u32) -> ProptestConfig {
    ProptestConfig {
        cases: common::cases(default),
        // Inputs are cheap; shrinking long byte strings is not.
        max_shrink_iters: 2000,
        // Next to this file: lab/tests/fuzz.proptest-regressions.
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// The replay's CSV parser and planner.

/// CSV-ish text: real rows with mutated fields, so the parser sees near-valid input too.
fn csv_text() -> impl Strategy<Value = String> {
    let field = prop_oneof![
        Just("allocate".to_owned()),
        Just("free".to_owned()),
        Just("allocate failure".to_owned()),
        Just("(nil)".to_owned()),
        Just("0x0".to_owned()),
        (0u64..8).prop_map(|v| format!("0x{:x}", 0x1000 * v)),
        (0u64..5000).prop_map(|v| v.to_string()),
        "[0-9a-fx,\"\\-]{0,12}",
        any::<u64>().prop_map(|v| v.to_string()),
    ];
    let row = prop::collection::vec(field, 0..8).prop_map(|f| f.join(","));
    let header = prop_oneof![
        4 => Just("Thread,Time,Action,Pointer,Size,Stream".to_owned()),
        1 => "[A-Za-z,]{0,40}",
    ];
    (header, prop::collection::vec(row, 0..40))
        .prop_map(|(h, rows)| format!("{h}\n{}\n", rows.join("\n")))
}

/// Replays a plan over a small simulated pool; checks the report adds up.
fn replay_small(events: &[carve_lab::replay::LogEvent]) {
    let Ok(p) = plan(events) else { return };
    let mut opts = ResourceOptions::new(ResourceKind::Pool);
    opts.simulate_capacity = Some(1 << 20);
    let target = build_target(&opts, &p.streams).unwrap();
    let r = replay(&p, &target, false).unwrap();
    assert_eq!(r.allocations + r.frees, p.steps.len());
    assert!(r.failed_allocations <= r.allocations);
    assert_eq!(r.failed_frees, 0, "{r}");
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn csv_parser_never_panics_on_bytes(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        match parse_log(&bytes[..]) {
            Ok(events) => replay_small(&events),
            Err(Error::MalformedLog { .. }) => {}
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    #[test]
    fn csv_parser_and_planner_on_near_valid_logs(text in csv_text()) {
        match parse_log(text.as_bytes()) {
            Ok(events) => replay_small(&events),
            Err(Error::MalformedLog { .. }) => {}
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The snapshot parser (pickles), and snapshot -> replay events.

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        Just(Action::Alloc),
        Just(Action::FreeRequested),
        Just(Action::FreeCompleted),
        Just(Action::SegmentAlloc),
        Just(Action::SegmentFree),
        Just(Action::Oom),
        "[a-z_]{0,8}".prop_map(Action::Other),
    ]
}

fn snapshot() -> impl Strategy<Value = Snapshot> {
    let entry = (action(), 0u64..16, 0u64..5000, 0u64..3).prop_map(|(action, a, size, stream)| {
        TraceEntry {
            // Written as 0 when unknown (PyTorch's viewer reads it on every oom).
            device_free: (action == Action::Oom).then_some(0),
            action,
            addr: 0x1000 * a,
            size,
            stream,
            time_us: 0,
            frames: Vec::new(),
        }
    });
    let block = (0u64..3000, any::<bool>()).prop_map(|(size, used)| (size, used));
    let segment = (0u64..16, prop::collection::vec(block, 0..4)).prop_map(|(a, blocks)| {
        let address = 0x10_0000 * a;
        let mut at = address;
        let blocks: Vec<Block> = blocks
            .into_iter()
            .map(|(size, used)| {
                let b = Block {
                    address: at,
                    size,
                    requested_size: if used { size } else { 0 },
                    state: if used {
                        BlockState::ActiveAllocated
                    } else {
                        BlockState::Inactive
                    },
                    frames: Vec::new(),
                };
                at += size;
                b
            })
            .collect();
        Segment {
            device: 0,
            address,
            total_size: at - address,
            stream: 0,
            blocks,
        }
    });
    (
        prop::collection::vec(segment, 0..4),
        prop::collection::vec(prop::collection::vec(entry, 0..40), 0..3),
    )
        .prop_map(|(segments, device_traces)| Snapshot {
            segments,
            device_traces,
        })
}

/// The opcodes the snapshot reader handles (and a few it refuses).
const OPCODES: [u8; 34] = [
    b'(', b'0', b'1', b'2', b'N', 0x88, 0x89, b'J', b'K', b'M', 0x8a, b'G', 0x8c, b'X', b'C', b']',
    b'}', b')', b'l', b'd', b't', 0x85, 0x86, 0x87, b'a', b'e', b's', b'u', b'q', b'h', 0x94, b'R',
    b'b', b'P',
];

/// Mutations of a byte string: flip, insert, delete, truncate.
fn mutate(mut bytes: Vec<u8>, edits: &[(usize, u8, u8)]) -> Vec<u8> {
    for &(at, kind, value) in edits {
        if bytes.is_empty() {
            break;
        }
        let i = at % bytes.len();
        match kind % 4 {
            0 => bytes[i] ^= value | 1,
            1 => bytes.insert(i, value),
            2 => {
                bytes.remove(i);
            }
            _ => bytes.truncate(i),
        }
    }
    bytes
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn snapshot_parser_never_panics_on_bytes(mut bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        bytes.insert(0, 0x80); // past the pickle magic, so the parser proper runs
        let _ = Snapshot::from_pickle(&bytes);
        if let Ok(events) = parse_events(&bytes, LogFormat::Torch) {
            replay_small(&events);
        }
    }

    #[test]
    fn snapshot_parser_never_panics_on_opcode_soup(
        ops in prop::collection::vec((prop::sample::select(OPCODES.to_vec()), any::<[u8; 4]>()), 0..300),
    ) {
        // Opcodes the reader knows, each with a few argument bytes: gets deeper into the
        // unpickler than random bytes do.
        let mut bytes = vec![0x80, 4];
        for (op, arg) in &ops {
            bytes.push(*op);
            let n = match *op {
                b'K' | b'q' | b'h' | 0x8c | b'C' | 0x8a => 1,
                b'M' => 2,
                b'J' | b'r' | b'j' | b'X' | b'B' | 0x8b => 4,
                _ => 0,
            };
            // Small lengths, so strings and bytes often fit in what follows.
            bytes.extend(arg[..n].iter().map(|b| b & 0x07));
        }
        bytes.push(b'.');
        if let Ok(s) = Snapshot::from_pickle(&bytes) {
            let _ = s.check();
        }
        if let Ok(events) = parse_events(&bytes, LogFormat::Torch) {
            replay_small(&events);
        }
    }

    #[test]
    fn snapshots_round_trip_and_replay(snap in snapshot()) {
        let bytes = snap.to_pickle().unwrap();
        prop_assert_eq!(Snapshot::from_pickle(&bytes).unwrap(), snap);
        match parse_events(&bytes, LogFormat::Auto) {
            Ok(events) => replay_small(&events),
            Err(Error::MalformedLog { .. }) => {}
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    #[test]
    fn mutated_snapshots_are_errors_or_snapshots(
        snap in snapshot(),
        edits in prop::collection::vec((any::<usize>(), any::<u8>(), any::<u8>()), 1..6),
    ) {
        let bytes = mutate(snap.to_pickle().unwrap(), &edits);
        if let Ok(s) = Snapshot::from_pickle(&bytes) {
            let _ = s.check();
            if let Ok(events) = carve_lab::replay::torch::events_from_snapshot(&s) {
                replay_small(&events);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// heap-layout decoding: plans for any capacity and block size, handles for any base, statistics
// from any prefix bytes.

proptest! {
    #![proptest_config(config(512))]

    #[test]
    fn heap_plans_handles_and_stats_decode_anything(
        slab in any::<bool>(),
        capacity in prop_oneof![0u64..5000, any::<u64>()],
        block_size in prop_oneof![0u64..5000, any::<u64>()],
        base in prop_oneof![any::<u64>(), (1u64..1 << 20).prop_map(|b| b << 12)],
        fill in any::<u8>(),
        noise in prop::collection::vec(any::<u8>(), 0..64),
    ) {
        let plan = if slab {
            ForeignHeapPlan::slab(capacity, block_size)
        } else {
            ForeignHeapPlan::bump(capacity)
        };
        let Ok(plan) = plan else { return Ok(()) };
        prop_assert!(plan.align().is_power_of_two());
        if let Ok(h) = plan.handle_at(base) {
            prop_assert_eq!(base % plan.align(), 0);
            prop_assert_eq!(h.capacity, capacity);
        }
        // A prefix that is garbage (any fill, any noise) decodes to numbers, never a panic.
        let n = plan.stats_bytes();
        if n <= 1 << 24 {
            let mut prefix = vec![fill; n];
            for (i, b) in noise.iter().enumerate() {
                if n > 0 {
                    let at = (i * 7919) % n;
                    prefix[at] = *b;
                }
            }
            let s = plan.stats(&prefix).unwrap();
            prop_assert_eq!(s.capacity, capacity);
            prop_assert!(plan.stats(&prefix[..n.saturating_sub(1)]).is_err() || n == 0);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Operation sequences on every suballocator, misuse included: bad sizes and alignments, frees of
// foreign pointers, double frees and frees with the wrong size must be typed errors that change
// nothing; invariants hold after every step; everything returns upstream at the end.

#[derive(Clone, Debug)]
enum Step {
    Alloc {
        bytes: usize,
        align_log: u32,
        stream: usize,
    },
    Free {
        pick: usize,
        stream: usize,
    },
    DoubleFree {
        pick: usize,
    },
    WrongSize {
        pick: usize,
        delta: isize,
    },
    Foreign {
        offset: usize,
    },
    BadRequest {
        kind: u8,
    },
}

fn steps(max_bytes: usize) -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        6 => (1..=max_bytes, 0u32..13, 0..3usize)
            .prop_map(|(bytes, align_log, stream)| Step::Alloc { bytes, align_log, stream }),
        4 => (any::<usize>(), 0..3usize).prop_map(|(pick, stream)| Step::Free { pick, stream }),
        1 => any::<usize>().prop_map(|pick| Step::DoubleFree { pick }),
        1 => (any::<usize>(), prop_oneof![Just(1isize), Just(-1), Just(256), Just(-256), Just(4096)])
            .prop_map(|(pick, delta)| Step::WrongSize { pick, delta }),
        1 => (0usize..4096).prop_map(|offset| Step::Foreign { offset }),
        1 => any::<u8>().prop_map(|kind| Step::BadRequest { kind }),
    ];
    prop::collection::vec(step, 1..150)
}

fn s(i: usize) -> StreamRef<'static> {
    common::stream(i)
}

/// Runs `steps` on `mr`. `strict_frees`: the resource detects every bad free (else the misuse
/// steps that would corrupt an unchecking resource are skipped).
fn run_steps(
    mr: &dyn MemoryResource,
    steps: &[Step],
    strict_frees: bool,
    max_request: usize,
    invariants: &dyn Fn() -> Result<(), String>,
) {
    let mut live: BTreeMap<usize, (usize, usize)> = BTreeMap::new();
    let mut freed: Vec<(usize, usize, usize)> = Vec::new();
    let pick = |live: &BTreeMap<usize, (usize, usize)>, i: usize| {
        live.iter()
            .nth(i % live.len().max(1))
            .map(|(&a, &v)| (a, v))
    };
    for step in steps {
        match *step {
            Step::Alloc {
                bytes,
                align_log,
                stream,
            } => {
                let align = 1usize << align_log;
                match mr.allocate(s(stream), bytes, align) {
                    Ok(p) => {
                        let a = p.as_ptr() as usize;
                        assert_eq!(a % align, 0);
                        if let Some((&b, &(n, _))) = live.range(..=a).next_back() {
                            assert!(b + n <= a, "{a:#x} overlaps live {b:#x}+{n}");
                        }
                        if let Some((&b, _)) = live.range(a..).next() {
                            assert!(a + bytes <= b, "{a:#x}+{bytes} overlaps live {b:#x}");
                        }
                        live.insert(a, (bytes, align));
                        freed.retain(|f| f.0 != a);
                    }
                    Err(e) => assert!(
                        bytes > max_request
                            || e.is_out_of_memory()
                            || matches!(e, Error::InvalidArgument(_) | Error::Unsupported(_)),
                        "{bytes} B align {align}: {e}"
                    ),
                }
            }
            Step::Free { pick: i, stream } => {
                if let Some((a, (bytes, align))) = pick(&live, i) {
                    live.remove(&a);
                    let p = NonNull::new(a as *mut u8).unwrap();
                    // SAFETY: a live block of `mr` with these arguments, freed once.
                    unsafe { mr.deallocate(s(stream), p, bytes, align) }.unwrap();
                    freed.push((a, bytes, align));
                }
            }
            Step::DoubleFree { pick: i } if strict_frees => {
                if let Some(&(a, bytes, align)) = freed.get(i % freed.len().max(1)) {
                    if !live.contains_key(&a) {
                        let p = NonNull::new(a as *mut u8).unwrap();
                        // SAFETY: the resource checks frees (strict_frees); this one must be
                        // refused without touching anything.
                        let r = unsafe { mr.deallocate(s(0), p, bytes, align) };
                        assert!(r.is_err(), "double free of {a:#x} accepted");
                    }
                }
            }
            Step::WrongSize { pick: i, delta } if strict_frees => {
                if let Some((a, (bytes, align))) = pick(&live, i) {
                    let wrong = bytes.checked_add_signed(delta).filter(|&w| w > 0);
                    if let Some(wrong) = wrong {
                        let p = NonNull::new(a as *mut u8).unwrap();
                        // SAFETY: as above: a checked free with the wrong size is refused (or,
                        // where sizes round to the same block, accepted as the same block).
                        match unsafe { mr.deallocate(s(0), p, wrong, align) } {
                            Err(_) => {}
                            Ok(()) => {
                                live.remove(&a);
                                freed.push((a, bytes, align));
                            }
                        }
                    }
                }
            }
            Step::Foreign { offset } if strict_frees => {
                // An address inside no live block's start: a foreign pointer.
                let base = live.keys().next().copied().unwrap_or(0x10_0000);
                let a = base + 1 + offset;
                if !live.contains_key(&a) {
                    let p = NonNull::new(a as *mut u8).unwrap();
                    // SAFETY: as above: a pointer this resource never handed out is refused.
                    let r = unsafe { mr.deallocate(s(0), p, 256, 256) };
                    assert!(r.is_err(), "foreign free of {a:#x} accepted");
                }
            }
            Step::BadRequest { kind } => {
                let r = match kind % 4 {
                    0 => mr.allocate(s(0), 0, 256),
                    1 => mr.allocate(s(0), 64, 3 + 2 * (kind as usize % 50)),
                    2 => mr.allocate(s(0), usize::MAX - (kind as usize), 256),
                    _ => mr.allocate(s(0), 64, 0),
                };
                assert!(r.is_err(), "bad request {kind} accepted");
            }
            _ => {}
        }
        invariants().unwrap();
    }
    for (a, (bytes, align)) in live {
        let p = NonNull::new(a as *mut u8).unwrap();
        // SAFETY: live blocks of `mr`, each freed once.
        unsafe { mr.deallocate(s(0), p, bytes, align) }.unwrap();
    }
    invariants().unwrap();
}

proptest! {
    #![proptest_config(config(64))]

    #[test]
    fn pool_under_arbitrary_steps(steps in steps(60_000), initial in 0usize..100_000) {
        let host = HostMemoryResource::new();
        let pool = PoolMemoryResource::new(host.clone(), PoolOptions::new(initial)).unwrap();
        run_steps(&pool, &steps, true, usize::MAX, &|| pool.check_invariants());
        prop_assert_eq!(pool.stats().bytes_in_use, 0);
        drop(pool);
        prop_assert_eq!(host.allocated_bytes(), 0);
    }

    #[test]
    fn fixed_size_under_arbitrary_steps(steps in steps(5000), per_refill in 1u32..6) {
        let host = HostMemoryResource::new();
        let mr = FixedSizeMemoryResource::new(
            host.clone(),
            FixedSizeOptions::new(4096).blocks_per_refill(per_refill),
        ).unwrap();
        run_steps(&mr, &steps, true, 4096, &|| mr.check_invariants());
        prop_assert_eq!(mr.stats().blocks_in_use, 0);
        drop(mr);
        prop_assert_eq!(host.allocated_bytes(), 0);
    }

    #[test]
    fn binning_under_arbitrary_steps(steps in steps(60_000)) {
        let host = HostMemoryResource::new();
        let mr = BinningMemoryResource::new(host.clone(), 8, 14).unwrap();
        run_steps(&mr, &steps, true, usize::MAX, &|| Ok(()));
        drop(mr);
        prop_assert_eq!(host.allocated_bytes(), 0);
    }

    #[test]
    fn arena_under_arbitrary_steps(steps in steps(300_000)) {
        let host = HostMemoryResource::new();
        let mr = ArenaMemoryResource::new(
            host.clone(),
            ArenaOptions { superblock_size: 1 << 20, arenas: 2, ..Default::default() },
        ).unwrap();
        run_steps(&mr, &steps, true, usize::MAX, &|| mr.check_invariants());
        prop_assert_eq!(mr.stats().bytes_in_use, 0);
        drop(mr);
        prop_assert_eq!(host.allocated_bytes(), 0);
    }
}

// ---------------------------------------------------------------------------------------------
// Regression tests: inputs that once crashed or misread the snapshot reader (serde-pickle based).

/// A million nested lists: the old reader overflowed the stack (converting, then dropping).
#[test]
fn deeply_nested_pickles_do_not_overflow_the_stack() {
    let n = 1_000_000;
    let mut deep = b"\x80\x02".to_vec();
    deep.extend(std::iter::repeat_n(b']', n));
    deep.extend(std::iter::repeat_n(b'a', n - 1));
    deep.push(b'.');
    assert!(Snapshot::from_pickle(&deep).is_err());
    assert!(parse_events(&deep, LogFormat::Auto).is_err());
}

/// One frames list shared by two events (as PyTorch's snapshots share frames): the old reader
/// refused it as "recursive".
#[test]
fn shared_objects_read() {
    // pickle.dumps(d, protocol=2) by Python 3, d = {'segments': [], 'device_traces': [[alloc,
    // free_completed]]}, both events holding the same frames list object.
    let bytes: &[u8] = b"\x80\x02}q\x00(X\x08\x00\x00\x00segmentsq\x01]q\x02X\x0d\x00\x00\x00device_tracesq\x03]q\x04]q\x05(}q\x06(X\x06\x00\x00\x00actionq\x07X\x05\x00\x00\x00allocq\x08X\x04\x00\x00\x00addrq\x09M\x00\x10X\x04\x00\x00\x00sizeq\x0aM\x00\x02X\x06\x00\x00\x00framesq\x0b]q\x0c}q\x0d(X\x08\x00\x00\x00filenameq\x0eX\x04\x00\x00\x00a.pyq\x0fX\x04\x00\x00\x00lineq\x10K\x01X\x04\x00\x00\x00nameq\x11X\x01\x00\x00\x00xq\x12uau}q\x13(h\x07X\x0e\x00\x00\x00free_completedq\x14h\x09M\x00\x10h\x0aM\x00\x02h\x0bh\x0cueau.";
    let s = Snapshot::from_pickle(bytes).unwrap();
    let t = &s.device_traces[0];
    assert_eq!(t.len(), 2);
    assert_eq!(t[0].frames, t[1].frames);
    assert_eq!(t[1].frames[0].filename, "a.py");
    assert_eq!(parse_events(bytes, LogFormat::Auto).unwrap().len(), 2);
}

/// A 60 KB pickle naming one 1000-event list 20,000 times: refused from list lengths, before
/// 20 million events are built.
#[test]
fn a_list_shared_many_times_is_refused_before_conversion() {
    let mut p = b"\x80\x02}(X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces](".to_vec();
    // The event list: [] memoized as 0, then 1000 events appended.
    p.extend_from_slice(b"]q\x00(");
    for i in 1..=1000u32 {
        p.extend_from_slice(
            b"}(X\x06\x00\x00\x00actionX\x05\x00\x00\x00allocX\x04\x00\x00\x00addrJ",
        );
        p.extend_from_slice(&(i * 4096).to_le_bytes());
        p.extend_from_slice(b"X\x04\x00\x00\x00sizeM\x00\x02u");
    }
    p.extend_from_slice(b"e");
    for _ in 0..20_000 {
        p.extend_from_slice(b"h\x00");
    }
    p.extend_from_slice(b"eu.");
    let e = Snapshot::from_pickle(&p).unwrap_err();
    assert!(e.to_string().contains("events and blocks"), "{e}");
}
