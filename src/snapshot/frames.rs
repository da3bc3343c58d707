//! Stack frames from a Rust backtrace, for the viewer's "where was this allocated".

use std::backtrace::{Backtrace, BacktraceStatus};

use super::Frame;

/// The frames of `bt`, innermost first, parsed from its text form (std has no stable frame API).
/// Empty when it was not captured.
pub fn frames_of(bt: &Backtrace) -> Vec<Frame> {
    if bt.status() != BacktraceStatus::Captured {
        return Vec::new();
    }
    parse(&bt.to_string())
}

/// Parses `  N: function` lines, each optionally followed by `at file:line:column`.
fn parse(text: &str) -> Vec<Frame> {
    let mut frames: Vec<Frame> = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(location) = line.strip_prefix("at ") {
            if let Some(f) = frames.last_mut() {
                let mut parts = location.rsplitn(3, ':');
                let (_col, line_no, file) = (parts.next(), parts.next(), parts.next());
                match (file, line_no.and_then(|l| l.parse().ok())) {
                    (Some(file), Some(n)) => {
                        f.filename = file.to_owned();
                        f.line = n;
                    }
                    _ => f.filename = location.to_owned(),
                }
            }
        } else if let Some((index, name)) = line.split_once(": ") {
            if index.bytes().all(|c| c.is_ascii_digit()) && !index.is_empty() {
                frames.push(Frame {
                    filename: String::new(),
                    line: 0,
                    name: name.to_owned(),
                });
            }
        }
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_std_backtrace_text() {
        let text = "   0: carve::adaptor::tracking::alloc\n             at ./src/adaptor/tracking.rs:140:22\n   1: std::rt::lang_start\n   2: main\n             at /rustc/abc/library/std/src/rt.rs:9:5\n";
        let f = parse(text);
        assert_eq!(f.len(), 3);
        assert_eq!(f[0].name, "carve::adaptor::tracking::alloc");
        assert_eq!(
            (f[0].filename.as_str(), f[0].line),
            ("./src/adaptor/tracking.rs", 140)
        );
        assert_eq!((f[1].filename.as_str(), f[1].line), ("", 0));
        assert_eq!(f[2].line, 9);
    }

    #[test]
    fn uncaptured_backtraces_have_no_frames() {
        assert!(frames_of(&Backtrace::disabled()).is_empty());
    }
}
