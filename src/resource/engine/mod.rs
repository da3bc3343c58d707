//! Engines: the machinery that sources and suballocators share. The coalescing block index
//! (pool, arenas and virtual memory place blocks with it), stream ordering (when a block freed
//! on one stream may go to another), the ledger of live driver blocks, and the clock that times
//! passed-on calls.

pub(crate) mod call_clock;
pub(crate) mod coalescing;
pub(crate) mod ledger;
pub(crate) mod stream_order;
