//! Borrowed views of CUDA streams, and plain stream identities, usable without a driver.
//!
//! Resources take a [`StreamRef`] (like RMM's `cuda_stream_view`): a copyable handle that says
//! which stream's order an allocation or free belongs to, and that borrows the stream it names,
//! so safe code cannot hand the driver a destroyed stream. Bookkeeping that outlives a call
//! (pool free lists, logs, event maps) keeps a [`StreamId`], which names a stream but can never
//! be passed to the driver. The owned stream type, which needs the driver, is
//! [`crate::driver::Stream`].

use std::marker::PhantomData;

use cudarc::driver::sys::CUstream;

/// A copyable handle naming a CUDA stream (or the legacy default stream, null), valid for `'a`.
///
/// [`Stream::as_ref`](crate::driver::Stream::as_ref) borrows a live stream; the special streams
/// ([`DEFAULT`](StreamRef::DEFAULT), [`PER_THREAD`](StreamRef::PER_THREAD)) and
/// [`simulated`](StreamRef::simulated) ones are `StreamRef<'static>`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamRef<'a> {
    raw: usize,
    _stream: PhantomData<&'a ()>,
}

/// The identity of a stream, for maps and logs: it never reaches the driver, so it may outlive
/// the stream it names. (A new stream that the driver gives a destroyed one's handle has the
/// same id.)
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(usize);

impl StreamId {
    /// The legacy default stream's id.
    pub const DEFAULT: StreamId = StreamId(0);

    /// The raw handle value as an integer.
    pub const fn get(self) -> usize {
        self.0
    }

    /// An id from an integer (for ids read back from logs or tables).
    pub const fn from_usize(raw: usize) -> StreamId {
        StreamId(raw)
    }
}

impl std::fmt::Debug for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamId({:#x})", self.0)
    }
}

impl std::fmt::LowerHex for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::LowerHex::fmt(&self.0, f)
    }
}

impl StreamRef<'static> {
    /// The legacy default stream (`0`).
    pub const DEFAULT: StreamRef<'static> = StreamRef::from_bits(0);
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`).
    pub const PER_THREAD: StreamRef<'static> = StreamRef::from_bits(0x2);

    /// A stand-in stream for resources that never call the driver (host memory, simulated
    /// memory), so that multi-stream logic is testable without a GPU. Ids are offset so they
    /// never equal [`StreamRef::DEFAULT`] or [`StreamRef::PER_THREAD`].
    ///
    /// Passing one to a resource that calls the driver is an error the driver reports, never
    /// undefined behaviour on carve's side, but it is a bug: do not.
    pub const fn simulated(id: usize) -> StreamRef<'static> {
        StreamRef::from_bits((id << 4) | 0x8)
    }
}

impl<'a> StreamRef<'a> {
    const fn from_bits(raw: usize) -> StreamRef<'a> {
        StreamRef {
            raw,
            _stream: PhantomData,
        }
    }

    /// Wraps a raw driver stream.
    ///
    /// # Safety
    /// `raw` must be null, a special stream constant, or a stream that stays valid for `'a`.
    pub unsafe fn from_raw(raw: CUstream) -> StreamRef<'a> {
        StreamRef::from_bits(raw as usize)
    }

    /// The raw driver handle.
    pub fn as_raw(self) -> CUstream {
        self.raw as CUstream
    }

    /// The stream's identity, for bookkeeping that outlives this handle.
    pub fn id(self) -> StreamId {
        StreamId(self.raw)
    }

    /// True for the legacy default stream.
    pub fn is_default(self) -> bool {
        self.raw == 0
    }
}

impl Default for StreamRef<'static> {
    fn default() -> Self {
        StreamRef::DEFAULT
    }
}

impl std::fmt::Debug for StreamRef<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "StreamRef({:#x})", self.raw)
    }
}

impl From<StreamRef<'_>> for StreamId {
    fn from(s: StreamRef<'_>) -> StreamId {
        s.id()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_streams_and_special_streams_are_distinct() {
        assert_eq!(StreamRef::DEFAULT.id(), StreamId::DEFAULT);
        assert!(StreamRef::DEFAULT.is_default());
        assert_ne!(StreamRef::simulated(0).id(), StreamRef::DEFAULT.id());
        assert_ne!(StreamRef::simulated(0).id(), StreamRef::PER_THREAD.id());
        assert_eq!(StreamRef::simulated(3).id(), StreamRef::simulated(3).id());
        assert_eq!(
            StreamId::from_usize(StreamRef::simulated(5).id().get()),
            StreamRef::simulated(5).id()
        );
    }
}
