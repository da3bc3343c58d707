//! carve's one error type. Every fallible public API returns [`Result`].

use std::fmt;

/// Result alias used across carve.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a carve call failed. Variants carry enough context to act on without a debugger.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The CUDA driver library (libcuda) could not be loaded on this machine.
    #[error("no CUDA driver found: {0}")]
    NoDriver(String),
    /// The driver loaded but reports no device.
    #[error("the CUDA driver reports no device")]
    NoDevice,
    /// A device ordinal outside `0..count`.
    #[error("device ordinal {ordinal} is out of range: {count} device(s) present")]
    InvalidDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices the driver reports.
        count: usize,
    },
    /// A driver call failed.
    #[error("{call} failed: {code}")]
    Driver {
        /// The driver entry point, e.g. `cuMemAlloc`.
        call: &'static str,
        /// What it returned.
        code: DriverCode,
    },
    /// The driver's JIT linker refused its inputs; `log` is its error (and info) log.
    #[error("{call} failed: {code}: {log}")]
    Link {
        /// The linker entry point that failed.
        call: &'static str,
        /// What it returned.
        code: DriverCode,
        /// The linker's error and info log.
        log: String,
    },
    /// A zero-byte request.
    #[error("zero-byte allocation requested")]
    ZeroSize,
    /// An alignment that is not a power of two (or is zero).
    #[error("alignment {0} is not a power of two")]
    InvalidAlignment(usize),
    /// Size and alignment overflow the address space once rounded.
    #[error("a request of {bytes} bytes aligned to {align} overflows the address space")]
    SizeOverflow {
        /// The size asked for.
        bytes: usize,
        /// The alignment asked for.
        align: usize,
    },
    /// The resource could not satisfy the request.
    #[error("out of memory: {bytes} bytes requested from {resource}: {detail}")]
    OutOfMemory {
        /// The size asked for.
        bytes: usize,
        /// The resource that refused.
        resource: &'static str,
        /// Why: the driver's code, a limit, the pool's state.
        detail: String,
    },
    /// A pointer this resource never handed out (or that was already freed).
    #[error("{resource} does not own pointer {ptr:#x}")]
    UnknownPointer {
        /// The resource asked to free it.
        resource: &'static str,
        /// The pointer's address.
        ptr: usize,
    },
    /// A pointer freed twice.
    #[error("{resource}: double free of pointer {ptr:#x}")]
    DoubleFree {
        /// The resource asked to free it.
        resource: &'static str,
        /// The pointer's address.
        ptr: usize,
    },
    /// Deallocation with a size or alignment other than the allocation's.
    #[error(
        "{resource}: pointer {ptr:#x} was allocated as {allocated} bytes but freed as {freed}"
    )]
    SizeMismatch {
        /// The resource asked to free it.
        resource: &'static str,
        /// The pointer's address.
        ptr: usize,
        /// The size it was allocated with.
        allocated: usize,
        /// The size the free named.
        freed: usize,
    },
    /// A managed-memory operation (prefetch, advice, range query) on memory that
    /// `cuMemAllocManaged` did not allocate.
    #[error("{ptr:#x} is not managed memory (cuMemAllocManaged)")]
    NotManaged {
        /// The address given.
        ptr: usize,
    },
    /// Any other argument a call cannot accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A resource that cannot allocate on a stream being captured into a CUDA graph was asked
    /// to (its driver calls would invalidate the capture).
    #[error("{resource} cannot allocate on a stream being captured into a CUDA graph: {detail}")]
    StreamCapture {
        /// The resource that refused.
        resource: &'static str,
        /// Which stream, in which capture, and what to use instead.
        detail: String,
    },
    /// The operation is not available on this resource, device or build.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// An allocation log (CSV) that cannot be read or replayed, with the offending line.
    #[error("line {line}: {reason}")]
    MalformedLog {
        /// 1-based line of the log.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// An I/O error (logs, CSV files).
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// A `CUresult`, printed with the driver's own name for it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct DriverCode(pub cudarc::driver::sys::CUresult);

impl fmt::Display for DriverCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl fmt::Debug for DriverCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl Error {
    /// Wraps a failed driver call, mapping the driver's out-of-memory code to [`Error::OutOfMemory`].
    pub(crate) fn driver(call: &'static str, err: cudarc::driver::DriverError) -> Self {
        Error::Driver {
            call,
            code: DriverCode(err.0),
        }
    }

    /// True for [`Error::OutOfMemory`], and for driver calls that failed for want of memory.
    pub fn is_out_of_memory(&self) -> bool {
        use cudarc::driver::sys::CUresult;
        match self {
            Error::OutOfMemory { .. } => true,
            Error::Driver { code, .. } => code.0 == CUresult::CUDA_ERROR_OUT_OF_MEMORY,
            _ => false,
        }
    }
}
