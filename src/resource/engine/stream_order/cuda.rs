//! [`CudaOrder`]: ordering between streams with CUDA events.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::{result, sys};

use super::StreamOrder;
use crate::driver::{Device, Event};
use crate::error::{Error, Result};
use crate::stream::{special_stream_contexts, StreamId, StreamRef};
use crate::sync::lock;

/// Device ordering: one event per stream, recorded by [`mark`](StreamOrder::mark) while the
/// stream is in use and waited on with `cuStreamWaitEvent` (the wait captures the record at call
/// time, so re-recording later is safe). Events belong to this object, so a wait never touches
/// the signalling stream.
///
/// The legacy and per-thread default streams are streams of the calling thread's current
/// context (of the calling thread, for the per-thread one), and their ids say which
/// ([`StreamRef::id`]): their events are made in that context, and waits and synchronisations
/// on them run there. A device-wide synchronisation covers every device whose primary context
/// such a stream was used in, since a block freed on one may be handed to any stream. Calls
/// leave the caller's current context as they found it.
#[derive(Debug)]
pub struct CudaOrder {
    device: Device,
    events: Mutex<HashMap<StreamId, Event>>,
}

impl CudaOrder {
    /// Ordering for streams of `device`.
    pub fn new(device: &Device) -> Self {
        CudaOrder {
            device: device.clone(),
            events: Mutex::new(HashMap::new()),
        }
    }

    /// Makes current the context a call on `stream` runs in, and returns its device: this
    /// order's own for a real stream; for a special stream, the device of the current context
    /// (this order's own when none is current).
    fn enter(&self, stream: StreamRef<'_>) -> Result<Device> {
        let current =
            result::ctx::get_current().map_err(|e| Error::driver("cuCtxGetCurrent", e))?;
        match current {
            Some(ctx) if stream.is_special() => {
                let dev = Device::current()?;
                if dev.context().cu_ctx() != ctx {
                    return Err(Error::Unsupported(format!(
                        "CudaOrder: {stream:?} in a CUDA context that is not a device's primary \
                         context"
                    )));
                }
                Ok(dev)
            }
            _ => {
                self.device.bind()?;
                Ok(self.device.clone())
            }
        }
    }
}

/// Puts the caller's current context back when dropped, so that binding a device for a call
/// does not change which streams the caller's special handles name.
struct RestoreContext(Option<sys::CUcontext>);

impl RestoreContext {
    fn save() -> Self {
        RestoreContext(result::ctx::get_current().ok().flatten())
    }
}

impl Drop for RestoreContext {
    fn drop(&mut self) {
        let Some(ctx) = self.0 else { return };
        if result::ctx::get_current().ok().flatten() != Some(ctx) {
            // SAFETY: `ctx` was current on this thread when the call began, and a context that
            // is current cannot be destroyed by another thread while the call runs.
            let _ = unsafe { result::ctx::set_current(ctx) };
        }
    }
}

impl StreamOrder for CudaOrder {
    fn mark(&self, stream: StreamRef<'_>) -> Result<()> {
        stream.driver_handle("CudaOrder::mark")?;
        let _restore = RestoreContext::save();
        let dev = self.enter(stream)?;
        let mut events = lock(&self.events);
        let event = match events.entry(stream.id()) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(v) => v.insert(Event::new(&dev, false)?),
        };
        // `record` makes the event's context current: the one the stream's id names.
        event.record(stream)
    }

    fn wait_for_mark(&self, waiter: StreamRef<'_>, signaller: StreamId) -> Result<()> {
        waiter.driver_handle("CudaOrder::wait_for_mark")?;
        let _restore = RestoreContext::save();
        self.enter(waiter)?;
        if waiter.id() == signaller {
            return Ok(());
        }
        let events = lock(&self.events);
        match events.get(&signaller) {
            // A special waiter is waited on in its own (current) context.
            Some(e) => e.wait_on(waiter),
            None => {
                drop(events);
                self.synchronize_all()
            }
        }
    }

    fn mark_complete(&self, signaller: StreamId) -> Result<bool> {
        let events = lock(&self.events);
        match events.get(&signaller) {
            Some(e) => e.is_complete(),
            None => Ok(false),
        }
    }

    fn synchronize_all(&self) -> Result<()> {
        let _restore = RestoreContext::save();
        self.device.synchronize()?;
        let own = self.device.context().cu_ctx() as usize;
        for (ctx, ordinal) in special_stream_contexts() {
            if ctx == own {
                continue;
            }
            // Only primary contexts: carve retains them, so they are never destroyed under it.
            let dev = Device::get(ordinal)?;
            if dev.context().cu_ctx() as usize == ctx {
                dev.synchronize()?;
            }
        }
        Ok(())
    }

    fn synchronize(&self, stream: StreamRef<'_>) -> Result<()> {
        let raw = stream.driver_handle("CudaOrder::synchronize")?;
        let _restore = RestoreContext::save();
        self.enter(stream)?;
        // SAFETY: the caller is using `stream`, so `StreamRef`'s contract keeps it valid.
        unsafe { result::stream::synchronize(raw) }
            .map_err(|e| Error::driver("cuStreamSynchronize", e))
    }
}
