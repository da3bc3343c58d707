//! A small unpickler for plain data (dicts, lists, tuples, sets, strings, bytes, numbers, bools,
//! None), protocols 2 to 5: what `pickle.dump` writes for a memory snapshot.
//!
//! Why not a general crate: real snapshots share objects (one frame dict referenced from many
//! events), which a tree-shaped decoder cannot represent, and input from a file must not be able
//! to crash the process. Here containers are reference-counted (shared, as in Python), the
//! virtual machine is iterative, dropping a deep structure is iterative, and lengths are checked
//! against the input before anything is allocated. Objects (`GLOBAL`, `REDUCE`, ...) decode as
//! `None`: the snapshot reader has no use for them. A structure that contains itself is leaked
//! rather than freed (reference counts), which a one-shot reader can afford.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// A decoded value. Containers are shared, as Python's objects are.
#[derive(Clone, Debug)]
pub(super) enum V {
    None,
    Bool(bool),
    Int(i64),
    /// An integer beyond 64 bits.
    BigInt,
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    List(Rc<RefCell<Vec<V>>>),
    Tuple(Rc<Vec<V>>),
    Dict(Rc<RefCell<Vec<(V, V)>>>),
}

/// Drops containers without recursion: the children of a container whose last reference goes
/// are moved to a queue and dropped from there.
impl Drop for V {
    fn drop(&mut self) {
        let mut queue: Vec<V> = Vec::new();
        take_children(self, &mut queue);
        while let Some(mut v) = queue.pop() {
            take_children(&mut v, &mut queue);
        }
    }
}

fn take_children(v: &mut V, queue: &mut Vec<V>) {
    match v {
        V::List(l) if Rc::strong_count(l) == 1 => queue.append(&mut l.borrow_mut()),
        V::Dict(d) if Rc::strong_count(d) == 1 => {
            for (k, x) in d.borrow_mut().drain(..) {
                queue.push(k);
                queue.push(x);
            }
        }
        V::Tuple(t) => {
            if let Some(t) = Rc::get_mut(t) {
                queue.append(t);
            }
        }
        _ => {}
    }
}

/// Why a pickle could not be read, with the byte offset.
pub(super) fn error(at: usize, what: impl std::fmt::Display) -> String {
    format!("byte {at}: {what}")
}

/// A stack entry: a value, or a MARK.
enum Item {
    Mark,
    Val(V),
}

struct Vm<'a> {
    input: &'a [u8],
    pos: usize,
    stack: Vec<Item>,
    memo: HashMap<u32, V>,
    next_memo: u32,
}

/// Decodes `input`.
pub(super) fn unpickle(input: &[u8]) -> Result<V, String> {
    let mut vm = Vm {
        input,
        pos: 0,
        stack: Vec::new(),
        memo: HashMap::new(),
        next_memo: 0,
    };
    vm.run()
}

impl Vm<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.input.len())
            .ok_or_else(|| error(self.pos, format!("{n} bytes needed past the end")))?;
        let s = &self.input[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn le<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    /// A length read as `N` little-endian bytes, checked against what is left of the input.
    fn len<const N: usize>(&mut self) -> Result<usize, String> {
        let mut b = [0u8; 8];
        b[..N].copy_from_slice(&self.le::<N>()?);
        let n = u64::from_le_bytes(b);
        let left = (self.input.len() - self.pos) as u64;
        if n > left {
            return Err(error(
                self.pos,
                format!("length {n} exceeds the {left} bytes left"),
            ));
        }
        Ok(n as usize)
    }

    fn push(&mut self, v: V) {
        self.stack.push(Item::Val(v));
    }

    fn pop(&mut self) -> Result<V, String> {
        match self.stack.pop() {
            Some(Item::Val(v)) => Ok(v),
            Some(Item::Mark) => Err(error(self.pos, "a value expected, a MARK found")),
            None => Err(error(self.pos, "stack underflow")),
        }
    }

    fn top(&mut self) -> Result<&mut V, String> {
        match self.stack.last_mut() {
            Some(Item::Val(v)) => Ok(v),
            _ => Err(error(self.pos, "no value on the stack")),
        }
    }

    /// The values above the topmost MARK, which is removed.
    fn pop_mark(&mut self) -> Result<Vec<V>, String> {
        let at = self
            .stack
            .iter()
            .rposition(|i| matches!(i, Item::Mark))
            .ok_or_else(|| error(self.pos, "no MARK"))?;
        let items = self.stack.split_off(at + 1);
        self.stack.pop();
        Ok(items
            .into_iter()
            .map(|i| match i {
                Item::Val(v) => v,
                Item::Mark => unreachable!("above the topmost MARK"),
            })
            .collect())
    }

    fn text(&mut self, n: usize) -> Result<V, String> {
        let at = self.pos;
        let s = std::str::from_utf8(self.take(n)?).map_err(|e| error(at, e))?;
        Ok(V::Str(Rc::from(s)))
    }

    fn bytes(&mut self, n: usize) -> Result<V, String> {
        Ok(V::Bytes(Rc::from(self.take(n)?)))
    }

    fn long(&mut self, n: usize) -> Result<V, String> {
        let b = self.take(n)?;
        if n > 8 {
            return Ok(V::BigInt);
        }
        let neg = b.last().is_some_and(|&x| x & 0x80 != 0);
        let mut w = [if neg { 0xff } else { 0 }; 8];
        w[..n].copy_from_slice(b);
        Ok(V::Int(i64::from_le_bytes(w)))
    }

    fn memo_put(&mut self, id: u32) -> Result<(), String> {
        let v = self.top()?.clone();
        self.memo.insert(id, v);
        Ok(())
    }

    fn memo_get(&mut self, id: u32) -> Result<(), String> {
        let v = self
            .memo
            .get(&id)
            .cloned()
            .ok_or_else(|| error(self.pos, format!("memo {id} was never stored")))?;
        self.push(v);
        Ok(())
    }

    fn append(&mut self, items: Vec<V>) -> Result<(), String> {
        match self.top()? {
            V::List(l) => {
                l.borrow_mut().extend(items);
                Ok(())
            }
            // Objects decode as None; appending to one changes nothing we keep.
            V::None => Ok(()),
            _ => Err(error(self.pos, "APPEND to a value that is not a list")),
        }
    }

    fn set_items(&mut self, items: Vec<V>) -> Result<(), String> {
        if items.len() % 2 != 0 {
            return Err(error(self.pos, "SETITEMS with an odd number of values"));
        }
        match self.top()? {
            V::Dict(d) => {
                let mut d = d.borrow_mut();
                let mut it = items.into_iter();
                while let (Some(k), Some(v)) = (it.next(), it.next()) {
                    d.push((k, v));
                }
                Ok(())
            }
            V::None => Ok(()),
            _ => Err(error(self.pos, "SETITEM on a value that is not a dict")),
        }
    }

    fn run(&mut self) -> Result<V, String> {
        loop {
            let at = self.pos;
            let op = self.u8()?;
            match op {
                0x80 => {
                    let p = self.u8()?;
                    if !(2..=5).contains(&p) {
                        return Err(error(at, format!("pickle protocol {p} (2 to 5 are read)")));
                    }
                }
                0x95 => {
                    self.le::<8>()?; // FRAME: a length hint only
                }
                b'.' => return self.pop(),
                b'(' => self.stack.push(Item::Mark),
                b'0' => {
                    self.stack
                        .pop()
                        .ok_or_else(|| error(at, "POP of an empty stack"))?;
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v);
                }
                b'N' => self.push(V::None),
                0x88 => self.push(V::Bool(true)),
                0x89 => self.push(V::Bool(false)),
                b'J' => {
                    let v = i32::from_le_bytes(self.le::<4>()?);
                    self.push(V::Int(v.into()));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(V::Int(v.into()));
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.le::<2>()?);
                    self.push(V::Int(v.into()));
                }
                0x8a => {
                    let n = self.u8()? as usize;
                    let v = self.long(n)?;
                    self.push(v);
                }
                0x8b => {
                    let n = self.len::<4>()?;
                    let v = self.long(n)?;
                    self.push(v);
                }
                b'G' => {
                    let v = f64::from_be_bytes(self.le::<8>()?);
                    self.push(V::Float(v));
                }
                0x8c => {
                    let n = self.len::<1>()?;
                    let v = self.text(n)?;
                    self.push(v);
                }
                b'X' => {
                    let n = self.len::<4>()?;
                    let v = self.text(n)?;
                    self.push(v);
                }
                0x8d => {
                    let n = self.len::<8>()?;
                    let v = self.text(n)?;
                    self.push(v);
                }
                b'C' => {
                    let n = self.len::<1>()?;
                    let v = self.bytes(n)?;
                    self.push(v);
                }
                b'B' => {
                    let n = self.len::<4>()?;
                    let v = self.bytes(n)?;
                    self.push(v);
                }
                0x8e | 0x96 => {
                    let n = self.len::<8>()?;
                    let v = self.bytes(n)?;
                    self.push(v);
                }
                b']' | 0x8f => self.push(V::List(Rc::new(RefCell::new(Vec::new())))),
                b'}' => self.push(V::Dict(Rc::new(RefCell::new(Vec::new())))),
                b')' => self.push(V::Tuple(Rc::new(Vec::new()))),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push(V::List(Rc::new(RefCell::new(items))));
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    self.push(V::Dict(Rc::new(RefCell::new(Vec::new()))));
                    self.set_items(items)?;
                }
                b't' | 0x91 => {
                    let items = self.pop_mark()?;
                    self.push(if op == b't' {
                        V::Tuple(Rc::new(items))
                    } else {
                        V::List(Rc::new(RefCell::new(items)))
                    });
                }
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push(V::Tuple(Rc::new(items)));
                }
                b'a' => {
                    let v = self.pop()?;
                    self.append(vec![v])?;
                }
                b'e' | 0x90 => {
                    let items = self.pop_mark()?;
                    self.append(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![k, v])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    self.set_items(items)?;
                }
                b'q' => {
                    let id = self.u8()?.into();
                    self.memo_put(id)?;
                }
                b'r' => {
                    let id = u32::from_le_bytes(self.le::<4>()?);
                    self.memo_put(id)?;
                }
                0x94 => {
                    let id = self.next_memo;
                    self.next_memo += 1;
                    self.memo_put(id)?;
                }
                b'h' => {
                    let id = self.u8()?.into();
                    self.memo_get(id)?;
                }
                b'j' => {
                    let id = u32::from_le_bytes(self.le::<4>()?);
                    self.memo_get(id)?;
                }
                // Objects: GLOBAL (two text lines), STACK_GLOBAL, REDUCE, BUILD, NEWOBJ(_EX).
                b'c' => {
                    for _ in 0..2 {
                        let rest = &self.input[self.pos..];
                        let nl = rest
                            .iter()
                            .position(|&b| b == b'\n')
                            .ok_or_else(|| error(self.pos, "GLOBAL without a newline"))?;
                        self.pos += nl + 1;
                    }
                    self.push(V::None);
                }
                0x93 | b'R' | 0x81 => {
                    self.pop()?;
                    self.pop()?;
                    self.push(V::None);
                }
                0x92 => {
                    for _ in 0..3 {
                        self.pop()?;
                    }
                    self.push(V::None);
                }
                b'b' => {
                    self.pop()?;
                }
                other => {
                    return Err(error(at, format!("opcode {other:#04x} is not read")));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ints(v: &V) -> Vec<i64> {
        match v {
            V::List(l) => l
                .borrow()
                .iter()
                .map(|x| match x {
                    V::Int(i) => *i,
                    other => panic!("{other:?}"),
                })
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reads_what_serde_pickle_writes() {
        let bytes =
            serde_pickle::to_vec(&vec![1i64, -2, 300, 70_000, -(1 << 40)], Default::default())
                .unwrap();
        assert_eq!(
            ints(&unpickle(&bytes).unwrap()),
            [1, -2, 300, 70_000, -(1 << 40)]
        );
    }

    #[test]
    fn shared_objects_stay_shared() {
        // Protocol 2: d = {'a': 1}; [d, d] — the second d is a memo reference.
        let bytes = b"\x80\x02]q\x00(}q\x01X\x01\x00\x00\x00aq\x02K\x01sh\x01e.";
        let v = unpickle(bytes).unwrap();
        let V::List(l) = &v else { panic!() };
        let l = l.borrow();
        let (V::Dict(a), V::Dict(b)) = (&l[0], &l[1]) else {
            panic!()
        };
        assert!(Rc::ptr_eq(a, b));
    }

    #[test]
    fn hostile_inputs_are_errors_not_crashes() {
        // A length far past the end is refused before allocating.
        assert!(unpickle(b"\x80\x04\x8d\xff\xff\xff\xff\xff\xff\x00\x00abc").is_err());
        assert!(unpickle(b"\x80\x02").is_err());
        assert!(unpickle(b"\x80\x02e.").is_err(), "APPENDS without a MARK");
        assert!(unpickle(b"\x80\x09N.").is_err(), "unknown protocol");
        assert!(unpickle(b"\x80\x02h\x05.").is_err(), "memo never stored");
        // A million nested lists decode, and drop, without recursion.
        let n = 1_000_000;
        let mut deep = b"\x80\x02".to_vec();
        deep.extend(std::iter::repeat_n(b']', n));
        deep.extend(std::iter::repeat_n(b'a', n - 1));
        deep.push(b'.');
        drop(unpickle(&deep).unwrap());
    }
}
