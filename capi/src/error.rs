//! Error codes, the thread-local last-error string, and the panic guard every C function uses.

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// The codes C functions return (`CARVE_OK`, `CARVE_ERROR_*` in `carve.h`).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Code {
    /// Success.
    Ok = 0,
    /// A null, destroyed or forged resource handle.
    InvalidHandle = 1,
    /// A bad size, alignment, null output pointer, string or option.
    InvalidArgument = 2,
    /// The resource could not satisfy the request.
    OutOfMemory = 3,
    /// No CUDA driver, no device, or a device ordinal out of range.
    NoDevice = 4,
    /// A CUDA driver call failed.
    Driver = 5,
    /// A pointer the resource does not own, a double free, or a size mismatch.
    BadPointer = 6,
    /// The operation is not available for this resource.
    Unsupported = 7,
    /// A file could not be written (logging adaptor).
    Io = 8,
    /// carve panicked; the panic was caught at the boundary and nothing unwound into C.
    Panic = 9,
}

impl Code {
    /// The `CARVE_ERROR_*` name of a code, or `"CARVE_ERROR_UNKNOWN"`.
    pub fn name(code: c_int) -> &'static CStr {
        match code {
            0 => c"CARVE_OK",
            1 => c"CARVE_ERROR_INVALID_HANDLE",
            2 => c"CARVE_ERROR_INVALID_ARGUMENT",
            3 => c"CARVE_ERROR_OUT_OF_MEMORY",
            4 => c"CARVE_ERROR_NO_DEVICE",
            5 => c"CARVE_ERROR_DRIVER",
            6 => c"CARVE_ERROR_BAD_POINTER",
            7 => c"CARVE_ERROR_UNSUPPORTED",
            8 => c"CARVE_ERROR_IO",
            9 => c"CARVE_ERROR_PANIC",
            _ => c"CARVE_ERROR_UNKNOWN",
        }
    }
}

/// A failure at the boundary: a code and carve's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FfiError {
    /// What kind of failure.
    pub code: Code,
    /// The message `carve_last_error` returns.
    pub message: String,
}

impl FfiError {
    /// An error with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        FfiError {
            code,
            message: message.into(),
        }
    }

    /// A bad argument.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }
}

impl std::fmt::Display for FfiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for FfiError {}

impl From<carve::Error> for FfiError {
    fn from(e: carve::Error) -> Self {
        use carve::Error as E;
        let code = match &e {
            _ if e.is_out_of_memory() => Code::OutOfMemory,
            E::NoDriver(_) | E::NoDevice | E::InvalidDevice { .. } => Code::NoDevice,
            E::Driver { .. } | E::Link { .. } => Code::Driver,
            E::ZeroSize
            | E::InvalidAlignment(_)
            | E::SizeOverflow { .. }
            | E::InvalidArgument(_)
            | E::MalformedLog { .. } => Code::InvalidArgument,
            E::UnknownPointer { .. }
            | E::DoubleFree { .. }
            | E::SizeMismatch { .. }
            | E::NotManaged { .. } => Code::BadPointer,
            E::Unsupported(_) => Code::Unsupported,
            E::Io(_) => Code::Io,
            _ => Code::Unsupported,
        };
        FfiError::new(code, e.to_string())
    }
}

/// Result alias at the boundary.
pub type FfiResult<T> = Result<T, FfiError>;

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
}

/// Records `e` as this thread's last error.
pub fn set_last_error(e: &FfiError) {
    // Interior NULs cannot cross into C; replace them rather than lose the message.
    let text = CString::new(e.message.replace('\0', " ")).unwrap_or_default();
    // During thread exit (a C thread-exit hook or another thread-local's destructor calling
    // carve) the slot may be gone: the error code still reports the failure.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = Some(text));
}

/// This thread's last error message (empty when none). The pointer stays valid until the next
/// failing carve call on this thread.
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| match &*l.borrow() {
            Some(s) => s.as_ptr(),
            None => c"".as_ptr(),
        })
        .unwrap_or(c"".as_ptr())
}

/// This thread's last error message, as a Rust string.
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|l| {
            l.borrow()
                .as_ref()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".to_owned()
    }
}

/// Drops a panic payload. A payload's drop may itself panic: what that panic carries is
/// dropped the same way, a few times over, then leaked, so nothing unwinds.
fn drop_payload(mut payload: Box<dyn std::any::Any + Send>) {
    for _ in 0..4 {
        match catch_unwind(AssertUnwindSafe(move || drop(payload))) {
            Ok(()) => return,
            Err(again) => payload = again,
        }
    }
    std::mem::forget(payload);
}

/// Runs `f`, catching panics; on failure records the last error and returns it.
pub fn catch_error<T>(f: impl FnOnce() -> FfiResult<T>) -> Result<T, FfiError> {
    // The closure's captures are only read again after a panic through the error path, which
    // touches no state the panic could have left half-updated.
    let e = match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => return Ok(v),
        Ok(Err(e)) => e,
        Err(payload) => {
            let message = format!("carve panicked: {}", panic_message(&*payload));
            drop_payload(payload);
            FfiError::new(Code::Panic, message)
        }
    };
    set_last_error(&e);
    Err(e)
}

/// As [`catch_error`], keeping only the code.
pub fn catch<T>(f: impl FnOnce() -> FfiResult<T>) -> Result<T, Code> {
    catch_error(f).map_err(|e| e.code)
}

/// Runs `f` as the body of a C function returning an error code.
pub fn guard(f: impl FnOnce() -> FfiResult<()>) -> c_int {
    match catch(f) {
        Ok(()) => Code::Ok as c_int,
        Err(code) => code as c_int,
    }
}
