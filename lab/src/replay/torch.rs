//! Reading allocation events from a PyTorch memory snapshot (`torch.cuda.memory._snapshot()`
//! pickled, e.g. by `torch.cuda.memory._dump_snapshot`), so a PyTorch run can be replayed on
//! carve's resources: "would it fit with carve's pool, and how much would that reserve?".
//!
//! The trace of the device with the most events is used. `alloc` becomes an allocation and
//! `free_completed` its free (PyTorch holds a block until then). Blocks live before the trace
//! starts (freed in it without an `alloc`, or still allocated in the final segments) are
//! allocated first, as the viewer does; a trace that reuses a live address (a ring buffer that
//! lost the free) gets the missing free. One thread replays it: PyTorch does not record threads.

use std::collections::HashMap;
use std::io::Read;
use std::path::Path;

use super::parse::{parse_log, LogEvent};
use carve::adaptor::LogAction;
use carve::error::{Error, Result};
use carve::snapshot::{Action, BlockState, Snapshot};

use crate::snapshot::ReadSnapshot;

/// The log formats `carve replay` reads.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Decide from the first byte: a pickle (PyTorch snapshot) starts with 0x80.
    #[default]
    Auto,
    /// RMM's CSV allocation log.
    Csv,
    /// A pickled PyTorch memory snapshot.
    Torch,
}

/// The pickle protocol opcode every protocol-2+ pickle starts with.
const PICKLE_PROTO: u8 = 0x80;

/// Reads the events of the log at `path`, in `format`.
pub fn read_events(path: &Path, format: LogFormat) -> Result<Vec<LogEvent>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.read_to_end(&mut bytes)?;
    parse_events(&bytes, format)
}

/// Parses `bytes` as `format`.
pub fn parse_events(bytes: &[u8], format: LogFormat) -> Result<Vec<LogEvent>> {
    let torch = match format {
        LogFormat::Auto => bytes.first() == Some(&PICKLE_PROTO),
        LogFormat::Csv => false,
        LogFormat::Torch => true,
    };
    if torch {
        events_from_snapshot(&Snapshot::from_pickle(bytes)?)
    } else {
        parse_log(bytes)
    }
}

/// The allocation events of `snap`'s busiest device, as a log (line = 1-based event index; 0 for
/// blocks that predate the trace).
pub fn events_from_snapshot(snap: &Snapshot) -> Result<Vec<LogEvent>> {
    let Some((device, trace)) = snap
        .device_traces
        .iter()
        .enumerate()
        .max_by_key(|(_, t)| t.len())
        .filter(|(_, t)| !t.is_empty())
    else {
        return Err(Error::MalformedLog {
            line: 0,
            reason: "the snapshot has no trace events (record with \
                     torch.cuda.memory._record_memory_history() before taking it)"
                .into(),
        });
    };
    let event = |line, action, ptr, bytes: u64, stream| {
        Ok::<_, Error>(LogEvent {
            line,
            thread: 0,
            action,
            ptr,
            bytes: usize::try_from(bytes).map_err(|_| Error::MalformedLog {
                line,
                reason: format!("size {bytes} does not fit this machine"),
            })?,
            stream,
        })
    };

    // Blocks live when the trace starts: freed without an alloc in the trace, or allocated at the
    // end without one.
    let mut allocated_in_trace: HashMap<u64, bool> = HashMap::new();
    let mut before = Vec::new();
    for e in trace {
        match e.action {
            Action::Alloc => {
                allocated_in_trace.insert(e.addr, true);
            }
            Action::FreeCompleted if !allocated_in_trace.contains_key(&e.addr) => {
                allocated_in_trace.insert(e.addr, false);
                before.push(event(0, LogAction::Allocate, e.addr, e.size, e.stream)?);
            }
            _ => {}
        }
    }
    for seg in snap.segments.iter().filter(|s| s.device == device as u64) {
        for b in &seg.blocks {
            if b.state != BlockState::Inactive && !allocated_in_trace.contains_key(&b.address) {
                before.push(event(
                    0,
                    LogAction::Allocate,
                    b.address,
                    b.size,
                    seg.stream,
                )?);
            }
        }
    }

    let mut live: HashMap<u64, (u64, u64)> = before
        .iter()
        .map(|e| (e.ptr, (e.bytes as u64, e.stream)))
        .collect();
    let mut out = before;
    for (i, e) in trace.iter().enumerate() {
        let line = i as u64 + 1;
        match e.action {
            Action::Alloc if e.size > 0 && e.addr != 0 => {
                if let Some((size, stream)) = live.remove(&e.addr) {
                    out.push(event(line, LogAction::Free, e.addr, size, stream)?);
                }
                live.insert(e.addr, (e.size, e.stream));
                out.push(event(line, LogAction::Allocate, e.addr, e.size, e.stream)?);
            }
            Action::FreeCompleted => {
                // The free carries the block's size from its allocation (they agree in PyTorch's
                // traces; the plan checks sizes, so use the one that was allocated).
                if let Some((size, _)) = live.remove(&e.addr) {
                    out.push(event(line, LogAction::Free, e.addr, size, e.stream)?);
                }
            }
            Action::Oom => out.push(event(
                line,
                LogAction::AllocateFailure,
                0,
                e.size,
                e.stream,
            )?),
            _ => {}
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use carve::snapshot::{Block, Segment, TraceEntry};

    fn ev(action: Action, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action,
            addr,
            size,
            stream: 0,
            time_us: 0,
            frames: Vec::new(),
            device_free: None,
        }
    }

    #[test]
    fn allocs_and_completed_frees_become_a_log() {
        let snap = Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 0x1000,
                total_size: 0x1000,
                stream: 0,
                blocks: vec![
                    Block {
                        address: 0x1000,
                        size: 0x200,
                        requested_size: 0x200,
                        state: BlockState::ActiveAllocated,
                        frames: Vec::new(),
                    },
                    Block {
                        address: 0x1200,
                        size: 0xe00,
                        requested_size: 0,
                        state: BlockState::Inactive,
                        frames: Vec::new(),
                    },
                ],
            }],
            device_traces: vec![vec![
                ev(Action::FreeRequested, 0x1800, 0x100), // predates the trace
                ev(Action::FreeCompleted, 0x1800, 0x100),
                ev(Action::Alloc, 0x1400, 0x80),
                ev(Action::Alloc, 0x1400, 0x40), // its free was lost
                ev(Action::Oom, 0, 1 << 40),
                ev(Action::FreeRequested, 0x1400, 0x40),
                ev(Action::FreeCompleted, 0x1400, 0x40),
            ]],
        };
        let log = events_from_snapshot(&snap).unwrap();
        let got: Vec<(u64, LogAction, u64, usize)> = log
            .iter()
            .map(|e| (e.line, e.action, e.ptr, e.bytes))
            .collect();
        use LogAction::{Allocate as A, AllocateFailure as X, Free as F};
        assert_eq!(
            got,
            vec![
                (0, A, 0x1800, 0x100),
                (0, A, 0x1000, 0x200),
                (2, F, 0x1800, 0x100),
                (3, A, 0x1400, 0x80),
                (4, F, 0x1400, 0x80),
                (4, A, 0x1400, 0x40),
                (5, X, 0, 1 << 40),
                (7, F, 0x1400, 0x40),
            ]
        );
        super::super::plan(&log).unwrap();
    }

    #[test]
    fn formats_are_detected() {
        let csv = b"Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x100,8,0\n";
        assert_eq!(parse_events(csv, LogFormat::Auto).unwrap().len(), 1);
        assert!(parse_events(csv, LogFormat::Torch).is_err());
        let empty = Snapshot::default().to_pickle().unwrap();
        let e = parse_events(&empty, LogFormat::Auto).unwrap_err();
        assert!(e.to_string().contains("no trace events"), "{e}");
    }
}
