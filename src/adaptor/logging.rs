//! The allocation log in RMM's exact CSV format, as RMM's `logging_resource_adaptor` writes it:
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 140573312,14:03:27.123456,allocate,0x7f8a40000000,1024,0
//! 140573312,14:03:27.123460,free,0x7f8a40000000,1024,0
//! 140573313,14:03:27.123470,allocate failure,(nil),1099511627776,0x55d5c7a0e2b0
//! ```
//!
//! Thread is the OS thread id (spdlog's `%t`), Time is local `%H:%M:%S.%f` (microseconds),
//! Pointer is printf's `%p` (`(nil)` for a failed allocation), Size is decimal bytes, and Stream is
//! the stream handle as C++ streams print a pointer (`0` for the default stream, else `0x…`).
//! RMM's replay benchmark and `carve replay` read it.

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::Result;
use crate::resource::{MemoryResource, Properties};
use crate::stream::StreamRef;
use crate::sync::lock;

/// The header line, as RMM writes it.
pub const LOG_HEADER: &str = "Thread,Time,Action,Pointer,Size,Stream";

/// The Action column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LogAction {
    /// A successful allocation.
    Allocate,
    /// A deallocation.
    Free,
    /// An allocation that failed.
    AllocateFailure,
}

impl LogAction {
    /// The word RMM writes.
    pub fn as_str(self) -> &'static str {
        match self {
            LogAction::Allocate => "allocate",
            LogAction::Free => "free",
            LogAction::AllocateFailure => "allocate failure",
        }
    }

    /// Parses the Action column. `deallocate` (the word RMM's documentation shows, though its
    /// code writes `free`) is read as a free.
    pub fn parse(s: &str) -> Option<LogAction> {
        match s {
            "allocate" => Some(LogAction::Allocate),
            "free" | "deallocate" => Some(LogAction::Free),
            "allocate failure" => Some(LogAction::AllocateFailure),
            _ => None,
        }
    }
}

impl fmt::Display for LogAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Writes one CSV line per allocate, free and failed allocate to a file or any writer.
///
/// An allocation is logged after it returns (as RMM does) and a free after it is done, with the
/// log held from the free to its line, so in the log an address is always freed before another
/// thread can be handed it again. A failed free is not logged.
///
/// If the log cannot be written (a full disk), an allocation fails with [`crate::Error::Io`] and
/// its fresh block goes back to the upstream; a free still goes through, and the log error is
/// deferred ([`crate::take_deferred_error`]).
pub struct LoggingResourceAdaptor<R> {
    inner: Arc<Inner<R>>,
}

struct Inner<R> {
    upstream: R,
    auto_flush: bool,
    out: Mutex<Box<dyn Write + Send>>,
}

impl<R> Clone for LoggingResourceAdaptor<R> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<R: fmt::Debug> fmt::Debug for LoggingResourceAdaptor<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoggingResourceAdaptor")
            .field("upstream", &self.inner.upstream)
            .field("auto_flush", &self.inner.auto_flush)
            .finish_non_exhaustive()
    }
}

impl<R: MemoryResource> LoggingResourceAdaptor<R> {
    /// Logs to a new file at `path` (truncated if it exists), buffered.
    pub fn to_file(upstream: R, path: impl AsRef<Path>, auto_flush: bool) -> Result<Self> {
        let file = File::create(path)?;
        Self::to_writer(upstream, BufWriter::new(file), auto_flush)
    }

    /// Logs to `writer`; with `auto_flush`, flushes after every line.
    pub fn to_writer(
        upstream: R,
        writer: impl Write + Send + 'static,
        auto_flush: bool,
    ) -> Result<Self> {
        let mut out: Box<dyn Write + Send> = Box::new(writer);
        writeln!(out, "{LOG_HEADER}")?;
        if auto_flush {
            out.flush()?;
        }
        Ok(Self {
            inner: Arc::new(Inner {
                upstream,
                auto_flush,
                out: Mutex::new(out),
            }),
        })
    }

    /// The wrapped resource.
    pub fn upstream(&self) -> &R {
        &self.inner.upstream
    }

    /// Writes out buffered lines.
    pub fn flush(&self) -> Result<()> {
        lock(&self.inner.out).flush()?;
        Ok(())
    }

    fn log(
        &self,
        action: LogAction,
        ptr: Option<NonNull<u8>>,
        bytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let mut out = lock(&self.inner.out);
        self.write_line(&mut **out, action, ptr, bytes, stream)
    }

    fn write_line(
        &self,
        out: &mut dyn Write,
        action: LogAction,
        ptr: Option<NonNull<u8>>,
        bytes: usize,
        stream: StreamRef<'_>,
    ) -> Result<()> {
        let line = format_line(thread_id(), &clock(), action, ptr, bytes, stream);
        out.write_all(line.as_bytes())?;
        if self.inner.auto_flush {
            out.flush()?;
        }
        Ok(())
    }
}

impl<R> Drop for Inner<R> {
    fn drop(&mut self) {
        // No caller is left to report to: record it for `take_deferred_error`.
        crate::deferred::record(
            "LoggingResourceAdaptor drop: flushing the log",
            lock(&self.out).flush().map_err(crate::error::Error::from),
        );
    }
}

/// One log line, newline included.
fn format_line(
    thread: u64,
    time: &str,
    action: LogAction,
    ptr: Option<NonNull<u8>>,
    bytes: usize,
    stream: StreamRef<'_>,
) -> String {
    let ptr = match ptr {
        Some(p) => format!("{:#x}", p.as_ptr() as usize),
        None => "(nil)".to_owned(),
    };
    // The handle, as RMM logs it (and replays read it back).
    let stream = match stream.raw_value() {
        0 => "0".to_owned(),
        id => format!("{id:#x}"),
    };
    format!("{thread},{time},{action},{ptr},{bytes},{stream}\n")
}

/// The calling thread's OS id, as spdlog's `%t`.
fn thread_id() -> u64 {
    thread_local! {
        static TID: u64 = os_thread_id();
    }
    TID.with(|t| *t)
}

#[cfg(target_os = "linux")]
fn os_thread_id() -> u64 {
    // SAFETY: gettid has no preconditions and cannot fail.
    (unsafe { libc::gettid() }) as u64
}

#[cfg(not(target_os = "linux"))]
fn os_thread_id() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Local wall-clock time as `HH:MM:SS.uuuuuu`.
fn clock() -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = now.as_secs();
    let (h, m, s) = local_hms(secs);
    format!("{h:02}:{m:02}:{s:02}.{:06}", now.subsec_micros())
}

#[cfg(unix)]
fn local_hms(secs: u64) -> (i32, i32, i32) {
    let t = secs as libc::time_t;
    // SAFETY: an all-zero `tm` is a valid value of this plain C struct.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r is the re-entrant form.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return utc_hms(secs);
    }
    (tm.tm_hour, tm.tm_min, tm.tm_sec)
}

#[cfg(not(unix))]
fn local_hms(secs: u64) -> (i32, i32, i32) {
    utc_hms(secs)
}

fn utc_hms(secs: u64) -> (i32, i32, i32) {
    let day = secs % 86_400;
    (
        (day / 3600) as i32,
        (day % 3600 / 60) as i32,
        (day % 60) as i32,
    )
}

// SAFETY: blocks come unchanged from the upstream, which upholds the contract.
unsafe impl<R: MemoryResource> MemoryResource for LoggingResourceAdaptor<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        match self.inner.upstream.allocate(stream, bytes, align) {
            Ok(ptr) => {
                if let Err(e) = self.log(LogAction::Allocate, Some(ptr), bytes, stream) {
                    // SAFETY: just allocated with these arguments and never handed out.
                    let undo = unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) };
                    crate::deferred::record("LoggingResourceAdaptor: undoing an allocation", undo);
                    return Err(e);
                }
                Ok(ptr)
            }
            Err(e) => {
                // The allocation error is the one to report; a log failure on top is deferred.
                crate::deferred::record(
                    "LoggingResourceAdaptor: logging a failed allocation",
                    self.log(LogAction::AllocateFailure, None, bytes, stream),
                );
                Err(e)
            }
        }
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        align: usize,
    ) -> Result<()> {
        // The log is held from the free to its line: another thread handed the address by the
        // upstream in between logs its allocation after this free.
        let mut out = lock(&self.inner.out);
        // SAFETY: forwarded caller contract.
        unsafe { self.inner.upstream.deallocate(stream, ptr, bytes, align) }?;
        // The memory is freed: a log that cannot take the line must not fail the free.
        crate::deferred::record(
            "LoggingResourceAdaptor: logging a free",
            self.write_line(&mut **out, LogAction::Free, Some(ptr), bytes, stream),
        );
        Ok(())
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_match_rmm_formats() {
        let p = NonNull::new(0x7f8a_4000_0000usize as *mut u8);
        assert_eq!(
            format_line(
                42,
                "01:02:03.000004",
                LogAction::Allocate,
                p,
                1024,
                StreamRef::DEFAULT
            ),
            "42,01:02:03.000004,allocate,0x7f8a40000000,1024,0\n"
        );
        assert_eq!(
            format_line(
                7,
                "t",
                LogAction::AllocateFailure,
                None,
                9,
                StreamRef::simulated(1)
            ),
            format!(
                "7,t,allocate failure,(nil),9,{:#x}\n",
                StreamRef::simulated(1).raw_value()
            )
        );
    }

    #[test]
    fn clock_has_rmm_shape() {
        let c = clock();
        let b = c.as_bytes();
        assert_eq!(c.len(), 15, "{c}");
        assert_eq!((b[2], b[5], b[8]), (b':', b':', b'.'), "{c}");
        assert!(
            c.chars().filter(|ch| ch.is_ascii_digit()).count() == 12,
            "{c}"
        );
        assert_eq!(utc_hms(3600 * 25 + 61), (1, 1, 1));
    }

    #[test]
    fn actions_round_trip() {
        for a in [
            LogAction::Allocate,
            LogAction::Free,
            LogAction::AllocateFailure,
        ] {
            assert_eq!(LogAction::parse(a.as_str()), Some(a));
        }
        assert_eq!(LogAction::parse("deallocate"), Some(LogAction::Free));
        assert_eq!(LogAction::parse("alloc"), None);
    }
}
