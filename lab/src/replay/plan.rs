//! Checking a parsed log and turning it into a replay plan: each allocation gets a slot that its
//! free refers to, and logged thread and stream ids become dense indices.

use std::collections::HashMap;

use super::parse::LogEvent;
use carve::adaptor::LogAction;
use carve::error::{Error, Result};

/// What one step does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Allocate `bytes` on stream index `stream` into `slot`.
    Alloc {
        /// The live-block slot the pointer goes to.
        slot: usize,
        /// The size in bytes.
        bytes: usize,
        /// The replay stream index.
        stream: usize,
    },
    /// Free the block in `slot` (of `bytes`) on stream index `stream`.
    Free {
        /// The live-block slot the pointer comes from.
        slot: usize,
        /// The size in bytes.
        bytes: usize,
        /// The replay stream index.
        stream: usize,
    },
}

/// One step of the replay, in global log order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    /// The log line it came from.
    pub line: u64,
    /// Index into [`Plan::threads`].
    pub thread: usize,
    /// What to do.
    pub op: Op,
}

/// A checked log, ready to replay.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// The steps, in log order.
    pub steps: Vec<Step>,
    /// Logged thread ids, by index.
    pub threads: Vec<u64>,
    /// Logged stream ids, by index.
    pub streams: Vec<u64>,
    /// (bytes, stream index) of each slot's allocation.
    pub slots: Vec<(usize, usize)>,
    /// Peak of the live bytes the log itself describes.
    pub logged_peak: usize,
    /// `allocate failure` rows: requests that failed when the log was written (not replayed).
    pub logged_failures: usize,
    /// Zero-byte allocations and their frees (not replayed: they hold no memory).
    pub skipped_zero: usize,
    /// Allocations the log never frees.
    pub unfreed: usize,
}

fn malformed(line: u64, reason: String) -> Error {
    Error::MalformedLog { line, reason }
}

/// Checks `events` and builds the plan. A free of a pointer that is not live (never allocated,
/// or already freed), a free with another size than its allocation, and an allocation of a
/// pointer that is still live are [`Error::MalformedLog`] naming the line.
pub fn plan(events: &[LogEvent]) -> Result<Plan> {
    let mut p = Plan::default();
    let mut thread_ix: HashMap<u64, usize> = HashMap::new();
    let mut stream_ix: HashMap<u64, usize> = HashMap::new();
    // Live pointer -> (slot, line of its allocation).
    let mut live: HashMap<u64, (usize, u64)> = HashMap::new();
    // Pointers of zero-byte allocations still live.
    let mut zero_live: HashMap<u64, u64> = HashMap::new();
    let mut live_bytes = 0usize;

    for e in events {
        let index = |map: &mut HashMap<u64, usize>, ids: &mut Vec<u64>, id: u64| {
            *map.entry(id).or_insert_with(|| {
                ids.push(id);
                ids.len() - 1
            })
        };
        match e.action {
            LogAction::AllocateFailure => {
                p.logged_failures += 1;
                continue;
            }
            LogAction::Allocate if e.bytes == 0 => {
                p.skipped_zero += 1;
                zero_live.insert(e.ptr, e.line);
                continue;
            }
            LogAction::Free if e.bytes == 0 && zero_live.remove(&e.ptr).is_some() => {
                p.skipped_zero += 1;
                continue;
            }
            LogAction::Allocate => {
                if e.ptr == 0 {
                    return Err(malformed(
                        e.line,
                        "allocate returned a null pointer".to_owned(),
                    ));
                }
                if let Some(&(_, at)) = live.get(&e.ptr) {
                    return Err(malformed(
                        e.line,
                        format!(
                            "allocate returned {:#x}, which is still live since line {at}",
                            e.ptr
                        ),
                    ));
                }
                let thread = index(&mut thread_ix, &mut p.threads, e.thread);
                let stream = index(&mut stream_ix, &mut p.streams, e.stream);
                let slot = p.slots.len();
                p.slots.push((e.bytes, stream));
                live.insert(e.ptr, (slot, e.line));
                live_bytes += e.bytes;
                p.logged_peak = p.logged_peak.max(live_bytes);
                p.steps.push(Step {
                    line: e.line,
                    thread,
                    op: Op::Alloc {
                        slot,
                        bytes: e.bytes,
                        stream,
                    },
                });
            }
            LogAction::Free => {
                let Some((slot, at)) = live.remove(&e.ptr) else {
                    return Err(malformed(
                        e.line,
                        format!(
                            "free of unknown pointer {:#x}: no earlier allocate returned it, or it was already freed",
                            e.ptr
                        ),
                    ));
                };
                let allocated = p.slots[slot].0;
                if allocated != e.bytes {
                    return Err(malformed(
                        e.line,
                        format!(
                            "free of {:#x} as {} bytes, but line {at} allocated it as {allocated}",
                            e.ptr, e.bytes
                        ),
                    ));
                }
                let thread = index(&mut thread_ix, &mut p.threads, e.thread);
                let stream = index(&mut stream_ix, &mut p.streams, e.stream);
                live_bytes -= e.bytes;
                p.steps.push(Step {
                    line: e.line,
                    thread,
                    op: Op::Free {
                        slot,
                        bytes: e.bytes,
                        stream,
                    },
                });
            }
        }
    }
    p.unfreed = live.len();
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(
        line: u64,
        thread: u64,
        action: LogAction,
        ptr: u64,
        bytes: usize,
        stream: u64,
    ) -> LogEvent {
        LogEvent {
            line,
            thread,
            action,
            ptr,
            bytes,
            stream,
        }
    }
    use LogAction::{Allocate as A, AllocateFailure as X, Free as F};

    #[test]
    fn slots_threads_streams_and_peak() {
        let p = plan(&[
            ev(2, 10, A, 0x100, 100, 0),
            ev(3, 11, A, 0x200, 50, 0xabc),
            ev(4, 10, F, 0x100, 100, 0),
            ev(5, 11, X, 0, 1 << 40, 0),
            ev(6, 10, A, 0x100, 30, 0xabc),
        ])
        .unwrap();
        assert_eq!(p.threads, vec![10, 11]);
        assert_eq!(p.streams, vec![0, 0xabc]);
        assert_eq!(p.slots, vec![(100, 0), (50, 1), (30, 1)]);
        assert_eq!(p.logged_peak, 150);
        assert_eq!((p.logged_failures, p.unfreed), (1, 2));
        assert_eq!(
            p.steps[2].op,
            Op::Free {
                slot: 0,
                bytes: 100,
                stream: 0
            }
        );
        assert_eq!(
            p.steps[3],
            Step {
                line: 6,
                thread: 0,
                op: Op::Alloc {
                    slot: 2,
                    bytes: 30,
                    stream: 1
                }
            }
        );
    }

    #[test]
    fn bad_frees_and_reused_live_pointers_name_the_line() {
        let err = |events: &[LogEvent]| match plan(events).unwrap_err() {
            Error::MalformedLog { line, reason } => (line, reason),
            e => panic!("{e:?}"),
        };
        let (line, why) = err(&[ev(2, 1, A, 0x100, 8, 0), ev(3, 1, F, 0x999, 8, 0)]);
        assert_eq!(line, 3);
        assert!(why.contains("unknown pointer 0x999"), "{why}");
        let (line, _) = err(&[
            ev(2, 1, A, 0x100, 8, 0),
            ev(3, 1, F, 0x100, 8, 0),
            ev(4, 1, F, 0x100, 8, 0),
        ]);
        assert_eq!(line, 4);
        let (line, why) = err(&[ev(2, 1, A, 0x100, 8, 0), ev(3, 1, F, 0x100, 16, 0)]);
        assert_eq!(line, 3);
        assert!(why.contains("line 2 allocated it as 8"), "{why}");
        let (line, why) = err(&[ev(2, 1, A, 0x100, 8, 0), ev(3, 2, A, 0x100, 8, 0)]);
        assert_eq!(line, 3);
        assert!(why.contains("still live since line 2"), "{why}");
    }

    #[test]
    fn zero_byte_allocations_are_skipped() {
        let p = plan(&[ev(2, 1, A, 0, 0, 0), ev(3, 1, F, 0, 0, 0)]).unwrap();
        assert!(p.steps.is_empty());
        assert_eq!(p.skipped_zero, 2);
    }
}
