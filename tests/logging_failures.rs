//! The logging adaptor when its log cannot be written (a full disk): frees still go through,
//! and the log error is deferred.
//!
//! The deferred-error slot is process-wide: one test function in this binary.

use std::io::{self, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use carve::adaptor::LoggingResourceAdaptor;
use carve::{
    deferred_error_count, take_deferred_error, HostMemoryResource, MemoryResource, StreamRef,
};

/// A log that fails every write once `full` is set, as a full disk does.
struct Disk {
    full: Arc<AtomicBool>,
    written: Arc<std::sync::Mutex<Vec<u8>>>,
}

impl Write for Disk {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.full.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
        }
        self.written.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        if self.full.load(Ordering::Relaxed) {
            return Err(io::Error::new(io::ErrorKind::StorageFull, "disk full"));
        }
        Ok(())
    }
}

#[test]
fn a_full_log_defers_its_error_and_frees_go_through() {
    take_deferred_error();
    let host = HostMemoryResource::new();
    let full = Arc::new(AtomicBool::new(false));
    let written = Arc::default();
    let disk = Disk {
        full: full.clone(),
        written: Arc::clone(&written),
    };
    let log = LoggingResourceAdaptor::to_writer(host.clone(), disk, true).unwrap();
    let st = StreamRef::simulated(1);
    let blocks: Vec<_> = (0..3)
        .map(|_| log.allocate(st, 1000, 256).unwrap())
        .collect();
    assert_eq!(host.allocation_count(), 3);

    full.store(true, Ordering::Relaxed);
    let before = deferred_error_count();
    for p in blocks {
        // SAFETY: a live block of `log` with these arguments, freed once.
        unsafe { log.deallocate(st, p, 1000, 256) }.expect("a full log must not refuse a free");
    }
    assert_eq!(host.allocated_bytes(), 0, "every free reached the upstream");
    assert_eq!(
        deferred_error_count(),
        before + 3,
        "one deferred log error per free"
    );
    let e = take_deferred_error().expect("recorded");
    assert!(e.context.contains("LoggingResourceAdaptor"), "{e}");
    assert!(e.to_string().contains("disk full"), "{e}");

    // Allocations still refuse to go unlogged, and leave nothing behind.
    log.allocate(st, 1000, 256)
        .expect_err("an unlogged allocation");
    assert_eq!(host.allocated_bytes(), 0);

    // With room again, the log goes on: frees of later blocks are logged.
    full.store(false, Ordering::Relaxed);
    let p = log.allocate(st, 64, 256).unwrap();
    // SAFETY: as above.
    unsafe { log.deallocate(st, p, 64, 256) }.unwrap();
    let text = String::from_utf8(written.lock().unwrap().clone()).unwrap();
    let last = text.lines().last().unwrap();
    assert!(last.contains(",free,") && last.contains(",64,"), "{text}");
    drop(log);
    assert_eq!(host.allocated_bytes(), 0);
}
