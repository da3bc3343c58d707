//! A buffer's block, and its free: ordered after the work that the buffer's consumers queued.
//!
//! Exporting a buffer (DLPack, the CUDA Array Interface) lets another library queue work on it,
//! on a stream carve records here. The free then waits for those streams, as cudarc's
//! `CudaSlice` does for its own: an event recorded on each consumer stream that the block's
//! stream waits on. A consumer stream that cannot be named at the free (unknown: the CUDA Array
//! Interface names none, DLPack's -1, a bare handle that may be destroyed; another thread's
//! per-thread stream), or a block stream that cannot, makes the free wait for the whole device
//! instead. If an ordering call fails the block is leaked, never handed out; every failure is
//! recorded (`carve.take_deferred_error()`).

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use carve::deferred;
use carve::resource::DEFAULT_ALIGNMENT;
use carve::{Device, Error, Event, StreamRef};
use carve_capi::registry::Entry;

use crate::stream::HeldStream;

/// A stream that queues work on the block outside carve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Consumer {
    /// The legacy default stream.
    Legacy,
    /// The calling thread's per-thread default stream.
    PerThread,
    /// The block's own stream: its free is ordered after it already.
    Own,
    /// A stream that cannot be named at the free.
    Unknown,
}

#[derive(Debug, Default)]
struct Users {
    legacy: bool,
    per_thread: Vec<ThreadId>,
    unknown: bool,
}

#[derive(Debug)]
pub struct Block {
    pub entry: Arc<Entry>,
    pub ptr: NonNull<u8>,
    pub size: usize,
    pub device: usize,
    /// The stream it was allocated on and is freed on (held until the free).
    pub stream: HeldStream,
    users: Mutex<Users>,
}

// SAFETY: the block is plain memory owned by this value; resources are Send + Sync, and the
// held stream object is a `Py`, which is Send + Sync.
unsafe impl Send for Block {}
// SAFETY: as above; `&Block` exposes the address and a mutex-guarded consumer list.
unsafe impl Sync for Block {}

impl Block {
    pub fn new(
        entry: Arc<Entry>,
        ptr: NonNull<u8>,
        size: usize,
        device: usize,
        stream: HeldStream,
    ) -> Block {
        Block {
            entry,
            ptr,
            size,
            device,
            stream,
            users: Mutex::new(Users::default()),
        }
    }

    /// Records that `consumer` may queue work on the block until it is freed.
    pub fn used_on(&self, consumer: Consumer) {
        let mut u = self.users.lock().unwrap_or_else(PoisonError::into_inner);
        match consumer {
            Consumer::Own => {}
            Consumer::Legacy => u.legacy = true,
            Consumer::Unknown => u.unknown = true,
            Consumer::PerThread => {
                let me = std::thread::current().id();
                if !u.per_thread.contains(&me) {
                    u.per_thread.push(me);
                }
            }
        }
    }

    /// The consumer that DLPack's `stream` argument names.
    pub fn consumer_of(&self, stream: Option<isize>) -> Consumer {
        match stream {
            None | Some(0) | Some(1) => Consumer::Legacy,
            Some(2) => Consumer::PerThread,
            Some(s) if s as usize == self.stream.raw() && self.stream.later().is_some() => {
                Consumer::Own
            }
            Some(_) => Consumer::Unknown,
        }
    }

    /// Orders the free after the consumers and frees; on failure, what failed.
    fn free(&self) -> Result<(), (&'static str, Error)> {
        let users = std::mem::take(&mut *self.users.lock().unwrap_or_else(PoisonError::into_inner));
        let here = std::thread::current().id();
        let own = self.stream.later();
        let whole_device =
            own.is_none() || users.unknown || users.per_thread.iter().any(|t| *t != here);
        let free_on = match own {
            Some(own) if !whole_device => {
                let mut waits = Vec::with_capacity(2);
                if users.legacy {
                    waits.push(StreamRef::DEFAULT);
                }
                if !users.per_thread.is_empty() {
                    waits.push(StreamRef::PER_THREAD);
                }
                waits.retain(|s| *s != own);
                if !waits.is_empty() {
                    const ORDER: &str =
                        "DeviceBuffer free: ordering it after its consumers' streams (block leaked)";
                    let dev = Device::get(self.device).map_err(|e| (ORDER, e))?;
                    dev.bind().map_err(|e| (ORDER, e))?;
                    for s in waits {
                        let ev = Event::new(&dev, false).map_err(|e| (ORDER, e))?;
                        ev.record(s).map_err(|e| (ORDER, e))?;
                        ev.wait_on(own).map_err(|e| (ORDER, e))?;
                    }
                }
                own
            }
            _ => {
                match Device::get(self.device) {
                    // No driver or no device: no work can have been queued on the block.
                    Err(Error::NoDriver(_) | Error::NoDevice) => {}
                    dev => {
                        const WAIT: &str =
                            "DeviceBuffer free: waiting for the device first (block leaked)";
                        let dev = dev.map_err(|e| (WAIT, e))?;
                        dev.bind()
                            .and_then(|()| dev.synchronize())
                            .map_err(|e| (WAIT, e))?;
                    }
                }
                own.unwrap_or(StreamRef::DEFAULT)
            }
        };
        // SAFETY: allocated from this entry with this size and alignment, freed once (here),
        // on a stream that is valid now and ordered after every consumer.
        unsafe {
            self.entry
                .resource
                .deallocate(free_on, self.ptr, self.size, DEFAULT_ALIGNMENT)
        }
        .map_err(|e| ("DeviceBuffer free", e))
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        if let Err((context, e)) = self.free() {
            deferred::record(context, Err::<(), _>(e));
        }
    }
}
