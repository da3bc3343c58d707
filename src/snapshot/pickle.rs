//! [`Snapshot`] as the pickled dict PyTorch uses (protocol 3): a small writer for the few kinds
//! of value a snapshot holds (dicts, lists, tuples, strings, integers, floats, bools), so that
//! writing a snapshot needs no pickle crate. The reader is the lab's (`carve-lab`).

use super::{Action, Frame, Snapshot};
use crate::error::Result;

/// What a snapshot's pickle is made of.
enum Value {
    Dict(Vec<(&'static str, Value)>),
    List(Vec<Value>),
    Tuple(Vec<Value>),
    Str(String),
    Int(i64),
    Float(f64),
    Bool(bool),
}

fn int(v: u64) -> Value {
    i64::try_from(v).map_or_else(|_| Value::Float(v as f64), Value::Int)
}

fn text(s: &str) -> Value {
    Value::Str(s.to_owned())
}

fn frames(fs: &[Frame]) -> Value {
    Value::List(
        fs.iter()
            .map(|f| {
                Value::Dict(vec![
                    ("filename", text(&f.filename)),
                    ("line", int(f.line)),
                    ("name", text(&f.name)),
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
                    Value::Dict(vec![
                        ("address", int(b.address)),
                        ("size", int(b.size)),
                        ("requested_size", int(b.requested_size)),
                        ("state", text(b.state.as_str())),
                        ("frames", frames(&b.frames)),
                    ])
                })
                .collect();
            let segment_type = if seg.total_size <= 1 << 20 {
                "small"
            } else {
                "large"
            };
            Value::Dict(vec![
                ("device", int(seg.device)),
                ("address", int(seg.address)),
                ("total_size", int(seg.total_size)),
                ("allocated_size", int(seg.allocated_size())),
                ("active_size", int(seg.active_size())),
                ("requested_size", int(seg.requested_size())),
                ("stream", int(seg.stream)),
                ("segment_type", text(segment_type)),
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
                            ("action", text(e.action.as_str())),
                            ("addr", int(e.addr)),
                            ("size", int(e.size)),
                            ("stream", int(e.stream)),
                            ("time_us", Value::Int(e.time_us)),
                            ("frames", frames(&e.frames)),
                        ];
                        // `_memory_viz trace` reads device_free of every oom event.
                        match (e.device_free, &e.action) {
                            (Some(free), _) => d.push(("device_free", int(free))),
                            (None, Action::Oom) => d.push(("device_free", int(0))),
                            _ => {}
                        }
                        Value::Dict(d)
                    })
                    .collect(),
            )
        })
        .collect();
    let root = Value::Dict(vec![
        ("segments", Value::List(segments)),
        ("device_traces", Value::List(traces)),
    ]);
    let mut out = vec![PROTO, 3];
    write(&root, &mut out);
    out.push(STOP);
    Ok(out)
}

// The opcodes of pickle protocols 2 and 3 that `write` uses (Python's `pickletools`).
const PROTO: u8 = 0x80;
const STOP: u8 = b'.';
const MARK: u8 = b'(';
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const TUPLE: u8 = b't';
const BINUNICODE: u8 = b'X';
const BININT: u8 = b'J';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;

/// Appends the opcodes that build `v`.
fn write(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Dict(fields) => {
            out.push(EMPTY_DICT);
            if !fields.is_empty() {
                out.push(MARK);
                for (k, x) in fields {
                    write_str(k, out);
                    write(x, out);
                }
                out.push(SETITEMS);
            }
        }
        Value::List(items) => {
            out.push(EMPTY_LIST);
            if !items.is_empty() {
                out.push(MARK);
                items.iter().for_each(|x| write(x, out));
                out.push(APPENDS);
            }
        }
        Value::Tuple(items) => {
            out.push(MARK);
            items.iter().for_each(|x| write(x, out));
            out.push(TUPLE);
        }
        Value::Str(s) => write_str(s, out),
        Value::Int(i) => match i32::try_from(*i) {
            Ok(small) => {
                out.push(BININT);
                out.extend_from_slice(&small.to_le_bytes());
            }
            Err(_) => {
                // Two's complement, little-endian, without the sign-extension bytes.
                let mut bytes = i.to_le_bytes().to_vec();
                while bytes.len() > 1 {
                    let (last, prev) = (bytes[bytes.len() - 1], bytes[bytes.len() - 2]);
                    let redundant =
                        (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0);
                    if !redundant {
                        break;
                    }
                    bytes.pop();
                }
                out.push(LONG1);
                out.push(bytes.len() as u8);
                out.extend_from_slice(&bytes);
            }
        },
        Value::Float(f) => {
            out.push(BINFLOAT);
            out.extend_from_slice(&f.to_be_bytes());
        }
        Value::Bool(b) => out.push(if *b { NEWTRUE } else { NEWFALSE }),
    }
}

fn write_str(s: &str, out: &mut Vec<u8>) {
    out.push(BINUNICODE);
    // A snapshot's strings (file and function names) are far below 4 GiB.
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        write(v, &mut out);
        out
    }

    #[test]
    fn integers_take_the_shortest_form_python_reads() {
        assert_eq!(bytes(&Value::Int(-2)), b"J\xfe\xff\xff\xff");
        // pickle.dumps(1 << 40, 2)[2:-1] and pickle.dumps(-(1 << 40), 2)[2:-1]
        assert_eq!(
            bytes(&Value::Int(1 << 40)),
            b"\x8a\x06\x00\x00\x00\x00\x00\x01"
        );
        assert_eq!(
            bytes(&Value::Int(-(1 << 40))),
            b"\x8a\x06\x00\x00\x00\x00\x00\xff"
        );
        // 2^31: a positive value whose top byte has the high bit set keeps a zero byte.
        assert_eq!(bytes(&Value::Int(1 << 31)), b"\x8a\x05\x00\x00\x00\x80\x00");
        assert_eq!(
            bytes(&Value::Int(i64::MIN)),
            b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80"
        );
    }

    #[test]
    fn containers_and_strings() {
        let v = Value::Dict(vec![
            ("a", Value::List(vec![Value::Bool(true), Value::Float(0.5)])),
            ("b", Value::Tuple(vec![])),
            ("c", Value::List(vec![])),
        ]);
        // pickle.loads reads this as {'a': [True, 0.5], 'b': (), 'c': []}.
        let want: &[u8] = b"}(X\x01\x00\x00\x00a](\x88G?\xe0\x00\x00\x00\x00\x00\x00eX\x01\x00\x00\x00b(tX\x01\x00\x00\x00c]u";
        assert_eq!(bytes(&v), want);
    }

    #[test]
    fn a_snapshot_is_one_protocol_3_pickle() {
        let p = Snapshot::default().to_pickle().unwrap();
        assert_eq!(
            p,
            b"\x80\x03}(X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces]u."
        );
    }
}
