//! Owned streams and events.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaEvent, CudaStream};

use super::Device;
use crate::error::{Error, Result};
use crate::stream::StreamRef;

/// A stream on a device. Cheap to clone; the stream is destroyed with its last handle.
#[derive(Clone, Debug)]
pub struct Stream {
    device: Device,
    inner: Arc<CudaStream>,
}

impl Stream {
    pub(crate) fn from_cudarc(device: Device, inner: Arc<CudaStream>) -> Self {
        Stream { device, inner }
    }

    /// The handle resources take. It borrows this `Stream`, so the stream outlives it:
    ///
    /// ```compile_fail
    /// # fn f(dev: &carve::Device) -> carve::Result<()> {
    /// let stream = dev.new_stream()?;
    /// let r = stream.as_ref();
    /// drop(stream); // error: `stream` is still borrowed by `r`
    /// let _ = r.as_raw();
    /// # Ok(()) }
    /// ```
    pub fn as_ref(&self) -> StreamRef<'_> {
        // SAFETY: the handle borrows `self`, which keeps the stream alive.
        unsafe { StreamRef::from_raw(self.inner.cu_stream()) }
    }

    /// The device this stream runs on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The cudarc stream, for launching cudarc kernels.
    pub fn cudarc(&self) -> &Arc<CudaStream> {
        &self.inner
    }

    /// Blocks until all work queued on this stream is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .synchronize()
            .map_err(|e| Error::driver("cuStreamSynchronize", e))
    }

    /// Makes this stream wait for the work queued so far on `other`.
    pub fn wait_for(&self, other: &Stream) -> Result<()> {
        self.inner
            .join(&other.inner)
            .map_err(|e| Error::driver("cuStreamWaitEvent", e))
    }
}

/// A CUDA event on one device.
#[derive(Debug)]
pub struct Event {
    inner: CudaEvent,
}

impl Event {
    /// A new event. `timing` enables [`Event::elapsed_ms`]; without it, recording is cheaper.
    pub fn new(device: &Device, timing: bool) -> Result<Event> {
        let flags = if timing {
            sys::CUevent_flags::CU_EVENT_DEFAULT
        } else {
            sys::CUevent_flags::CU_EVENT_DISABLE_TIMING
        };
        let inner = device
            .context()
            .new_event(Some(flags))
            .map_err(|e| Error::driver("cuEventCreate", e))?;
        Ok(Event { inner })
    }

    /// Captures the work queued on `stream` so far, in this event's context (made current on
    /// the calling thread; a special stream is that context's).
    ///
    /// `stream` must belong to this event's device (the driver rejects others); a simulated
    /// stream is refused with [`Error::InvalidArgument`].
    pub fn record(&self, stream: StreamRef<'_>) -> Result<()> {
        let raw = stream.driver_handle("cuEventRecord")?;
        self.inner
            .context()
            .bind_to_thread()
            .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
        // SAFETY: the event is live; `StreamRef`'s contract keeps the stream valid.
        unsafe { result::event::record(self.inner.cu_event(), raw) }
            .map_err(|e| Error::driver("cuEventRecord", e))
    }

    /// True once the captured work is done.
    pub fn is_complete(&self) -> Result<bool> {
        self.inner
            .try_is_complete()
            .map_err(|e| Error::driver("cuEventQuery", e))
    }

    /// Blocks until the captured work is done.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .synchronize()
            .map_err(|e| Error::driver("cuEventSynchronize", e))
    }

    /// Makes `stream` wait for the captured work (`stream` may belong to another device). A
    /// special stream ([`StreamRef::DEFAULT`], [`StreamRef::PER_THREAD`]) is the one of the
    /// calling thread's current context (of this event's context when none is current); a
    /// simulated stream is refused with [`Error::InvalidArgument`].
    pub fn wait_on(&self, stream: StreamRef<'_>) -> Result<()> {
        let raw = stream.driver_handle("cuStreamWaitEvent")?;
        let current =
            result::ctx::get_current().map_err(|e| Error::driver("cuCtxGetCurrent", e))?;
        if !stream.is_special() || current.is_none() {
            self.inner
                .context()
                .bind_to_thread()
                .map_err(|e| Error::driver("cuCtxSetCurrent", e))?;
        }
        // SAFETY: both handles are live (the stream by `StreamRef`'s contract); the driver
        // accepts an event of another context.
        unsafe {
            result::stream::wait_event(
                raw,
                self.inner.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| Error::driver("cuStreamWaitEvent", e))
    }

    /// Milliseconds between `self` and `end` (both recorded with timing enabled).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        self.inner
            .elapsed_ms(&end.inner)
            .map_err(|e| Error::driver("cuEventElapsedTime", e))
    }
}
