//! Reading the CSV log into events, each with its line number.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use carve::adaptor::LogAction;
use carve::error::{Error, Result};

/// One row of the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogEvent {
    /// 1-based line in the file (the header is line 1).
    pub line: u64,
    /// The logged thread id.
    pub thread: u64,
    /// Allocate, free or failed allocation.
    pub action: LogAction,
    /// 0 for `(nil)`.
    pub ptr: u64,
    /// The size in bytes.
    pub bytes: usize,
    /// The logged stream handle.
    pub stream: u64,
}

const COLUMNS: [&str; 5] = ["Thread", "Action", "Pointer", "Size", "Stream"];

/// Reads the log at `path`.
pub fn read_log(path: impl AsRef<Path>) -> Result<Vec<LogEvent>> {
    parse_log(File::open(path)?)
}

/// Parses a log: RMM's header `Thread,Time,Action,Pointer,Size,Stream` (columns found by name,
/// so their order may differ; Time is not needed), then one row per event.
pub fn parse_log(reader: impl Read) -> Result<Vec<LogEvent>> {
    let mut csv = csv::ReaderBuilder::new()
        .has_headers(true)
        .flexible(true)
        .trim(csv::Trim::All)
        .from_reader(reader);
    let header = csv.headers().map_err(|e| csv_error(e, 1))?.clone();
    if header.is_empty() || header.iter().all(str::is_empty) {
        return Err(malformed(1, "empty log: no header line".to_owned()));
    }
    let mut index = [0usize; COLUMNS.len()];
    for (slot, name) in index.iter_mut().zip(COLUMNS) {
        *slot = header.iter().position(|h| h == name).ok_or_else(|| {
            malformed(
                1,
                format!("the header has no {name} column (expected Thread,Time,Action,Pointer,Size,Stream)"),
            )
        })?;
    }
    let width = index.iter().max().expect("five columns") + 1;
    let [thread, action, pointer, size, stream] = index;

    let mut events = Vec::new();
    let mut record = csv::StringRecord::new();
    loop {
        let more = csv.read_record(&mut record).map_err(|e| csv_error(e, 0))?;
        if !more {
            break;
        }
        let line = record.position().map_or(0, |p| p.line());
        if record.len() == 1 && record[0].is_empty() {
            continue;
        }
        if record.len() < width {
            return Err(malformed(
                line,
                format!(
                    "expected {} columns, found {}: {:?}",
                    header.len(),
                    record.len(),
                    record.iter().collect::<Vec<_>>().join(",")
                ),
            ));
        }
        let action_text = &record[action];
        let action = LogAction::parse(action_text).ok_or_else(|| {
            malformed(
                line,
                format!(
                    "unknown action {action_text:?} (expected allocate, free or allocate failure)"
                ),
            )
        })?;
        events.push(LogEvent {
            line,
            thread: decimal(&record[thread], "Thread", line)?,
            action,
            ptr: pointer_value(&record[pointer], line)?,
            bytes: decimal(&record[size], "Size", line)?,
            stream: hex(&record[stream], "Stream", line)?,
        });
    }
    Ok(events)
}

fn malformed(line: u64, reason: String) -> Error {
    Error::MalformedLog { line, reason }
}

fn csv_error(e: csv::Error, fallback_line: u64) -> Error {
    let line = e.position().map_or(fallback_line, |p| p.line());
    match e.into_kind() {
        csv::ErrorKind::Io(io) => Error::Io(io),
        kind => malformed(line, format!("unreadable CSV: {kind:?}")),
    }
}

fn decimal<T: std::str::FromStr>(text: &str, column: &str, line: u64) -> Result<T> {
    text.parse().map_err(|_| {
        malformed(
            line,
            format!("{column} {text:?} is not a non-negative integer"),
        )
    })
}

/// `%p`: `0x…` hex, or `(nil)` for null.
fn pointer_value(text: &str, line: u64) -> Result<u64> {
    if text == "(nil)" {
        return Ok(0);
    }
    hex(text, "Pointer", line)
}

/// Hex with or without `0x` (C++ prints a null stream as a bare `0`).
fn hex(text: &str, column: &str, line: u64) -> Result<u64> {
    let digits = text
        .strip_prefix("0x")
        .or_else(|| text.strip_prefix("0X"))
        .unwrap_or(text);
    u64::from_str_radix(digits, 16).map_err(|_| {
        malformed(
            line,
            format!("{column} {text:?} is not a hexadecimal address"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Vec<LogEvent>> {
        parse_log(text.as_bytes())
    }

    fn line_of(e: Error) -> (u64, String) {
        match e {
            Error::MalformedLog { line, reason } => (line, reason),
            other => panic!("expected MalformedLog, got {other:?}"),
        }
    }

    #[test]
    fn reads_rmm_rows() {
        let log = "Thread,Time,Action,Pointer,Size,Stream\n\
                   140573312,14:03:27.123456,allocate,0x7f8a40000000,1024,0\n\
                   140573312,14:03:27.123457,allocate failure,(nil),99,0x55d5c7a0e2b0\n\
                   140573313,14:03:27.123460,free,0x7f8a40000000,1024,0\n";
        let ev = parse(log).unwrap();
        assert_eq!(ev.len(), 3);
        assert_eq!(
            ev[0],
            LogEvent {
                line: 2,
                thread: 140573312,
                action: LogAction::Allocate,
                ptr: 0x7f8a40000000,
                bytes: 1024,
                stream: 0
            }
        );
        assert_eq!(
            (ev[1].action, ev[1].ptr, ev[1].stream),
            (LogAction::AllocateFailure, 0, 0x55d5c7a0e2b0)
        );
        assert_eq!(
            (ev[2].line, ev[2].thread, ev[2].action),
            (4, 140573313, LogAction::Free)
        );
    }

    #[test]
    fn columns_are_found_by_name() {
        let log = "Action,Size,Pointer,Stream,Thread\nallocate,8,0x100,0x0,3\n";
        let ev = parse(log).unwrap();
        assert_eq!((ev[0].bytes, ev[0].ptr, ev[0].thread), (8, 0x100, 3));
    }

    #[test]
    fn errors_name_the_line() {
        let head = "Thread,Time,Action,Pointer,Size,Stream\n";
        let ok = "1,t,allocate,0x100,8,0\n";
        let (line, why) = line_of(parse(&format!("{head}{ok}1,t,allocate,0x200\n")).unwrap_err());
        assert_eq!(line, 3);
        assert!(why.contains("expected 6 columns, found 4"), "{why}");
        let (line, why) =
            line_of(parse(&format!("{head}{ok}{ok}1,t,allocate,0x300,12x,0\n")).unwrap_err());
        assert_eq!(line, 4);
        assert!(why.contains("Size \"12x\""), "{why}");
        let (line, why) = line_of(parse(&format!("{head}1,t,allocate,zz,8,0\n")).unwrap_err());
        assert_eq!(line, 2);
        assert!(why.contains("Pointer"), "{why}");
        let (line, why) = line_of(parse(&format!("{head}1,t,malloc,0x1,8,0\n")).unwrap_err());
        assert_eq!(line, 2);
        assert!(why.contains("unknown action \"malloc\""), "{why}");
        let (line, why) = line_of(parse(&format!("{head}-1,t,free,0x1,8,0\n")).unwrap_err());
        assert_eq!(line, 2);
        assert!(why.contains("Thread"), "{why}");
        let (line, why) = line_of(parse("Thread,Time,Action,Pointer,Size\n").unwrap_err());
        assert_eq!(line, 1);
        assert!(why.contains("no Stream column"), "{why}");
        assert_eq!(line_of(parse("").unwrap_err()).0, 1);
    }
}
