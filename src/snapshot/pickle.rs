//! [`Snapshot`] to and from the pickled dict PyTorch uses, through `serde-pickle`'s value tree.

use std::collections::BTreeMap;

use serde_pickle::{DeOptions, HashableValue as K, SerOptions, Value};

use super::{malformed, Action, Block, BlockState, Frame, Segment, Snapshot, TraceEntry};
use crate::error::Result;

fn key(s: &str) -> K {
    K::String(s.to_owned())
}

fn int(v: u64) -> Value {
    i64::try_from(v).map_or_else(|_| Value::F64(v as f64), Value::I64)
}

fn dict(fields: Vec<(&str, Value)>) -> Value {
    Value::Dict(fields.into_iter().map(|(k, v)| (key(k), v)).collect())
}

fn frames(fs: &[Frame]) -> Value {
    Value::List(
        fs.iter()
            .map(|f| {
                dict(vec![
                    ("filename", Value::String(f.filename.clone())),
                    ("line", int(f.line)),
                    ("name", Value::String(f.name.clone())),
                ])
            })
            .collect(),
    )
}

pub(super) fn to_pickle(s: &Snapshot) -> Result<Vec<u8>> {
    let segments = s
        .segments
        .iter()
        .map(|seg| {
            let blocks = seg
                .blocks
                .iter()
                .map(|b| {
                    dict(vec![
                        ("address", int(b.address)),
                        ("size", int(b.size)),
                        ("requested_size", int(b.requested_size)),
                        ("state", Value::String(b.state.as_str().to_owned())),
                        ("frames", frames(&b.frames)),
                    ])
                })
                .collect();
            dict(vec![
                ("device", int(seg.device)),
                ("address", int(seg.address)),
                ("total_size", int(seg.total_size)),
                ("allocated_size", int(seg.allocated_size())),
                ("active_size", int(seg.active_size())),
                ("requested_size", int(seg.requested_size())),
                ("stream", int(seg.stream)),
                (
                    "segment_type",
                    Value::String(
                        if seg.total_size <= 1 << 20 {
                            "small"
                        } else {
                            "large"
                        }
                        .into(),
                    ),
                ),
                ("segment_pool_id", Value::Tuple(vec![int(0), int(0)])),
                ("is_expandable", Value::Bool(false)),
                ("frames", Value::List(Vec::new())),
                ("blocks", Value::List(blocks)),
            ])
        })
        .collect();
    let traces = s
        .device_traces
        .iter()
        .map(|t| {
            Value::List(
                t.iter()
                    .map(|e| {
                        let mut d = vec![
                            ("action", Value::String(e.action.as_str().to_owned())),
                            ("addr", int(e.addr)),
                            ("size", int(e.size)),
                            ("stream", int(e.stream)),
                            ("time_us", Value::I64(e.time_us)),
                            ("frames", frames(&e.frames)),
                        ];
                        // `_memory_viz trace` reads device_free of every oom event.
                        match (e.device_free, &e.action) {
                            (Some(free), _) => d.push(("device_free", int(free))),
                            (None, Action::Oom) => d.push(("device_free", int(0))),
                            _ => {}
                        }
                        dict(d)
                    })
                    .collect(),
            )
        })
        .collect();
    let root = dict(vec![
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(traces)),
    ]);
    serde_pickle::value_to_vec(&root, SerOptions::new())
        .map_err(|e| malformed(format!("cannot pickle: {e}")))
}

pub(super) fn from_pickle(bytes: &[u8]) -> Result<Snapshot> {
    let root = serde_pickle::value_from_slice(bytes, DeOptions::new().replace_unresolved_globals())
        .map_err(|e| malformed(format!("not a readable pickle: {e}")))?;
    let (segments, traces) = match root {
        Value::List(segments) => (segments, Vec::new()),
        Value::Dict(mut d) => {
            let segments = match d.remove(&key("segments")) {
                Some(v) => list(v, "segments")?,
                None => Vec::new(),
            };
            let traces = match d.remove(&key("device_traces")) {
                Some(v) => list(v, "device_traces")?,
                None => Vec::new(),
            };
            (segments, traces)
        }
        _ => return Err(malformed("the pickle is neither a dict nor a list".into())),
    };
    let segments = segments
        .into_iter()
        .enumerate()
        .map(|(i, v)| segment(v).map_err(|e| malformed(format!("segment {i}: {e}"))))
        .collect::<Result<Vec<_>>>()?;
    let device_traces = traces
        .into_iter()
        .enumerate()
        .map(|(d, t)| {
            list(t, "device trace")?
                .into_iter()
                .enumerate()
                .map(|(i, e)| {
                    entry(e).map_err(|e| malformed(format!("device {d}, event {i}: {e}")))
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Snapshot {
        segments,
        device_traces,
    })
}

type Fields = BTreeMap<K, Value>;

fn list(v: Value, what: &str) -> Result<Vec<Value>> {
    match v {
        Value::List(l) | Value::Tuple(l) => Ok(l),
        _ => Err(malformed(format!("{what} is not a list"))),
    }
}

fn fields(v: Value) -> Result<Fields> {
    match v {
        Value::Dict(d) => Ok(d),
        _ => Err(malformed("expected a dict".into())),
    }
}

fn uint(d: &Fields, name: &str) -> Result<Option<u64>> {
    match d.get(&key(name)) {
        None | Some(Value::None) => Ok(None),
        Some(Value::I64(v)) if *v >= 0 => Ok(Some(*v as u64)),
        Some(Value::Int(v)) => v
            .to_string()
            .parse()
            .map(Some)
            .map_err(|_| malformed(format!("{name} {v} is not a 64-bit unsigned integer"))),
        Some(Value::Bool(b)) => Ok(Some(u64::from(*b))),
        Some(other) => Err(malformed(format!(
            "{name} is not a non-negative integer: {other:?}"
        ))),
    }
}

fn need(d: &Fields, name: &str) -> Result<u64> {
    uint(d, name)?.ok_or_else(|| malformed(format!("no {name}")))
}

fn text(d: &Fields, name: &str) -> Result<String> {
    match d.get(&key(name)) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Bytes(b)) => Ok(String::from_utf8_lossy(b).into_owned()),
        _ => Err(malformed(format!("no {name} string"))),
    }
}

fn frame_list(d: &mut Fields) -> Vec<Frame> {
    // Frames only label things: unreadable ones are dropped rather than failing the snapshot.
    let Some(Value::List(fs)) = d.remove(&key("frames")) else {
        return Vec::new();
    };
    fs.into_iter()
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

fn segment(v: Value) -> Result<Segment> {
    let mut d = fields(v)?;
    let address = need(&d, "address")?;
    let blocks_v = match d.remove(&key("blocks")) {
        Some(v) => list(v, "blocks")?,
        None => Vec::new(),
    };
    let mut at = address;
    let mut blocks = Vec::with_capacity(blocks_v.len());
    for b in blocks_v {
        let mut b = fields(b)?;
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
            frames: frame_list(&mut b),
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

fn entry(v: Value) -> Result<TraceEntry> {
    let mut d = fields(v)?;
    Ok(TraceEntry {
        action: Action::parse(&text(&d, "action")?),
        addr: uint(&d, "addr")?.unwrap_or(0),
        size: uint(&d, "size")?.unwrap_or(0),
        stream: uint(&d, "stream")?.unwrap_or(0),
        time_us: match d.get(&key("time_us")) {
            Some(Value::I64(t)) => *t,
            Some(Value::F64(t)) => *t as i64,
            _ => 0,
        },
        device_free: uint(&d, "device_free")?,
        frames: frame_list(&mut d),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn check_finds_gaps() {
        let mut s = sample();
        s.segments[0].total_size += 256;
        assert!(s.check().is_err());
    }
}
