//! Each adaptor's behaviour over host memory (no GPU needed).

#[path = "../../tests/common/mod.rs"]
mod common;

use std::io::{self, Write};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use carve::adaptor::{
    AlignedResourceAdaptor, Counter, FailureCallbackResourceAdaptor, LimitingResourceAdaptor,
    LoggingResourceAdaptor, StatisticsResourceAdaptor, TrackingResourceAdaptor, LOG_HEADER,
};
use carve::{
    Error, HostMemoryResource, MemoryResource, Properties, SharedResource, SimulatedMemoryResource,
    StreamRef,
};
use carve_lab::replay::parse_log;
use common::{ScriptedUpstream, SharedBuf};

const S: StreamRef<'static> = StreamRef::DEFAULT;

// ---------------------------------------------------------------- limiting

#[test]
fn limiting_refuses_past_the_limit_and_names_it() {
    let host = HostMemoryResource::new();
    let mr = LimitingResourceAdaptor::new(host.clone(), 1024);
    let a = mr.allocate(S, 500, 8).unwrap();
    let b = mr.allocate(S, 512, 8).unwrap();
    assert_eq!(mr.allocated_bytes(), 1024);
    let err = mr.allocate(S, 1, 8).unwrap_err();
    assert!(err.is_out_of_memory());
    let msg = err.to_string();
    assert!(
        msg.contains("limit is 1024 bytes and 1024 are in use"),
        "{msg}"
    );
    assert_eq!(
        host.allocation_count(),
        2,
        "a refused request never reaches the upstream"
    );
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, a, 500, 8) }.unwrap();
    let c = mr.allocate(S, 256, 8).unwrap();
    // SAFETY: from `mr`, freed once.
    unsafe {
        mr.deallocate(S, b, 512, 8).unwrap();
        mr.deallocate(S, c, 256, 8).unwrap();
    }
    assert_eq!((mr.allocated_bytes(), host.allocated_bytes()), (0, 0));
}

#[test]
fn limiting_returns_the_reservation_when_the_upstream_fails_or_refuses_a_free() {
    let mr = LimitingResourceAdaptor::new(HostMemoryResource::new(), usize::MAX);
    assert!(mr
        .allocate(S, isize::MAX as usize - 8192, 8)
        .unwrap_err()
        .is_out_of_memory());
    assert_eq!(mr.allocated_bytes(), 0);
    let p = mr.allocate(S, 64, 8).unwrap();
    // SAFETY: wrong size on purpose: the host upstream refuses it, and the count must stay.
    assert!(unsafe { mr.deallocate(S, p, 32, 8) }.is_err());
    assert_eq!(mr.allocated_bytes(), 256);
    // SAFETY: the correct free.
    unsafe { mr.deallocate(S, p, 64, 8) }.unwrap();
    assert_eq!(mr.allocated_bytes(), 0);
    assert!(matches!(
        LimitingResourceAdaptor::with_granularity(HostMemoryResource::new(), 10, 3),
        Err(Error::InvalidAlignment(3))
    ));
    assert!(matches!(mr.allocate(S, 0, 8), Err(Error::ZeroSize)));
}

#[test]
fn limiting_holds_under_thread_contention() {
    let host = HostMemoryResource::new();
    let limit = 64 * 256;
    let mr = LimitingResourceAdaptor::new(host.clone(), limit);
    let refused = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..4 {
            let (mr, host, refused) = (mr.clone(), host.clone(), &refused);
            s.spawn(move || {
                let mut held = Vec::new();
                for i in 0..2000 {
                    if (i + t) % 3 == 2 {
                        if let Some(p) = held.pop() {
                            // SAFETY: from `mr`, freed once.
                            unsafe { mr.deallocate(S, p, 200, 8) }.unwrap();
                        }
                    } else {
                        match mr.allocate(S, 200, 8) {
                            Ok(p) => held.push(p),
                            Err(e) => {
                                assert!(e.is_out_of_memory());
                                refused.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    assert!(host.allocation_count() * 256 <= limit);
                }
                for p in held {
                    // SAFETY: from `mr`, freed once.
                    unsafe { mr.deallocate(S, p, 200, 8) }.unwrap();
                }
            });
        }
    });
    assert!(
        refused.load(Ordering::Relaxed) > 0,
        "the workload must hit the limit"
    );
    assert_eq!((mr.allocated_bytes(), host.allocation_count()), (0, 0));
}

// ---------------------------------------------------------------- statistics

#[test]
fn statistics_add_up_across_threads() {
    let mr = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    let threads = 4;
    let per = 1000;
    let kept_blocks: Vec<(usize, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let mr = mr.clone();
                s.spawn(move || {
                    let mut held = Vec::new();
                    let mut kept = Vec::new();
                    for i in 0..per {
                        let bytes = 1 + (i * 37 + t * 11) % 4000;
                        held.push((mr.allocate(S, bytes, 8).unwrap(), bytes));
                    }
                    // Free every other block.
                    for (k, (p, bytes)) in held.into_iter().enumerate() {
                        if k % 2 == 0 {
                            // SAFETY: from `mr`, freed once.
                            unsafe { mr.deallocate(S, p, bytes, 8) }.unwrap();
                        } else {
                            kept.push((p.as_ptr().expose_provenance(), bytes));
                        }
                    }
                    kept
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let size = |t: usize, i: usize| (1 + (i * 37 + t * 11) % 4000) as i64;
    let total: i64 = (0..threads)
        .flat_map(|t| (0..per).map(move |i| size(t, i)))
        .sum();
    let kept: i64 = (0..threads)
        .flat_map(|t| (0..per).filter(|i| i % 2 == 1).map(move |i| size(t, i)))
        .sum();
    let bytes = mr.bytes_counter();
    assert_eq!((bytes.total, bytes.value), (total, kept));
    assert!(bytes.peak >= kept && bytes.peak <= total);
    let count = mr.allocations_counter();
    assert_eq!((count.total, count.value), (4000, 2000));
    assert_eq!(mr.upstream().allocated_bytes() as i64, kept);
    for (addr, bytes) in kept_blocks {
        let p = NonNull::new(std::ptr::with_exposed_provenance_mut(addr)).unwrap();
        // SAFETY: each kept block came from `mr` with this size and is freed once.
        unsafe { mr.deallocate(S, p, bytes, 8) }.unwrap();
    }
    assert_eq!(mr.bytes_counter().value, 0);
    assert_eq!(mr.bytes_counter().total, total);
}

#[test]
fn statistics_scopes_nest_as_in_rmm() {
    let mr = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    let a = mr.allocate(S, 1000, 8).unwrap();
    let below = mr.push_counters();
    assert_eq!(below.0.value, 1000);
    assert_eq!(mr.bytes_counter(), Counter::default());
    let b = mr.allocate(S, 500, 8).unwrap();
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, b, 500, 8) }.unwrap();
    let c = mr.allocate(S, 200, 8).unwrap();
    // Freeing a block from the outer scope takes the inner value below zero.
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, a, 1000, 8) }.unwrap();
    let (bytes, allocs) = mr.pop_counters().unwrap();
    assert_eq!(
        bytes,
        Counter {
            value: -800,
            peak: 500,
            total: 700
        }
    );
    assert_eq!((allocs.value, allocs.total), (0, 2));
    assert_eq!(
        mr.bytes_counter(),
        Counter {
            value: 200,
            peak: 1500,
            total: 1700
        }
    );
    assert!(matches!(mr.pop_counters(), Err(Error::InvalidArgument(_))));
    assert_eq!(mr.depth(), 0);
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, c, 200, 8) }.unwrap();
}

#[test]
fn statistics_do_not_count_failures() {
    let mr = StatisticsResourceAdaptor::new(HostMemoryResource::new());
    assert!(mr.allocate(S, 0, 8).is_err());
    let p = mr.allocate(S, 64, 8).unwrap();
    // SAFETY: wrong size on purpose; refused by the host upstream.
    assert!(unsafe { mr.deallocate(S, p, 63, 8) }.is_err());
    assert_eq!(mr.bytes_counter().value, 64);
    // SAFETY: the correct free.
    unsafe { mr.deallocate(S, p, 64, 8) }.unwrap();
    assert_eq!(mr.allocations_counter().total, 1);
}

// ---------------------------------------------------------------- tracking

#[test]
fn tracking_catches_double_frees_and_foreign_pointers_without_the_upstream() {
    let up = ScriptedUpstream::new();
    let mr = TrackingResourceAdaptor::new(up.clone(), false);
    let p = mr.allocate(S, 64, 8).unwrap();
    let q = mr.allocate(S, 128, 8).unwrap();
    assert_eq!((mr.allocation_count(), mr.allocated_bytes()), (2, 192));

    // SAFETY: one correct free, then bad frees that must be refused before the upstream.
    unsafe {
        mr.deallocate(S, p, 64, 8).unwrap();
        assert_eq!(up.frees(), 1);
        assert!(matches!(
            mr.deallocate(S, p, 64, 8),
            Err(Error::DoubleFree { ptr, .. }) if ptr == p.as_ptr() as usize
        ));
        let mut local = 0u8;
        assert!(matches!(
            mr.deallocate(S, NonNull::from(&mut local), 8, 8),
            Err(Error::UnknownPointer { .. })
        ));
        assert!(matches!(
            mr.deallocate(S, q, 64, 8),
            Err(Error::SizeMismatch {
                allocated: 128,
                freed: 64,
                ..
            })
        ));
    }
    assert_eq!(up.frees(), 1, "bad frees reached the upstream");
    assert_eq!(
        mr.allocation_count(),
        1,
        "the mis-sized free must not drop the block"
    );
    let report = mr.leak_report();
    assert!(
        report.starts_with("1 outstanding allocation(s), 128 bytes"),
        "{report}"
    );
    assert!(
        report.contains(&format!("{:#x}: 128 bytes", q.as_ptr() as usize)),
        "{report}"
    );
    // SAFETY: the correct free.
    unsafe { mr.deallocate(S, q, 128, 8) }.unwrap();
    assert_eq!(mr.leak_report(), "");
    assert_eq!(up.host.allocation_count(), 0);
}

#[test]
fn tracking_lets_exactly_one_of_racing_frees_through() {
    let up = ScriptedUpstream::new();
    let mr = TrackingResourceAdaptor::new(up.clone(), false);
    for round in 0..50 {
        let p = mr.allocate(S, 256, 8).unwrap();
        let addr = p.as_ptr().expose_provenance();
        let wins = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..4 {
                let (mr, wins) = (&mr, &wins);
                s.spawn(move || {
                    let p =
                        NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(addr)).unwrap();
                    // SAFETY: all four threads free the same block; the adaptor must pass only
                    // one free to the upstream and refuse the others.
                    match unsafe { mr.deallocate(S, p, 256, 8) } {
                        Ok(()) => {
                            wins.fetch_add(1, Ordering::SeqCst);
                        }
                        Err(e) => assert!(matches!(e, Error::DoubleFree { .. }), "{e}"),
                    }
                });
            }
        });
        assert_eq!(wins.load(Ordering::SeqCst), 1, "round {round}");
    }
    assert_eq!(up.frees(), 50);
    assert_eq!(up.host.allocation_count(), 0);
}

#[test]
fn tracking_captures_backtraces_on_request() {
    let mr = TrackingResourceAdaptor::new(HostMemoryResource::new(), true);
    let p = mr.allocate(S, 32, 8).unwrap();
    let leaks = mr.outstanding();
    assert_eq!(leaks.len(), 1);
    assert_eq!((leaks[0].bytes, leaks[0].stream), (32, S.id()));
    assert!(leaks[0].backtrace.is_some());
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, p, 32, 8) }.unwrap();
}

// ---------------------------------------------------------------- logging

#[test]
fn logging_writes_rmm_csv_that_parses_back() {
    let buf = SharedBuf::default();
    let limited = LimitingResourceAdaptor::new(HostMemoryResource::new(), 4096);
    let mr = LoggingResourceAdaptor::to_writer(limited, buf.clone(), true).unwrap();
    let stream = StreamRef::simulated(3);
    let p = mr.allocate(S, 1000, 8).unwrap();
    let q = mr.allocate(stream, 2000, 8).unwrap();
    assert!(mr.allocate(S, 1 << 20, 8).is_err());
    // SAFETY: from `mr`, each freed once.
    unsafe {
        mr.deallocate(S, p, 1000, 8).unwrap();
        mr.deallocate(stream, q, 2000, 8).unwrap();
    }
    let text = buf.text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], LOG_HEADER);
    assert_eq!(lines.len(), 6, "{text}");
    let fields: Vec<Vec<&str>> = lines[1..].iter().map(|l| l.split(',').collect()).collect();
    assert!(fields.iter().all(|f| f.len() == 6), "{text}");
    let tid = fields[0][0];
    assert!(tid.parse::<u64>().is_ok() && fields.iter().all(|f| f[0] == tid));
    assert_eq!(
        fields[0][2..],
        [
            "allocate",
            &format!("{:#x}", p.as_ptr() as usize),
            "1000",
            "0"
        ]
    );
    assert_eq!(
        fields[1][2..],
        [
            "allocate",
            &format!("{:#x}", q.as_ptr() as usize),
            "2000",
            &format!("{:#x}", stream.id().get())
        ]
    );
    assert_eq!(
        fields[2][2..],
        ["allocate failure", "(nil)", "1048576", "0"]
    );
    assert_eq!(fields[3][2], "free");
    let events = parse_log(text.as_bytes()).unwrap();
    assert_eq!(events.len(), 5);
    assert_eq!(events[1].stream, stream.id().get() as u64);
    assert_eq!(events[4].ptr, q.as_ptr() as u64);
}

#[test]
fn logging_to_a_file_flushes_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("log.csv");
    let mr = LoggingResourceAdaptor::to_file(HostMemoryResource::new(), &path, false).unwrap();
    let p = mr.allocate(S, 10, 8).unwrap();
    mr.flush().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.lines().count(), 2, "{text}");
    assert!(text.lines().nth(1).unwrap().contains(",allocate,"));
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, p, 10, 8) }.unwrap();
    drop(mr);
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
    assert!(matches!(
        LoggingResourceAdaptor::to_file(
            HostMemoryResource::new(),
            dir.path().join("no/such/dir"),
            false
        ),
        Err(Error::Io(_))
    ));
}

/// Fails every write after the first `ok` bytes.
struct Broken {
    ok: usize,
}

impl Write for Broken {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.ok >= buf.len() {
            self.ok -= buf.len();
            Ok(buf.len())
        } else {
            Err(io::Error::other("disk full"))
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[test]
fn logging_failures_leave_memory_as_it_was() {
    let host = HostMemoryResource::new();
    let mr = LoggingResourceAdaptor::to_writer(
        host.clone(),
        Broken {
            ok: LOG_HEADER.len() + 1,
        },
        true,
    )
    .unwrap();
    assert!(matches!(mr.allocate(S, 64, 8), Err(Error::Io(_))));
    assert_eq!(
        host.allocation_count(),
        0,
        "the block must go back when the log fails"
    );
    assert!(LoggingResourceAdaptor::to_writer(host.clone(), Broken { ok: 0 }, true).is_err());
}

// ---------------------------------------------------------------- failure callback

#[test]
fn failure_callback_that_frees_memory_turns_oom_into_success() {
    let limited = LimitingResourceAdaptor::new(HostMemoryResource::new(), 1024);
    // Exposed addresses: raw pointers are not Send.
    let cache: Arc<Mutex<Vec<usize>>> = Arc::default();
    for _ in 0..4 {
        let p = limited.allocate(S, 256, 8).unwrap();
        cache.lock().unwrap().push(p.as_ptr().expose_provenance());
    }
    let calls = Arc::new(AtomicUsize::new(0));
    let mr = {
        let (limited, cache, calls) = (limited.clone(), cache.clone(), calls.clone());
        FailureCallbackResourceAdaptor::new(limited.clone(), move |bytes| {
            calls.fetch_add(1, Ordering::SeqCst);
            assert_eq!(bytes, 600);
            match cache.lock().unwrap().pop() {
                Some(addr) => {
                    let p = NonNull::new(std::ptr::with_exposed_provenance_mut(addr)).unwrap();
                    // SAFETY: cached blocks came from `limited` as 256 bytes; each is freed once.
                    unsafe { limited.deallocate(S, p, 256, 8) }.is_ok()
                }
                None => false,
            }
        })
    };
    let p = mr.allocate(S, 600, 8).unwrap();
    assert_eq!(
        calls.load(Ordering::SeqCst),
        3,
        "three 256-byte blocks free 768 >= 768"
    );
    assert_eq!(cache.lock().unwrap().len(), 1);
    // Nothing left to free: the callback says so and the OOM comes through.
    let err = mr.allocate(S, 600, 8).unwrap_err();
    assert!(err.is_out_of_memory());
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    // Other errors never reach the callback.
    assert!(matches!(mr.allocate(S, 0, 8), Err(Error::ZeroSize)));
    assert_eq!(calls.load(Ordering::SeqCst), 5);
    // SAFETY: from `mr`, freed once.
    unsafe { mr.deallocate(S, p, 600, 8) }.unwrap();
}

// ---------------------------------------------------------------- aligned

#[test]
fn aligned_over_aligns_large_requests_by_padding() {
    // Simulated memory gives exactly the alignment asked for, so the padding is observable.
    let sim = SimulatedMemoryResource::new(1 << 24).unwrap();
    let mr = AlignedResourceAdaptor::new(sim.clone(), 1 << 16, 4096).unwrap();
    let _skew = sim.allocate(S, 256, 256).unwrap();
    let big = mr.allocate(S, 5000, 8).unwrap();
    assert_eq!(big.as_ptr() as usize % (1 << 16), 0);
    let padded = (5000usize + (1 << 16) - 256).next_multiple_of(256);
    assert_eq!(sim.usage().used, 256 + padded);
    let small = mr.allocate(S, 1000, 8).unwrap();
    assert_eq!(
        sim.usage().used,
        256 + padded + 1024,
        "small requests are not padded"
    );
    // SAFETY: from `mr`, each freed once.
    unsafe {
        mr.deallocate(S, big, 5000, 8).unwrap();
        mr.deallocate(S, small, 1000, 8).unwrap();
    }
    assert_eq!(sim.usage().used, 256);
    assert!(matches!(
        AlignedResourceAdaptor::new(sim, 3000, 0),
        Err(Error::InvalidAlignment(3000))
    ));
}

#[test]
fn aligned_memory_is_usable_and_returned() {
    let host = HostMemoryResource::new();
    let mr = AlignedResourceAdaptor::new(host.clone(), 4096, 0).unwrap();
    let blocks: Vec<_> = (1..20)
        .map(|i| (mr.allocate(S, i * 100, 8).unwrap(), i * 100))
        .collect();
    for (p, n) in &blocks {
        assert_eq!(p.as_ptr() as usize % 4096, 0);
        // SAFETY: `n` host bytes from the rounded pointer lie inside the padded block.
        unsafe { p.as_ptr().write_bytes(0x5A, *n) };
    }
    for (p, n) in blocks {
        // SAFETY: from `mr`, freed once.
        unsafe { mr.deallocate(S, p, n, 8) }.unwrap();
    }
    assert_eq!(host.allocation_count(), 0);
    let mut local = 0u8;
    // SAFETY: a foreign pointer on purpose; the host upstream refuses it.
    assert!(unsafe { mr.deallocate(S, NonNull::from(&mut local), 1, 8) }.is_err());
}

/// Regression (found by the conformance suite): a padded block freed with the wrong size was
/// freed anyway, since the adaptor looked only at the address.
#[test]
fn aligned_refuses_a_padded_block_freed_with_the_wrong_size() {
    let sim = SimulatedMemoryResource::new(1 << 24).unwrap();
    let mr = AlignedResourceAdaptor::new(sim.clone(), 1 << 16, 4096).unwrap();
    let big = mr.allocate(S, 5000, 8).unwrap();
    let used = sim.usage().used;
    for wrong in [4999, 5001, 100] {
        // SAFETY: the wrong size on purpose; refused before anything is freed.
        let r = unsafe { mr.deallocate(S, big, wrong, 8) };
        assert!(
            matches!(r, Err(Error::SizeMismatch { allocated: 5000, freed, .. }) if freed == wrong),
            "{r:?}"
        );
    }
    assert_eq!(sim.usage().used, used, "a refused free changed nothing");
    // SAFETY: the block's one correct free.
    unsafe { mr.deallocate(S, big, 5000, 8) }.unwrap();
    assert_eq!(sim.usage().used, 0);
}

// ---------------------------------------------------------------- stacking

#[test]
fn adaptors_stack_and_clones_share_state() {
    let host = HostMemoryResource::new();
    let stats = StatisticsResourceAdaptor::new(host.clone());
    let tracked = TrackingResourceAdaptor::new(stats.clone(), false);
    let limited = LimitingResourceAdaptor::new(tracked.clone(), 1 << 20);
    let aligned = AlignedResourceAdaptor::new(limited, 4096, 1024).unwrap();
    let logged = LoggingResourceAdaptor::to_writer(aligned, io::sink(), false).unwrap();
    let top: SharedResource = Arc::new(logged);
    let p = top.allocate(S, 2048, 8).unwrap();
    assert_eq!(p.as_ptr() as usize % 4096, 0);
    assert_eq!(tracked.allocation_count(), 1);
    assert_eq!(stats.bytes_counter().value, (2048 + 4096 - 256) as i64);
    // SAFETY: from `top`, freed once; then a double free the tracking layer must catch.
    unsafe {
        top.deallocate(S, p, 2048, 8).unwrap();
        assert!(top.deallocate(S, p, 2048, 8).is_err());
    }
    assert_eq!(
        (tracked.allocation_count(), host.allocation_count()),
        (0, 0)
    );
    assert_eq!(top.properties(), Properties::HOST);
}
