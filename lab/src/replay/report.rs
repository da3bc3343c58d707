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
    /// Wall time of the replayed steps (setup and final cleanup excluded), first pass.
    pub elapsed: Duration,
    /// Wall time of each further pass over the same resource (`carve replay --passes`). These
    /// find what the first pass reserved still there, as later iterations of a training loop
    /// do: the resource's steady state, where the first pass also pays for its growth.
    pub later_passes: Vec<Duration>,
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

    /// Nanoseconds per replayed operation over `elapsed`.
    pub fn per_op(&self, elapsed: Duration) -> f64 {
        elapsed.as_nanos() as f64 / (self.allocations + self.frees).max(1) as f64
    }

    /// The median of [`ReplayReport::later_passes`], per operation; `None` after one pass.
    pub fn later_per_op(&self) -> Option<f64> {
        let mut ns: Vec<f64> = self.later_passes.iter().map(|&d| self.per_op(d)).collect();
        ns.sort_by(f64::total_cmp);
        ns.get(ns.len() / 2).copied()
    }

    /// Folds in `later`, a further pass of the same log over the same resource: its time, its
    /// failures (the first failure stays the earliest pass's), and its peak usage.
    pub fn absorb(&mut self, later: ReplayReport) {
        self.later_passes.push(later.elapsed);
        self.later_passes.extend(later.later_passes);
        self.peak_bytes = self.peak_bytes.max(later.peak_bytes);
        self.failed_allocations += later.failed_allocations;
        self.failed_frees += later.failed_frees;
        if self.first_failure.is_none() {
            self.first_failure = later.first_failure;
        }
        if self.first_failed_free.is_none() {
            self.first_failed_free = later.first_failed_free;
        }
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
            self.per_op(self.elapsed)
        } else {
            0.0
        };
        writeln!(
            f,
            "  time         {:.3} ms ({per_op:.0} ns per operation)",
            self.elapsed.as_secs_f64() * 1e3
        )?;
        if let Some(median) = self.later_per_op() {
            let (lo, hi) = self
                .later_passes
                .iter()
                .map(|&d| self.per_op(d))
                .fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
            writeln!(
                f,
                "  later passes {} more on the same resource: {median:.0} ns per operation \
                 (median; {lo:.0}–{hi:.0})",
                self.later_passes.len()
            )?;
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(ms: u64, failed: usize, line: Option<u64>) -> ReplayReport {
        ReplayReport {
            resource: "pool".into(),
            allocations: 5,
            frees: 5,
            threads: 1,
            streams: 1,
            peak_bytes: 100 * ms as usize,
            logged_peak_bytes: 100,
            peak_reserved: None,
            resource_notes: None,
            elapsed: Duration::from_millis(ms),
            later_passes: vec![],
            failed_allocations: failed,
            first_failure: line.map(|line| FirstFailure {
                line,
                bytes: 8,
                in_use: 0,
                fragmentation: None,
                largest_free: None,
                error: "out of memory".into(),
            }),
            failed_frees: 0,
            first_failed_free: None,
            logged_failures: 0,
            unfreed: 0,
        }
    }

    #[test]
    fn later_passes_add_failures_and_keep_the_first() {
        let mut r = report(4, 0, None);
        assert_eq!(r.later_per_op(), None);
        r.absorb(report(2, 1, Some(7)));
        r.absorb(report(1, 2, Some(3)));
        r.absorb(report(3, 0, None));
        assert_eq!(r.later_passes.len(), 3);
        assert_eq!(r.failed_allocations, 3);
        assert_eq!(r.first_failure.as_ref().map(|f| f.line), Some(7));
        assert_eq!(r.peak_bytes, 400);
        // 2 ms over 10 operations: the median of 1, 2 and 3 ms.
        assert_eq!(r.later_per_op(), Some(200_000.0));
        assert_eq!(r.per_op(r.elapsed), 400_000.0);
        let text = r.to_string();
        assert!(
            text.contains("later passes 3 more on the same resource: 200000 ns per operation (median; 100000–300000)"),
            "{text}"
        );
    }
}
