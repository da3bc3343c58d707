//! Engines: the machinery that sources and suballocators share. The coalescing block index
//! (pool, arenas and virtual memory place blocks with it), stream ordering (when a block freed
//! on one stream may go to another), the ledger of live driver blocks, the clock that times
//! passed-on calls, freeing an owned block exactly once, and the fault patterns of the test
//! doubles.

pub(crate) mod call_clock;
pub(crate) mod coalescing;
pub(crate) mod fault_pattern;
pub(crate) mod ledger;
pub(crate) mod release;
pub(crate) mod stream_order;
