//! Stream capture (CUDA graphs): whether a stream is being captured, and a scope in which the
//! calling thread may make synchronous allocator calls without invalidating a capture.

use std::cell::Cell;

use cudarc::driver::sys;

use crate::error::{Error, Result};
use crate::stream::StreamRef;

thread_local! {
    static RELAXED: Cell<bool> = const { Cell::new(false) };
}

/// The id of the capture `stream` takes part in (`cuStreamGetCaptureInfo`), or `None` when it
/// is not being captured. `None` without a driver; [`Error::InvalidArgument`] for a
/// [`simulated`](StreamRef::simulated) stream, driver or not.
pub fn capture_id(stream: StreamRef<'_>) -> Result<Option<u64>> {
    let raw = stream.driver_handle("cuStreamGetCaptureInfo")?;
    if super::init().is_err() {
        return Ok(None);
    }
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    // SAFETY: a query of a stream the caller vouches for (`StreamRef`'s contract); the optional
    // graph and dependency outputs are null, which the driver accepts.
    let rc = unsafe {
        sys::cuStreamGetCaptureInfo_v2(
            raw,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    match rc {
        sys::CUresult::CUDA_SUCCESS => {}
        // The legacy stream while another stream captures in global mode: that capture
        // forbids using it, so treat it as captured (no id of its own).
        sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT => return Ok(Some(0)),
        // A special stream of a thread with no current context: it has no capture (the
        // resource binds its device before any call that could join one).
        sys::CUresult::CUDA_ERROR_INVALID_CONTEXT if stream.is_special() => return Ok(None),
        code => {
            return Err(Error::Driver {
                call: "cuStreamGetCaptureInfo_v2",
                code: crate::error::DriverCode(code),
            })
        }
    }
    Ok(match status {
        sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE => None,
        _ => Some(id),
    })
}

/// True inside [`relaxed`] on this thread: allocator calls here are made on purpose while a
/// capture may run, and must not refuse.
pub fn in_relaxed_scope() -> bool {
    RELAXED.with(Cell::get)
}

/// Runs `f` with the calling thread's stream-capture mode relaxed
/// (`cuThreadExchangeStreamCaptureMode`), so synchronous calls such as `cuMemAlloc` do not
/// invalidate a capture in progress, as PyTorch does around its graph pools' allocations.
/// Before carve has initialised the driver ([`crate::driver::init`]) it runs `f` as it is.
pub fn relaxed<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(Option<sys::CUstreamCaptureMode>, bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            RELAXED.with(|r| r.set(self.1));
            if let Some(mut mode) = self.0 {
                // SAFETY: puts back the mode exchanged below, on the same thread.
                let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
            }
        }
    }
    // A driver that carve never initialised has no capture of carve's streams to protect.
    let previous = super::driver_initialised().then_some(()).and_then(|()| {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's capture mode; the old one is restored on drop.
        let rc = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(mode)
    });
    let _restore = Restore(previous, RELAXED.with(|r| r.replace(true)));
    f()
}

/// True when the calling thread's capture mode is relaxed (set by [`relaxed`], or by the
/// caller's own `cuThreadExchangeStreamCaptureMode`, as PyTorch does around its allocator).
fn thread_mode_is_relaxed() -> bool {
    let relaxed = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    let mut mode = relaxed;
    // SAFETY: exchanges this thread's mode, then puts the old one back at once.
    unsafe {
        if sys::cuThreadExchangeStreamCaptureMode(&mut mode) != sys::CUresult::CUDA_SUCCESS {
            return false;
        }
        let previous = mode;
        let _ = sys::cuThreadExchangeStreamCaptureMode(&mut mode);
        previous == relaxed
    }
}

/// [`Error::StreamCapture`] when `stream` is being captured and the calling thread has not
/// relaxed its capture mode: for resources whose synchronous calls would then invalidate the
/// capture. (In relaxed mode the driver allows them, and the caller takes care of addresses.)
pub(crate) fn refuse_capture(resource: &'static str, stream: StreamRef<'_>) -> Result<()> {
    if in_relaxed_scope() {
        return Ok(());
    }
    match capture_id(stream)? {
        None => Ok(()),
        Some(_) if thread_mode_is_relaxed() => Ok(()),
        Some(id) => Err(Error::StreamCapture {
            resource,
            detail: format!(
                "stream {stream:?} is in capture {id}; allocate from a GraphSafeMemoryResource"
            ),
        }),
    }
}
