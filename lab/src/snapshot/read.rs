//! [`Snapshot`] from the pickled dict PyTorch writes (or carve's
//! [`Snapshot::to_pickle`](carve::snapshot::Snapshot::to_pickle)), decoded with
//! [`unpickle`](super::unpickle), which keeps Python's shared objects shared.

use carve::error::{Error, Result};
use carve::snapshot::{Action, Block, BlockState, Frame, Segment, Snapshot, TraceEntry};

use super::unpickle::{unpickle, V};

fn malformed(reason: String) -> Error {
    Error::InvalidArgument(format!("memory snapshot: {reason}"))
}

/// Events, segments and blocks a snapshot may hold in all, counting shared objects once per
/// use: a pickle of a few bytes can reference one list millions of times.
const MAX_ITEMS: usize = 1 << 23;

/// Reads a pickled snapshot; see [`ReadSnapshot::from_pickle`](super::ReadSnapshot::from_pickle).
pub(super) fn from_pickle(bytes: &[u8]) -> Result<Snapshot> {
    let root = unpickle(bytes).map_err(|e| malformed(format!("not a readable pickle: {e}")))?;
    let (segments, traces) = match &root {
        V::List(_) | V::Tuple(_) => (list(&root, "segments")?, Vec::new()),
        V::Dict(_) => {
            let d = fields(&root)?;
            let segments = match get(&d, "segments") {
                Some(v) => list(v, "segments")?,
                None => Vec::new(),
            };
            let traces = match get(&d, "device_traces") {
                Some(v) => list(v, "device_traces")?,
                None => Vec::new(),
            };
            (segments, traces)
        }
        _ => return Err(malformed("the pickle is neither a dict nor a list".into())),
    };
    // Count first, from list lengths alone, so a small pickle that references one big list many
    // times is refused before anything is converted.
    let len = |v: &V| match v {
        V::List(l) => l.borrow().len(),
        V::Tuple(t) => t.len(),
        _ => 0,
    };
    let mut total = segments.len() + traces.iter().map(len).sum::<usize>();
    for seg in &segments {
        if let V::Dict(d) = seg {
            total += get(&d.borrow(), "blocks").map_or(0, len);
        }
        if total > MAX_ITEMS {
            break;
        }
    }
    if total > MAX_ITEMS {
        return Err(malformed(format!(
            "more than {MAX_ITEMS} events and blocks (shared lists count once per use)"
        )));
    }
    let mut out_segments = Vec::with_capacity(segments.len());
    for (i, v) in segments.iter().enumerate() {
        let seg = segment(v).map_err(|e| malformed(format!("segment {i}: {}", why(e))))?;
        out_segments.push(seg);
    }
    let mut device_traces = Vec::with_capacity(traces.len());
    for (d, t) in traces.iter().enumerate() {
        let events = list(t, "device trace")?;
        let mut out = Vec::with_capacity(events.len());
        for (i, e) in events.iter().enumerate() {
            out.push(
                entry(e).map_err(|e| malformed(format!("device {d}, event {i}: {}", why(e))))?,
            );
        }
        device_traces.push(out);
    }
    Ok(Snapshot {
        segments: out_segments,
        device_traces,
    })
}

/// The reason inside a nested snapshot error, so it is not prefixed twice.
fn why(e: Error) -> String {
    match e {
        Error::InvalidArgument(s) => s
            .strip_prefix("memory snapshot: ")
            .map_or_else(|| s.clone(), str::to_owned),
        e => e.to_string(),
    }
}

type Fields = Vec<(V, V)>;

fn list(v: &V, what: &str) -> Result<Vec<V>> {
    match v {
        V::List(l) => Ok(l.borrow().clone()),
        V::Tuple(t) => Ok(t.as_ref().clone()),
        _ => Err(malformed(format!("{what} is not a list"))),
    }
}

fn fields(v: &V) -> Result<Fields> {
    match v {
        V::Dict(d) => Ok(d.borrow().clone()),
        _ => Err(malformed("expected a dict".into())),
    }
}

fn get<'a>(d: &'a Fields, name: &str) -> Option<&'a V> {
    d.iter()
        .rev() // a later SETITEM of the same key wins, as in Python
        .find(|(k, _)| matches!(k, V::Str(s) if &**s == name))
        .map(|(_, v)| v)
}

fn uint(d: &Fields, name: &str) -> Result<Option<u64>> {
    match get(d, name) {
        None | Some(V::None) => Ok(None),
        Some(V::Int(v)) if *v >= 0 => Ok(Some(*v as u64)),
        Some(V::Bool(b)) => Ok(Some(u64::from(*b))),
        Some(other) => Err(malformed(format!(
            "{name} is not a non-negative 64-bit integer: {other:?}"
        ))),
    }
}

fn need(d: &Fields, name: &str) -> Result<u64> {
    uint(d, name)?.ok_or_else(|| malformed(format!("no {name}")))
}

fn text(d: &Fields, name: &str) -> Result<String> {
    match get(d, name) {
        Some(V::Str(s)) => Ok(s.to_string()),
        Some(V::Bytes(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        _ => Err(malformed(format!("no {name} string"))),
    }
}

fn frame_list(d: &Fields) -> Vec<Frame> {
    // Frames only label things: unreadable ones are dropped rather than failing the snapshot.
    let Some(V::List(fs)) = get(d, "frames") else {
        return Vec::new();
    };
    let fs = fs.borrow();
    fs.iter()
        .filter_map(|f| {
            let f = fields(f).ok()?;
            Some(Frame {
                filename: text(&f, "filename").unwrap_or_default(),
                line: uint(&f, "line").ok().flatten().unwrap_or(0),
                name: text(&f, "name").unwrap_or_default(),
            })
        })
        .collect()
}

fn segment(v: &V) -> Result<Segment> {
    let d = fields(v)?;
    let address = need(&d, "address")?;
    let blocks_v = match get(&d, "blocks") {
        Some(v) => list(v, "blocks")?,
        None => Vec::new(),
    };
    let mut at = address;
    let mut blocks = Vec::with_capacity(blocks_v.len());
    for b in &blocks_v {
        let b = fields(b)?;
        let size = need(&b, "size")?;
        let state = text(&b, "state")?;
        let state = BlockState::parse(&state)
            .ok_or_else(|| malformed(format!("unknown block state {state:?}")))?;
        // Old snapshots have no block addresses: blocks tile the segment in order.
        let block_address = uint(&b, "address")?.unwrap_or(at);
        let requested_size =
            uint(&b, "requested_size")?.unwrap_or(if state == BlockState::Inactive {
                0
            } else {
                size
            });
        blocks.push(Block {
            address: block_address,
            size,
            requested_size,
            state,
            frames: frame_list(&b),
        });
        at = block_address.saturating_add(size);
    }
    Ok(Segment {
        device: uint(&d, "device")?.unwrap_or(0),
        address,
        total_size: need(&d, "total_size")?,
        stream: uint(&d, "stream")?.unwrap_or(0),
        blocks,
    })
}

fn entry(v: &V) -> Result<TraceEntry> {
    let d = fields(v)?;
    Ok(TraceEntry {
        action: Action::parse(&text(&d, "action")?),
        addr: uint(&d, "addr")?.unwrap_or(0),
        size: uint(&d, "size")?.unwrap_or(0),
        stream: uint(&d, "stream")?.unwrap_or(0),
        time_us: match get(&d, "time_us") {
            Some(V::Int(t)) => *t,
            Some(V::Float(t)) => *t as i64,
            _ => 0,
        },
        device_free: uint(&d, "device_free")?,
        frames: frame_list(&d),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::ReadSnapshot;

    fn sample() -> Snapshot {
        let f = Frame {
            filename: "src/main.rs".into(),
            line: 7,
            name: "main".into(),
        };
        Snapshot {
            segments: vec![Segment {
                device: 0,
                address: 0x7f00_0000_0000,
                total_size: 4096,
                stream: 0,
                blocks: vec![
                    Block {
                        address: 0x7f00_0000_0000,
                        size: 1024,
                        requested_size: 1000,
                        state: BlockState::ActiveAllocated,
                        frames: vec![f.clone()],
                    },
                    Block {
                        address: 0x7f00_0000_0400,
                        size: 3072,
                        requested_size: 0,
                        state: BlockState::Inactive,
                        frames: vec![],
                    },
                ],
            }],
            device_traces: vec![vec![
                TraceEntry {
                    action: Action::SegmentAlloc,
                    addr: 0x7f00_0000_0000,
                    size: 4096,
                    stream: 0,
                    time_us: 1,
                    frames: vec![],
                    device_free: None,
                },
                TraceEntry {
                    action: Action::Alloc,
                    addr: 0x7f00_0000_0000,
                    size: 1024,
                    stream: 0x55,
                    time_us: 2,
                    frames: vec![f],
                    device_free: None,
                },
                TraceEntry {
                    action: Action::Oom,
                    addr: 0,
                    size: 1 << 40,
                    stream: 0,
                    time_us: 3,
                    frames: vec![],
                    device_free: Some(3072),
                },
            ]],
        }
    }

    #[test]
    fn round_trips() {
        let s = sample();
        s.check().unwrap();
        let bytes = s.to_pickle().unwrap();
        assert_eq!(bytes[0], 0x80, "a protocol-2+ pickle starts with PROTO");
        assert_eq!(Snapshot::from_pickle(&bytes).unwrap(), s);
    }

    #[test]
    fn bad_pickles_are_errors() {
        assert!(Snapshot::from_pickle(b"").is_err());
        assert!(Snapshot::from_pickle(b"\x80\x03K\x01.").is_err(), "an int");
        let mut bytes = sample().to_pickle().unwrap();
        bytes.truncate(bytes.len() / 2);
        assert!(Snapshot::from_pickle(&bytes).is_err());
    }

    #[test]
    fn python_pickles_with_shared_frames_read() {
        // pickle.dumps({'segments': [], 'device_traces': [[e1, e2]]}, protocol=4) where both
        // events reference one frames list, as PyTorch's snapshots share frames.
        let bytes: &[u8] = b"\x80\x04\x95\x9e\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x08segments\x94]\x94\x8c\x0ddevice_traces\x94]\x94]\x94(}\x94(\x8c\x06action\x94\x8c\x05alloc\x94\x8c\x04addr\x94M\x00\x10\x8c\x04size\x94M\x00\x02\x8c\x06frames\x94]\x94}\x94(\x8c\x08filename\x94\x8c\x04a.py\x94\x8c\x04line\x94K\x01\x8c\x04name\x94\x8c\x01x\x94uau}\x94(h\x07h\x08h\x09M\x00 h\x0aM\x00\x02h\x0bh\x0cueau.";
        let s = Snapshot::from_pickle(bytes).unwrap();
        let t = &s.device_traces[0];
        assert_eq!(t.len(), 2);
        assert_eq!((t[1].addr, t[1].size), (0x2000, 512));
        assert_eq!(t[0].frames, t[1].frames);
        assert_eq!(t[1].frames[0].filename, "a.py");
    }

    #[test]
    fn check_finds_gaps() {
        let mut s = sample();
        s.segments[0].total_size += 256;
        assert!(s.check().is_err());
    }
}
