//! Shared helpers for the suballocator tests: a scriptable upstream and a model checker that
//! runs random allocate/free sequences against a reference model.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use carve::resource::Properties;
use carve::{Error, HostMemoryResource, MemoryResource, Result, StreamRef};

/// Host memory that logs every request and refuses single requests above `limit` with a
/// typed out-of-memory error.
#[derive(Clone, Debug, Default)]
pub struct ScriptedUpstream {
    pub host: HostMemoryResource,
    pub limit: Arc<AtomicUsize>,
    pub requests: Arc<Mutex<Vec<usize>>>,
}

impl ScriptedUpstream {
    pub fn new() -> Self {
        let s = Self::default();
        s.limit.store(usize::MAX, Ordering::Relaxed);
        s
    }
    pub fn with_limit(limit: usize) -> Self {
        let s = Self::new();
        s.limit.store(limit, Ordering::Relaxed);
        s
    }
    pub fn requests(&self) -> Vec<usize> {
        self.requests.lock().unwrap().clone()
    }
}

// SAFETY: delegates to the host resource, which upholds the contract; refusing is always allowed.
unsafe impl MemoryResource for ScriptedUpstream {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        self.requests.lock().unwrap().push(bytes);
        if bytes > self.limit.load(Ordering::Relaxed) {
            return Err(Error::OutOfMemory {
                bytes,
                resource: "ScriptedUpstream",
                detail: "over the scripted limit".into(),
            });
        }
        self.host.allocate(stream, bytes, align)
    }
    unsafe fn deallocate(
        &self,
        s: StreamRef<'_>,
        p: NonNull<u8>,
        bytes: usize,
        a: usize,
    ) -> Result<()> {
        // SAFETY: forwarded caller contract.
        unsafe { self.host.deallocate(s, p, bytes, a) }
    }
    fn properties(&self) -> Properties {
        Properties::HOST
    }
    fn device(&self) -> Option<carve::Device> {
        None
    }
}

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

/// Proptest cases: `default`, or `PROPTEST_CASES` when set (for long fuzzing runs, see
/// RELIABILITY.md).
pub fn cases(default: u32) -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
