//! What a replay found.

use std::fmt;
use std::time::Duration;

/// The first allocation that failed during a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct FirstFailure {
    /// Line of the log.
    pub line: u64,
    /// Bytes requested.
    pub bytes: usize,
    /// Bytes the replay held at that moment.
    pub in_use: usize,
    /// Fragmentation of the resource at that moment (`1 - largest free / free`), when known.
    pub fragmentation: Option<f64>,
    /// The largest request the resource could have served at that moment (its largest free
    /// hole), when known.
    pub largest_free: Option<usize>,
    /// The resource's error.
    pub error: String,
}

/// The outcome of a replay.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayReport {
    /// Which resource ran it.
    pub resource: String,
    /// Allocations replayed.
    pub allocations: usize,
    /// Frees replayed.
    pub frees: usize,
    /// Logged threads (one replay thread each).
    pub threads: usize,
    /// Logged streams (one replay stream each).
    pub streams: usize,
    /// Highest bytes held at once during the replay.
    pub peak_bytes: usize,
    /// Highest bytes held at once according to the log.
    pub logged_peak_bytes: usize,
    /// The most bytes the resource took from its upstream (the device) at once, when it can
    /// tell: what a user must have free to run this log with this resource.
    pub peak_reserved: Option<usize>,
    /// What the resource says about its own work (chunks mapped and moved), when it can.
    pub resource_notes: Option<String>,
    /// Wall time of the replayed steps (setup and final cleanup excluded).
    pub elapsed: Duration,
    /// Allocations the resource refused.
    pub failed_allocations: usize,
    /// The first refused allocation.
    pub first_failure: Option<FirstFailure>,
    /// Frees the resource refused (a resource bug, or a log that lies): (line, error) of the first.
    pub failed_frees: usize,
    /// The first free the resource refused: log line and error.
    pub first_failed_free: Option<(u64, String)>,
    /// `allocate failure` rows in the log (not replayed).
    pub logged_failures: usize,
    /// Blocks the log never frees (freed by the replay at the end).
    pub unfreed: usize,
}

impl ReplayReport {
    /// True when every allocation and free succeeded.
    pub fn succeeded(&self) -> bool {
        self.failed_allocations == 0 && self.failed_frees == 0
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

impl fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ops = self.allocations + self.frees;
        writeln!(f, "replay on {}", self.resource)?;
        writeln!(
            f,
            "  {} allocations, {} frees, {} thread(s), {} stream(s)",
            self.allocations, self.frees, self.threads, self.streams
        )?;
        writeln!(
            f,
            "  peak usage   {} bytes ({:.1} MiB); the log's own peak {} bytes ({:.1} MiB)",
            self.peak_bytes,
            mib(self.peak_bytes),
            self.logged_peak_bytes,
            mib(self.logged_peak_bytes)
        )?;
        if let Some(reserved) = self.peak_reserved {
            let ratio = if self.peak_bytes > 0 {
                format!("{:.2}×", reserved as f64 / self.peak_bytes as f64)
            } else {
                "n/a".to_owned()
            };
            writeln!(
                f,
                "  peak reserved {} bytes ({:.1} MiB), {ratio} the logical peak",
                reserved,
                mib(reserved)
            )?;
        }
        if let Some(notes) = &self.resource_notes {
            writeln!(f, "  resource     {notes}")?;
        }
        let per_op = if ops > 0 {
            self.elapsed.as_nanos() as f64 / ops as f64
        } else {
            0.0
        };
        writeln!(
            f,
            "  time         {:.3} ms ({per_op:.0} ns per operation)",
            self.elapsed.as_secs_f64() * 1e3
        )?;
        if self.logged_failures > 0 || self.unfreed > 0 {
            writeln!(
                f,
                "  log notes    {} logged allocation failure(s) not replayed, {} block(s) never freed",
                self.logged_failures, self.unfreed
            )?;
        }
        writeln!(f, "  failed allocations {}", self.failed_allocations)?;
        if let Some(ff) = &self.first_failure {
            let frag = ff
                .fragmentation
                .map_or("unknown".to_owned(), |x| format!("{:.1} %", x * 100.0));
            let hole = ff.largest_free.map_or("unknown".to_owned(), |h| {
                format!("{h} bytes ({:.1} MiB)", mib(h))
            });
            writeln!(
                f,
                "  first failure: line {}, {} bytes, with {} bytes ({:.1} MiB) in use, fragmentation {frag}, largest free hole {hole}: {}",
                ff.line,
                ff.bytes,
                ff.in_use,
                mib(ff.in_use),
                ff.error
            )?;
        }
        if let Some((line, e)) = &self.first_failed_free {
            writeln!(
                f,
                "  failed frees {}; first at line {line}: {e}",
                self.failed_frees
            )?;
        }
        Ok(())
    }
}
