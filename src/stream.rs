//! A borrowed view of a CUDA stream, usable without a driver.
//!
//! Resources take a [`StreamRef`] (like RMM's `cuda_stream_view`): a copyable raw handle that
//! says which stream's order an allocation or free belongs to. The owned stream type, which
//! needs the driver, is [`crate::driver::Stream`].

use cudarc::driver::sys::CUstream;

/// A copyable handle naming a CUDA stream (or the legacy default stream, null).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamRef(usize);

impl StreamRef {
    /// The legacy default stream (`0`).
    pub const DEFAULT: StreamRef = StreamRef(0);
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub const PER_THREAD: StreamRef = StreamRef(0x2);

    /// Wraps a raw driver stream.
    ///
    /// # Safety
    /// `raw` must be null, a special stream constant, or a stream that stays valid for as long as
    /// this handle is passed to any resource that hands it to the driver.
    pub unsafe fn from_raw(raw: CUstream) -> StreamRef {
        StreamRef(raw as usize)
    }

    /// A stand-in stream for resources that never call the driver (host memory, simulated
    /// memory), so that multi-stream logic is testable without a GPU. Ids are offset so they
    /// never equal [`StreamRef::DEFAULT`] or [`StreamRef::PER_THREAD`].
    ///
    /// Passing one to a resource that calls the driver is an error the driver reports, never
    /// undefined behaviour on carve's side, but it is a bug: do not.
    pub const fn simulated(id: usize) -> StreamRef {
        StreamRef((id << 4) | 0x8)
    }

    /// The raw driver handle.
    pub fn as_raw(self) -> CUstream {
        self.0 as CUstream
    }

    /// A stable integer identity for maps and logs.
    pub fn id(self) -> usize {
        self.0
    }

    /// True for the legacy default stream.
    pub fn is_default(self) -> bool {
        self.0 == 0
    }
}

impl Default for StreamRef {
    fn default() -> Self {
        StreamRef::DEFAULT
    }
}

impl std::fmt::Debug for StreamRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamRef({:#x})", self.0)
    }
}
