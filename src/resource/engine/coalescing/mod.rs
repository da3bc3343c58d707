//! The coalescing engine shared by the pool, the arena's per-thread arenas and the virtual-memory
//! resource: a block index over address ranges ([`core`]), its TLSF free-block index
//! ([`tlsf`]) and its table of live blocks ([`live`]). Plain host bookkeeping; it never touches
//! the memory it manages.

pub(crate) mod core;
mod live;
mod tlsf;
