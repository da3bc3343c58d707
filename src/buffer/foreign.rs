//! Work that cudarc queues on a buffer from other streams (through `DevicePtr`/`DevicePtrMut`),
//! ordered before the buffer's free and its own stream's later work: an event per foreign
//! stream, recorded by cudarc when the use ends, as cudarc's own `CudaSlice` does.

use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use cudarc::driver::{sys, CudaEvent, CudaStream, SyncOnDrop};

use crate::error::{Error, Result};
use crate::sync::lock;

/// The per-thread default stream's handle: one handle, a different stream on every thread.
const PER_THREAD: sys::CUstream = 0x2 as sys::CUstream;

/// A stream as the driver runs it: the handle in its context, and the thread for the
/// per-thread default stream.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Key {
    ctx: usize,
    stream: usize,
    thread: Option<ThreadId>,
}

impl Key {
    fn of(stream: &CudaStream) -> Key {
        let raw = stream.cu_stream();
        Key {
            ctx: stream.context().cu_ctx() as usize,
            stream: raw as usize,
            thread: (raw == PER_THREAD).then(|| std::thread::current().id()),
        }
    }
}

struct Entry {
    key: Key,
    /// Recorded on the foreign stream when each use ends; re-recording on the same stream
    /// covers every earlier use there, so one event a stream suffices.
    event: Arc<CudaEvent>,
    /// Some use on that stream wrote: readers must wait for it too.
    wrote: bool,
}

/// The foreign streams that used a buffer since its own stream last waited for them.
///
/// Entries are added through `&self` and removed only through `&mut self`, so an event handed
/// to cudarc for the length of a `&self` borrow stays alive for that borrow.
#[derive(Default)]
pub(crate) struct ForeignUses {
    entries: Mutex<Vec<Entry>>,
}

impl ForeignUses {
    /// A read of the buffer on `stream`, whose own stream is `own`: `stream` waits for `own`
    /// and for foreign writes; the returned guard records `stream`'s event when the read ends.
    pub(crate) fn read<'a>(&'a self, own: &CudaStream, stream: &'a CudaStream) -> SyncOnDrop<'a> {
        let mut entries = lock(&self.entries);
        if *own == *stream {
            for e in entries.iter().filter(|e| e.wrote) {
                wait_or_block(own, &e.event);
            }
            return SyncOnDrop::Sync(None);
        }
        let key = Key::of(stream);
        join_or_block(stream, own);
        for e in entries.iter().filter(|e| e.wrote && e.key != key) {
            wait_or_block(stream, &e.event);
        }
        Self::record_on(&mut entries, key, stream, false)
    }

    /// A write of the buffer on `stream`: as [`read`](Self::read), but after every earlier use.
    pub(crate) fn write<'a>(
        &'a mut self,
        own: &CudaStream,
        stream: &'a CudaStream,
    ) -> SyncOnDrop<'a> {
        let entries = self
            .entries
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        if *own == *stream {
            entries.retain(|e| !wait_or_block(own, &e.event));
            return SyncOnDrop::Sync(None);
        }
        let key = Key::of(stream);
        join_or_block(stream, own);
        for e in entries.iter().filter(|e| e.key != key) {
            wait_or_block(stream, &e.event);
        }
        Self::record_on(entries, key, stream, true)
    }

    /// Makes `own` wait for every foreign use (before a free, or a write on `own`). Uses whose
    /// wait failed stay, so that a retry waits for them again.
    pub(crate) fn settle(&mut self, own: &CudaStream) -> Result<()> {
        let entries = self
            .entries
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner);
        let mut first = Ok(());
        entries.retain(|e| match own.wait(&e.event) {
            Ok(()) => false,
            Err(err) => {
                if first.is_ok() {
                    first = Err(Error::driver("cuStreamWaitEvent", err));
                }
                true
            }
        });
        first
    }

    /// Makes `own` wait for foreign writes (before a read on `own`).
    pub(crate) fn settle_writes(&self, own: &CudaStream) -> Result<()> {
        let entries = lock(&self.entries);
        for e in entries.iter().filter(|e| e.wrote) {
            own.wait(&e.event)
                .map_err(|err| Error::driver("cuStreamWaitEvent", err))?;
        }
        Ok(())
    }

    /// The guard that records `stream`'s event when the use ends. Where cudarc would not record
    /// it (a context that does not manage stream synchronisation) or no event can be made, the
    /// guard synchronises `stream` instead.
    fn record_on<'a>(
        entries: &mut Vec<Entry>,
        key: Key,
        stream: &'a CudaStream,
        write: bool,
    ) -> SyncOnDrop<'a> {
        if !stream.context().is_managing_stream_synchronization() {
            return SyncOnDrop::Sync(Some(stream));
        }
        let i = match entries.iter().position(|e| e.key == key) {
            Some(i) => i,
            None => match stream.context().new_event(None) {
                Ok(event) => {
                    entries.push(Entry {
                        key,
                        event: Arc::new(event),
                        wrote: false,
                    });
                    entries.len() - 1
                }
                Err(e) => {
                    stream.context().record_err::<()>(Err(e));
                    return SyncOnDrop::Sync(Some(stream));
                }
            },
        };
        entries[i].wrote |= write;
        // SAFETY: the event lives in an `Arc` that its entry holds; entries leave only through
        // `&mut self`, which cannot coexist with the `'a` borrow the caller holds of `self`.
        let event: &'a CudaEvent = unsafe { &*Arc::as_ptr(&entries[i].event) };
        SyncOnDrop::Record(Some((event, stream)))
    }
}

/// `waiter` waits for `event`; if the driver refuses, the host waits for it instead. Errors go
/// to the context's slot, cudarc's convention where nothing can return them. True once either
/// wait succeeded.
fn wait_or_block(waiter: &CudaStream, event: &CudaEvent) -> bool {
    let Err(e) = waiter.wait(event) else {
        return true;
    };
    // Binding (in `synchronize`) takes the context's recorded error: record after it.
    let blocked = event.synchronize();
    let ok = blocked.is_ok();
    let ctx = waiter.context();
    ctx.record_err::<()>(Err(e));
    ctx.record_err(blocked);
    ok
}

/// `waiter` waits for the work queued so far on `other`, or the host does (see
/// [`wait_or_block`]).
fn join_or_block(waiter: &CudaStream, other: &CudaStream) {
    if let Err(e) = waiter.join(other) {
        let blocked = other.synchronize();
        let ctx = waiter.context();
        ctx.record_err::<()>(Err(e));
        ctx.record_err(blocked);
    }
}
