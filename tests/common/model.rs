//! A model checker for the suballocator tests: runs allocate/free sequences against a reference
//! model of the live blocks.

use std::collections::BTreeMap;
use std::ptr::NonNull;

use carve::{MemoryResource, StreamRef};

/// One step of a random sequence.
#[derive(Clone, Debug)]
pub enum Op {
    Alloc {
        bytes: usize,
        align: usize,
        stream: usize,
    },
    Free {
        pick: usize,
        stream: usize,
    },
}

pub fn stream(i: usize) -> StreamRef<'static> {
    StreamRef::simulated(1 + i)
}

/// The reference model: live blocks by address, each filled with its own tag byte.
#[derive(Default)]
pub struct Model {
    pub live: BTreeMap<usize, (usize, usize, u8)>,
    next_tag: u8,
}

impl Model {
    /// Records a new block after checking alignment and that it overlaps no live block, and
    /// fills it with a fresh tag (host-accessible resources only).
    pub fn add(&mut self, p: NonNull<u8>, bytes: usize, align: usize, fill: bool) {
        let a = p.as_ptr() as usize;
        assert_eq!(a % align, 0, "{a:#x} not aligned to {align}");
        if let Some((&b, &(len, _, _))) = self.live.range(..=a).next_back() {
            assert!(b + len <= a, "{a:#x}+{bytes} overlaps live {b:#x}+{len}");
        }
        if let Some((&b, _)) = self.live.range(a..).next() {
            assert!(a + bytes <= b, "{a:#x}+{bytes} overlaps live {b:#x}");
        }
        self.next_tag = self.next_tag.wrapping_add(1).max(1);
        if fill {
            // SAFETY: the resource just handed us `bytes` host-accessible bytes.
            unsafe { p.as_ptr().write_bytes(self.next_tag, bytes) };
        }
        self.live.insert(a, (bytes, align, self.next_tag));
    }

    /// Removes the `pick`-th live block (mod count), checking its tag survived.
    pub fn take(&mut self, pick: usize, check: bool) -> Option<(NonNull<u8>, usize, usize)> {
        if self.live.is_empty() {
            return None;
        }
        let &a = self.live.keys().nth(pick % self.live.len()).unwrap();
        let (bytes, align, tag) = self.live.remove(&a).unwrap();
        if check {
            // SAFETY: the block is live and `bytes` long.
            let s = unsafe { std::slice::from_raw_parts(a as *const u8, bytes) };
            assert!(
                s == vec![tag; bytes].as_slice(),
                "block {a:#x} was overwritten"
            );
        }
        Some((NonNull::new(a as *mut u8).unwrap(), bytes, align))
    }
}

/// Runs `ops` on `mr` against the model, calling `check` after every step; frees what is left,
/// then asserts `in_use` is zero. `fill` writes and checks tags (host memory only).
pub fn run_ops<M: MemoryResource + ?Sized>(
    mr: &M,
    ops: &[Op],
    fill: bool,
    check: &dyn Fn() -> std::result::Result<(), String>,
    in_use: &dyn Fn() -> usize,
) {
    let mut model = Model::default();
    for op in ops {
        match *op {
            Op::Alloc {
                bytes,
                align,
                stream: s,
            } => {
                let p = mr.allocate(stream(s), bytes, align).unwrap();
                model.add(p, bytes, align, fill);
            }
            Op::Free { pick, stream: s } => {
                if let Some((p, bytes, align)) = model.take(pick, fill) {
                    // SAFETY: a live block of `mr` with these arguments, freed once.
                    unsafe { mr.deallocate(stream(s), p, bytes, align) }.unwrap();
                }
            }
        }
        check().unwrap();
    }
    while let Some((p, bytes, align)) = model.take(0, fill) {
        // SAFETY: as above.
        unsafe { mr.deallocate(stream(0), p, bytes, align) }.unwrap();
    }
    check().unwrap();
    assert_eq!(in_use(), 0, "bytes in use after freeing everything");
}
