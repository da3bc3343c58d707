//! What the suballocators need from streams and events, behind a trait, so their stream logic
//! runs (and is tested) without a GPU.
//!
//! A block freed on stream A is reused on A at once. Handing it to stream B needs B to wait for
//! A's work up to that free. The suballocators never record anything on a free; they call
//! [`StreamOrder::order_after`] only when one stream takes free memory from another, and then
//! take *all* of that stream's free blocks, so one wait covers many frees.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::result;

use super::MemoryResource;
use crate::driver::{Device, Event};
use crate::error::{Error, Result};
use crate::stream::StreamRef;

/// Orders work between streams on behalf of a suballocator.
pub trait StreamOrder: Send + Sync + fmt::Debug {
    /// Makes work queued on `waiter` from now on wait for all work queued so far on
    /// `signaller`. A no-op when they are the same stream.
    fn order_after(&self, waiter: StreamRef, signaller: StreamRef) -> Result<()>;

    /// Blocks the calling thread until the work queued so far on `stream` is done.
    fn synchronize(&self, stream: StreamRef) -> Result<()>;
}

/// Ordering for memory that no device work touches (host memory, simulated streams): there is
/// never anything to wait for.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostOrder;

impl StreamOrder for HostOrder {
    fn order_after(&self, _waiter: StreamRef, _signaller: StreamRef) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self, _stream: StreamRef) -> Result<()> {
        Ok(())
    }
}

/// Host ordering that logs every request, so tests can check when a suballocator orders streams
/// (and that it does not on plain frees).
#[derive(Debug, Default)]
pub struct RecordingOrder {
    log: Mutex<Vec<OrderEvent>>,
}

/// One request seen by [`RecordingOrder`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OrderEvent {
    /// `order_after(waiter, signaller)` with distinct streams.
    Wait {
        waiter: StreamRef,
        signaller: StreamRef,
    },
    /// `synchronize(stream)`.
    Sync(StreamRef),
}

impl RecordingOrder {
    /// An empty log.
    pub fn new() -> Self {
        Self::default()
    }

    /// Everything requested so far.
    pub fn events(&self) -> Vec<OrderEvent> {
        self.log
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl StreamOrder for RecordingOrder {
    fn order_after(&self, waiter: StreamRef, signaller: StreamRef) -> Result<()> {
        if waiter != signaller {
            let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
            log.push(OrderEvent::Wait { waiter, signaller });
        }
        Ok(())
    }
    fn synchronize(&self, stream: StreamRef) -> Result<()> {
        let mut log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        log.push(OrderEvent::Sync(stream));
        Ok(())
    }
}

/// Device ordering: one reusable event, recorded on the signalling stream and waited on by the
/// other (`cuEventRecord` + `cuStreamWaitEvent`; the wait captures the record at call time, so
/// one event serves every request).
#[derive(Debug)]
pub struct CudaOrder {
    device: Device,
    event: Mutex<Option<Event>>,
}

impl CudaOrder {
    /// Ordering for streams of `device`.
    pub fn new(device: &Device) -> Self {
        CudaOrder {
            device: device.clone(),
            event: Mutex::new(None),
        }
    }
}

impl StreamOrder for CudaOrder {
    fn order_after(&self, waiter: StreamRef, signaller: StreamRef) -> Result<()> {
        if waiter == signaller {
            return Ok(());
        }
        self.device.bind()?;
        let mut slot = self.event.lock().unwrap_or_else(PoisonError::into_inner);
        let event = match slot.as_mut() {
            Some(e) => e,
            None => slot.insert(Event::new(&self.device, false)?),
        };
        event.record(signaller)?;
        event.wait_on(waiter)
    }

    fn synchronize(&self, stream: StreamRef) -> Result<()> {
        self.device.bind()?;
        // SAFETY: `StreamRef`'s contract keeps the stream valid while it is passed to us.
        unsafe { result::stream::synchronize(stream.as_raw()) }
            .map_err(|e| Error::driver("cuStreamSynchronize", e))
    }
}

/// The ordering a suballocator over `upstream` needs: none for host memory, events for memory
/// that kernels touch (on the device current on this thread).
pub(crate) fn default_order<R: MemoryResource + ?Sized>(
    upstream: &R,
) -> Result<Arc<dyn StreamOrder>> {
    if upstream.properties().device_accessible {
        Ok(Arc::new(CudaOrder::new(&Device::current()?)))
    } else {
        Ok(Arc::new(HostOrder))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recording_order_logs_only_cross_stream_waits() {
        let o = RecordingOrder::new();
        let (a, b) = (StreamRef::simulated(1), StreamRef::simulated(2));
        o.order_after(a, a).unwrap();
        o.order_after(a, b).unwrap();
        o.synchronize(b).unwrap();
        assert_eq!(
            o.events(),
            vec![
                OrderEvent::Wait {
                    waiter: a,
                    signaller: b
                },
                OrderEvent::Sync(b)
            ]
        );
    }
}
