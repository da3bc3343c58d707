//! Host memory wrapped for tests: it records what reaches it and can be told to refuse.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use carve::resource::Properties;
use carve::{Error, HostMemoryResource, MemoryResource, Result, StreamId, StreamRef};

/// One allocation request that reached a [`ScriptedUpstream`].
#[derive(Clone, Debug)]
pub struct Request {
    /// Bytes asked for.
    pub bytes: usize,
    /// The stream it was made on.
    pub stream: StreamId,
    /// The OS thread that made it.
    pub thread: ThreadId,
}

/// Host memory that logs every allocation request and counts every free that reaches it, and
/// refuses single requests above `limit` with a typed out-of-memory error. Clones share all of
/// it. A [`lenient`](Self::lenient) one reports every free as done, even one the host refused.
#[derive(Clone, Debug)]
pub struct ScriptedUpstream {
    pub host: HostMemoryResource,
    pub limit: Arc<AtomicUsize>,
    pub calls: Arc<Mutex<Vec<Request>>>,
    pub frees: Arc<AtomicUsize>,
    lenient: bool,
}

impl Default for ScriptedUpstream {
    fn default() -> Self {
        Self::new()
    }
}

impl ScriptedUpstream {
    /// No limit.
    pub fn new() -> Self {
        Self::with_limit(usize::MAX)
    }

    /// Refuses single requests above `limit` bytes.
    pub fn with_limit(limit: usize) -> Self {
        ScriptedUpstream {
            host: HostMemoryResource::new(),
            limit: Arc::new(AtomicUsize::new(limit)),
            calls: Arc::default(),
            frees: Arc::default(),
            lenient: false,
        }
    }

    /// Swallows the host's refusal of a bad free and returns `Ok`: a resource that breaks the
    /// typed-error promise, for tests of the conformance suite itself.
    pub fn lenient(mut self) -> Self {
        self.lenient = true;
        self
    }

    /// The sizes of the allocation requests so far, in order.
    pub fn requests(&self) -> Vec<usize> {
        self.calls.lock().unwrap().iter().map(|r| r.bytes).collect()
    }

    /// Frees that reached it so far, refused ones included.
    pub fn frees(&self) -> usize {
        self.frees.load(Ordering::SeqCst)
    }
}

// SAFETY: blocks come from the host resource unchanged; refusing is always allowed. A lenient
// one breaks only the typed-error promise (the refused pointer is never freed).
unsafe impl MemoryResource for ScriptedUpstream {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        self.calls.lock().unwrap().push(Request {
            bytes,
            stream: stream.id(),
            thread: std::thread::current().id(),
        });
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
        self.frees.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded caller contract; the host resource refuses what it does not own.
        let r = unsafe { self.host.deallocate(s, p, bytes, a) };
        if self.lenient {
            return Ok(());
        }
        r
    }
    fn properties(&self) -> Properties {
        Properties::HOST
    }
    fn device(&self) -> Option<carve::Device> {
        None
    }
}
