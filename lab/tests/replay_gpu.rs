//! `carve replay` on a GPU: real streams, the cuda and driver-pool resources, and a device OOM.
//! Each test skips (saying why) without a GPU, and fails instead under CARVE_REQUIRE_GPU=1.

use std::fmt::Write as _;

use carve::require_gpu;
use carve_lab::replay::{build_target, parse_log, plan, replay, ResourceKind, ResourceOptions};

/// Two threads, three streams, interleaved, sizes 1 KiB..8 MiB; every block freed.
fn log_text() -> String {
    let mut text = String::from("Thread,Time,Action,Pointer,Size,Stream\n");
    let streams = ["0", "0x7f0010", "0x7f0020"];
    let mut live: Vec<(u64, u64, usize, &str)> = Vec::new();
    let mut next_ptr = 0x1_0000_0000u64;
    for i in 0..2000u64 {
        let thread = 100 + (i * 13 % 2);
        if i % 5 < 3 || live.is_empty() {
            let bytes = 1024 + (i as usize * 7919) % (8 << 20);
            let s = streams[(i % 3) as usize];
            let _ = writeln!(
                text,
                "{thread},00:00:00.000000,allocate,{next_ptr:#x},{bytes},{s}"
            );
            live.push((thread, next_ptr, bytes, s));
            next_ptr += 16 << 20;
        } else {
            let (_, p, bytes, s) = live.remove((i as usize * 31) % live.len());
            let _ = writeln!(text, "{thread},00:00:00.000000,free,{p:#x},{bytes},{s}");
        }
    }
    for (thread, p, bytes, s) in live {
        let _ = writeln!(text, "{thread},00:00:00.000000,free,{p:#x},{bytes},{s}");
    }
    text
}

#[test]
fn replays_on_cuda_and_the_driver_pool_with_real_streams() {
    let _dev = require_gpu!();
    let plan = plan(&parse_log(log_text().as_bytes()).unwrap()).unwrap();
    assert_eq!((plan.threads.len(), plan.streams.len()), (2, 3));
    for kind in [ResourceKind::Cuda, ResourceKind::Async] {
        let target = build_target(&ResourceOptions::new(kind), &plan.streams).unwrap();
        let report = replay(&plan, &target, false).unwrap();
        eprintln!("{report}");
        assert!(report.succeeded(), "{report}");
        assert_eq!(report.peak_bytes, plan.logged_peak);
        assert_eq!(report.streams, 3);
    }
}

/// Every resource on the device, the virtual-memory ones included, reports a peak reserved of
/// at least the logical peak. On this uniformly random log (sizes 1 KiB..8 MiB, three streams)
/// the expandable pool reserves 1.28× over simulated memory, with the same placement as on a
/// device, and the pool 2.29×: the bounds below leave a little room.
#[test]
fn every_resource_reports_its_peak_reserved_on_the_device() {
    let _dev = require_gpu!();
    let plan = plan(&parse_log(log_text().as_bytes()).unwrap()).unwrap();
    let mut pool_reserved = 0;
    for kind in [
        ResourceKind::Cuda,
        ResourceKind::Async,
        ResourceKind::Pool,
        ResourceKind::Arena,
        ResourceKind::Binning,
        ResourceKind::Virtual,
        ResourceKind::Expandable,
    ] {
        let target = build_target(&ResourceOptions::new(kind), &plan.streams).unwrap();
        let report = replay(&plan, &target, false).unwrap();
        eprintln!("{report}");
        assert!(report.succeeded(), "{kind}: {report}");
        let reserved = report.peak_reserved.expect("every resource can tell");
        assert!(reserved >= report.peak_bytes, "{kind}: {report}");
        if kind == ResourceKind::Pool {
            pool_reserved = reserved;
        }
        if kind == ResourceKind::Expandable {
            assert!(
                reserved as f64 <= 1.35 * report.peak_bytes as f64,
                "{report}"
            );
            assert!(reserved < pool_reserved, "{report}");
        }
    }
}

#[test]
fn a_device_oom_is_reported_not_fatal() {
    let dev = require_gpu!();
    let total = dev.mem_info().unwrap().total;
    let huge = total * 2;
    let text = format!(
        "Thread,Time,Action,Pointer,Size,Stream\n\
         1,t,allocate,0x1000,1048576,0\n\
         1,t,allocate,0x2000,{huge},0\n\
         1,t,free,0x1000,1048576,0\n"
    );
    let plan = plan(&parse_log(text.as_bytes()).unwrap()).unwrap();
    let target = build_target(&ResourceOptions::new(ResourceKind::Cuda), &plan.streams).unwrap();
    let report = replay(&plan, &target, false).unwrap();
    eprintln!("{report}");
    assert_eq!(report.failed_allocations, 1);
    let ff = report.first_failure.unwrap();
    assert_eq!((ff.line, ff.bytes, ff.in_use), (3, huge, 1 << 20));
    assert_eq!(report.failed_frees, 0);
}
