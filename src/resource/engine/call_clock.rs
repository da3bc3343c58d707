//! [`CallClock`]: the wall time spent in calls that a counting wrapper passes on (driver calls,
//! stream ordering, an upstream), so a replay can say where its time went.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// A running total of the wall time of the calls made through [`CallClock::time`].
#[derive(Debug, Default)]
pub(crate) struct CallClock {
    nanos: AtomicU64,
}

impl CallClock {
    /// Runs `f`, adding its wall time to the total (whatever `f` returns).
    pub fn time<T>(&self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.nanos.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
        r
    }

    /// The total so far.
    pub fn total(&self) -> Duration {
        Duration::from_nanos(self.nanos.load(Relaxed))
    }
}
