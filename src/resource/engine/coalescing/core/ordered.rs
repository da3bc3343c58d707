//! The stream-ordered entry points: allocating from and freeing into an index on behalf of a
//! stream, with the driver calls (waits, marks, synchronisations) that make it safe.

use std::ptr::NonNull;

use super::{footprint, EmptyChunk, Placer, PoolCore};
use crate::error::Result;
use crate::resource::engine::stream_order::StreamOrder;
use crate::stream::{StreamId, StreamRef};

/// A stream with its id, taken once by the caller: a default stream's id asks the driver, so
/// a path that needs it more than once carries it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OnStream<'a> {
    pub stream: StreamRef<'a>,
    pub id: StreamId,
}

impl<'a> OnStream<'a> {
    /// `stream` with its id.
    #[inline]
    pub fn new(stream: StreamRef<'a>) -> Self {
        OnStream {
            stream,
            id: stream.id(),
        }
    }
}

/// How far [`allocate_from`] may go for memory that other streams freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Only blocks reachable with one event wait.
    Events,
    /// Also every free block, after one device-wide synchronisation.
    Synchronize,
}

/// Finds a block for a checked request in `core` without growing it: the stream's own and
/// *any* blocks first; then the best-fitting sealed block of another stream (one wait on that
/// stream's last mark); then, with [`Reach::Synchronize`] and if free memory could serve the
/// request, every free block merged after one device-wide synchronisation, so fragmentation
/// across streams never forces growth. No stream but `on`'s is named to `order`'s driver
/// calls. Each block is placed with `placer` when one is given ([`Placer`]), by best fit
/// otherwise.
#[inline]
pub(crate) fn allocate_from(
    core: &mut PoolCore,
    order: &dyn StreamOrder,
    on: OnStream<'_>,
    bytes: usize,
    align: usize,
    reach: Reach,
    placer: Option<&dyn Placer>,
) -> Result<Option<NonNull<u8>>> {
    let OnStream { stream, id } = on;
    if core.mark_every_free {
        core.allocs += 1;
        let t = core.tag(id);
        core.tags[t].last_alloc = core.allocs;
        if core.unconfirmed {
            // A failed query only keeps the blocks sealed: nothing to report.
            core.release_confirmed(id, |s| order.mark_complete(s).unwrap_or(false));
        }
    }
    if let Some(p) = core.take_with(id, bytes, align, placer) {
        return Ok(Some(p));
    }
    // Marks are worth their driver call only while other streams' blocks could help.
    if core.others_hold_free(id) {
        core.note_demand();
    }
    if let Some((victim, node)) = core.sealed_fit_elsewhere(id, bytes, align) {
        order.wait_for_mark(stream, victim)?;
        core.adopt(node, id);
        if let Some(p) = core.take_with(id, bytes, align, placer) {
            return Ok(Some(p));
        }
    }
    let needed = footprint(bytes, align).map_or(usize::MAX, |f| f.1);
    if reach == Reach::Synchronize
        && core.others_hold_free(id)
        && core.pool_size() - core.in_use() >= needed
    {
        order.synchronize_all()?;
        core.merge_all();
        return Ok(core.take_with(id, bytes, align, placer));
    }
    Ok(None)
}

/// Frees a block into `core`, sealing `on`'s fresh blocks when a mark is due (or at once
/// with `mark_now`, for a block whose core other streams allocate from).
#[inline]
pub(crate) fn free_into(
    core: &mut PoolCore,
    order: &dyn StreamOrder,
    name: &'static str,
    on: OnStream<'_>,
    ptr: usize,
    bytes: usize,
    mark_now: bool,
) -> Result<Option<EmptyChunk>> {
    let OnStream { stream, id } = on;
    let freed = core.free(name, id, ptr, bytes)?;
    // A failed mark only keeps the fresh blocks private to the stream (others reach them after a
    // device-wide synchronisation), and the free itself is done: nothing to report.
    if (freed.mark_due || mark_now) && order.mark(stream).is_ok() {
        core.seal(id);
    }
    Ok(freed.empty)
}
