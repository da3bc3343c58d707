//! Borrowed views of CUDA streams, and plain stream identities, usable without a driver.
//!
//! Resources take a [`StreamRef`] (like RMM's `cuda_stream_view`): a copyable handle that says
//! which stream's order an allocation or free belongs to, and that borrows the stream it names,
//! so safe code cannot hand the driver a destroyed stream. Bookkeeping that outlives a call
//! (pool free lists, logs, event maps) keeps a [`StreamId`], which names a stream but can never
//! be passed to the driver. The owned stream type, which needs the driver, is
//! [`crate::driver::Stream`].
//!
//! The special handles name a different stream depending on who uses them: the per-thread
//! default stream (`CU_STREAM_PER_THREAD`) is one stream per thread and context, and the legacy
//! default stream (`0`, `CU_STREAM_LEGACY`) one per context. [`StreamRef::id`] resolves them
//! on the calling thread, so their ids name the stream the driver would run the caller's work
//! on.

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::sync::lock;
use cudarc::driver::sys::CUstream;

/// Ids and raw values are tagged in bits 60 and 61 (the top four bits of a 64-bit value), which
/// no user-space address (a real stream handle) has set, and which keep every value below
/// 2^62, so that formats with signed 64-bit integers (memory snapshots) carry it: `00` a raw
/// handle (or the legacy default stream with no context), `01` the legacy default stream of a
/// context, `10` a per-thread default stream, `11` a simulated stream. A raw value with any bit
/// from 60 up set is no driver stream (see [`StreamRef::is_simulated`]).
const TAG_SHIFT: u32 = usize::BITS - 4;
const LOW_MASK: usize = (1 << TAG_SHIFT) - 1;
const LEGACY_TAG: usize = 0b01 << TAG_SHIFT;
const PER_THREAD_TAG: usize = 0b10 << TAG_SHIFT;
const SIMULATED_TAG: usize = 0b11 << TAG_SHIFT;

/// `CU_STREAM_LEGACY`.
const RAW_LEGACY: usize = 0x1;
/// `CU_STREAM_PER_THREAD`.
const RAW_PER_THREAD: usize = 0x2;

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
///
/// A real stream's id is its handle. The per-thread default stream has one id per thread and
/// context, never reused by another thread; the legacy default stream one per context.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StreamId(usize);

impl StreamId {
    /// The legacy default stream's id where no CUDA context is current (host use, or no
    /// driver).
    pub const DEFAULT: StreamId = StreamId(0);

    /// The id as an integer (the raw handle, for a real stream).
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
    /// The legacy default stream (`0`) of the context current when it is used.
    pub const DEFAULT: StreamRef<'static> = StreamRef::from_bits(0);
    /// The per-thread default stream (`CU_STREAM_PER_THREAD`) of the thread and context that
    /// use it.
    pub const PER_THREAD: StreamRef<'static> = StreamRef::from_bits(RAW_PER_THREAD);

    /// A stand-in stream for resources that never call the driver (host memory, simulated
    /// memory), so that multi-stream logic is testable without a GPU. Its handle is one no
    /// driver stream can have, so it never equals a real or special stream; ids below 2^58
    /// below 2^56 give distinct streams.
    ///
    /// Resources that pass streams to the driver refuse it with
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) (see
    /// [`is_simulated`](StreamRef::is_simulated)).
    pub const fn simulated(id: usize) -> StreamRef<'static> {
        StreamRef::from_bits(SIMULATED_TAG | (((id << 4) | 0x8) & LOW_MASK))
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

    /// The raw handle as an integer, as logs and foreign APIs (CAI, DLPack) show it: the same
    /// for every thread's per-thread stream, unlike [`id`](Self::id).
    pub fn raw_value(self) -> usize {
        self.raw
    }

    /// The stream's identity, for bookkeeping that outlives this handle. For the special
    /// streams it depends on the calling thread (and its current CUDA context, once carve has
    /// loaded the driver): take it on the thread that uses the stream.
    pub fn id(self) -> StreamId {
        match self.raw {
            0 | RAW_LEGACY => match current_context() {
                0 => StreamId::DEFAULT,
                ctx => StreamId(LEGACY_TAG | (ctx & LOW_MASK)),
            },
            RAW_PER_THREAD => StreamId(PER_THREAD_TAG | per_thread_number(current_context())),
            raw if raw & !LOW_MASK != 0 => StreamId(SIMULATED_TAG | (raw & LOW_MASK)),
            raw => StreamId(raw),
        }
    }

    /// True for the legacy default stream (`0` or `CU_STREAM_LEGACY`).
    pub fn is_default(self) -> bool {
        self.raw == 0 || self.raw == RAW_LEGACY
    }

    /// True for the per-thread default stream.
    pub fn is_per_thread(self) -> bool {
        self.raw == RAW_PER_THREAD
    }

    /// True for a stream whose meaning depends on the calling thread's context (the legacy or
    /// a per-thread default stream).
    pub fn is_special(self) -> bool {
        self.is_default() || self.is_per_thread()
    }

    /// True for a [`simulated`](StreamRef::simulated) stream, or any handle no driver stream
    /// can have: such a handle must never reach the driver.
    pub fn is_simulated(self) -> bool {
        self.raw & !LOW_MASK != 0
    }

    /// The raw handle for a call to the driver named `what`, or
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) for a
    /// [`simulated`](Self::is_simulated) stream, which must never reach the driver.
    pub fn driver_handle(self, what: &str) -> crate::error::Result<CUstream> {
        if self.is_simulated() {
            return Err(crate::error::Error::InvalidArgument(format!(
                "{what}: {self:?} is a simulated stream, which cannot be passed to the driver"
            )));
        }
        Ok(self.as_raw())
    }
}

/// The calling thread's current CUDA context as an integer, or 0 when carve has not loaded
/// the driver or no context is current. Never loads the driver. Each context met here is
/// remembered (see [`special_stream_contexts`]).
fn current_context() -> usize {
    if !crate::driver::driver_initialised() {
        return 0;
    }
    let ctx = cudarc::driver::result::ctx::get_current()
        .ok()
        .flatten()
        .map_or(0, |c| c as usize);
    if ctx != 0 {
        remember_context(ctx);
    }
    ctx
}

/// Contexts (with their device ordinals) that a special stream was used in.
static SPECIAL_CONTEXTS: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

thread_local! {
    /// The context this thread last remembered, so the shared list is locked once per change.
    static REMEMBERED: Cell<usize> = const { Cell::new(0) };
}

/// Adds `ctx`, current on the calling thread, to [`SPECIAL_CONTEXTS`].
fn remember_context(ctx: usize) {
    if REMEMBERED.try_with(Cell::get) == Ok(ctx) {
        return;
    }
    let mut ordinal = 0;
    // SAFETY: a query of the calling thread's current context into a valid out-slot.
    if unsafe { cudarc::driver::sys::cuCtxGetDevice(&mut ordinal) }
        .result()
        .is_err()
    {
        return;
    }
    let mut known = lock(&SPECIAL_CONTEXTS);
    if !known.iter().any(|&(c, _)| c == ctx) {
        known.push((ctx, ordinal.max(0) as usize));
    }
    let _ = REMEMBERED.try_with(|r| r.set(ctx));
}

/// Every context (with its device's ordinal) in which some thread took the id of a legacy or
/// per-thread default stream: blocks freed on those streams may be queued in any of them, so a
/// device-wide synchronisation on behalf of such blocks must cover them all.
pub(crate) fn special_stream_contexts() -> Vec<(usize, usize)> {
    lock(&SPECIAL_CONTEXTS).clone()
}

/// A number for the calling thread's per-thread stream in context `ctx`, unique in the process
/// and never reused (another thread, or the same thread in another context, gets another).
fn per_thread_number(ctx: usize) -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(1);
    thread_local! {
        static NUMBERS: RefCell<Vec<(usize, usize)>> = const { RefCell::new(Vec::new()) };
    }
    let fresh = || NEXT.fetch_add(1, Ordering::Relaxed) & LOW_MASK;
    // While the thread's locals are torn down, a fresh number each time: an id no block was
    // freed on, which only costs ordering.
    NUMBERS
        .try_with(|numbers| {
            let mut numbers = numbers.borrow_mut();
            if let Some(&(_, n)) = numbers.iter().find(|(c, _)| *c == ctx) {
                return n;
            }
            let n = fresh();
            numbers.push((ctx, n));
            n
        })
        .unwrap_or_else(|_| fresh())
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
        assert!(StreamRef::DEFAULT.is_default());
        assert_ne!(StreamRef::simulated(0).id(), StreamRef::DEFAULT.id());
        assert_ne!(StreamRef::simulated(0).id(), StreamRef::PER_THREAD.id());
        assert_eq!(StreamRef::simulated(3).id(), StreamRef::simulated(3).id());
        assert_ne!(StreamRef::simulated(3).id(), StreamRef::simulated(4).id());
        assert_eq!(
            StreamId::from_usize(StreamRef::simulated(5).id().get()),
            StreamRef::simulated(5).id()
        );
    }

    #[test]
    fn legacy_handles_share_an_id_and_host_use_keeps_the_default_id() {
        // SAFETY: CU_STREAM_LEGACY is a special stream constant.
        let legacy = unsafe { StreamRef::from_raw(RAW_LEGACY as CUstream) };
        assert!(legacy.is_default() && legacy.is_special());
        assert_eq!(legacy.id(), StreamRef::DEFAULT.id());
        if !crate::driver::driver_initialised() {
            assert_eq!(StreamRef::DEFAULT.id(), StreamId::DEFAULT);
        }
        assert!(StreamRef::PER_THREAD.is_per_thread() && StreamRef::PER_THREAD.is_special());
        assert!(!StreamRef::simulated(1).is_special());
    }

    #[test]
    fn only_values_no_driver_stream_has_count_as_simulated() {
        for raw in [0usize, 1, 2, 0x18, 0x55d5_c7a0_e2b8, 0x00ff_ffff_ffff_fff8] {
            // SAFETY: the handle is only inspected, never used.
            let s = unsafe { StreamRef::from_raw(raw as CUstream) };
            assert!(!s.is_simulated(), "{s:?}");
            assert!(s.driver_handle("test").is_ok());
        }
        for s in [
            StreamRef::simulated(0),
            StreamRef::simulated(usize::MAX),
            // SAFETY: as above.
            unsafe { StreamRef::from_raw(usize::MAX as CUstream) },
        ] {
            assert!(s.is_simulated(), "{s:?}");
            assert!(matches!(
                s.driver_handle("test"),
                Err(crate::error::Error::InvalidArgument(_))
            ));
            // Signed 64-bit formats (memory snapshots) carry simulated handles and ids.
            assert!(s.id().get() < 1 << 62, "{:?}", s.id());
        }
        assert!(StreamRef::simulated(1).raw_value() < 1 << 62);
    }

    #[test]
    fn per_thread_ids_are_stable_on_a_thread_and_tagged_apart_from_handles() {
        let id = StreamRef::PER_THREAD.id();
        assert_eq!(id, StreamRef::PER_THREAD.id());
        assert_eq!(id.get() & !LOW_MASK, PER_THREAD_TAG);
        assert_ne!(id, StreamRef::DEFAULT.id());
        let other = std::thread::spawn(|| StreamRef::PER_THREAD.id())
            .join()
            .unwrap();
        assert_ne!(id, other);
    }
}
