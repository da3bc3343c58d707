//! [`Gate`]: holds a stream back until the test opens it, so that work queued behind it is
//! still pending when the host goes on. A missing stream-ordering wait then shows as corrupted
//! data instead of passing by luck.

use std::ffi::c_void;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cudarc::driver::sys;

use crate::driver::{Device, Stream};
use crate::error::{Error, Result};
use crate::stream::StreamRef;
use crate::sync::lock;

/// The longest a gate holds its stream, so that a test that forgets to open it, or panics
/// before it does, cannot hang the process.
pub const GATE_LIMIT: Duration = Duration::from_secs(30);

type Latch = (Mutex<bool>, Condvar);

/// A host function queued on a stream that blocks until [`open`](Gate::open) (or drop).
#[derive(Debug)]
pub struct Gate {
    latch: Arc<Latch>,
}

impl Gate {
    /// Queues the gate on `stream`: work queued on it afterwards waits for [`open`](Self::open).
    pub fn hold(stream: &Stream) -> Result<Gate> {
        Self::hold_raw(stream.device(), stream.as_ref())
    }

    /// Queues the gate on `stream` in `device`'s context, made current on the calling thread:
    /// for [`StreamRef::PER_THREAD`], the calling thread's per-thread stream there.
    pub fn hold_raw(device: &Device, stream: StreamRef<'_>) -> Result<Gate> {
        let raw = stream.driver_handle("Gate::hold")?;
        device.bind()?;
        let latch: Arc<Latch> = Arc::new((Mutex::new(false), Condvar::new()));
        let arg = Arc::into_raw(latch.clone()) as *mut c_void;
        // SAFETY: `wait` takes back the reference `arg` holds exactly once, when the driver
        // runs it; the stream is live while `stream` is borrowed.
        let r = unsafe { sys::cuLaunchHostFunc(raw, Some(wait), arg) };
        if let Err(e) = r.result() {
            // SAFETY: the driver refused the function, so it never runs: reclaim its reference.
            drop(unsafe { Arc::from_raw(arg as *const Latch) });
            return Err(Error::driver("cuLaunchHostFunc", e));
        }
        Ok(Gate { latch })
    }

    /// Lets the stream go on.
    pub fn open(&self) {
        let (open, cv) = &*self.latch;
        *lock(open) = true;
        cv.notify_all();
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
    }
}

extern "C" fn wait(arg: *mut c_void) {
    // SAFETY: `arg` is the reference `Gate::hold` leaked for this call.
    let latch = unsafe { Arc::from_raw(arg as *const Latch) };
    let (open, cv) = &*latch;
    let guard = lock(open);
    // A poisoned or timed-out wait lets the stream go on: never unwind into the driver.
    let _ = cv.wait_timeout_while(guard, GATE_LIMIT, |open| !*open);
}
