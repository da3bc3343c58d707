//! The coalescing engine shared by the pool, the arena's per-thread arenas and the virtual-memory
//! resource: a block index over address ranges ([`core`]) whose blocks are [`node`]s, its TLSF
//! free-block index ([`tlsf`]) and its table of live blocks ([`live`]). Plain host bookkeeping;
//! it never touches the memory it manages.

mod core;
mod live;
mod node;
mod tlsf;

pub(crate) use self::core::{
    allocate_from, footprint, free_into, OnStream, Placer, PoolCore, Reach,
};
pub(crate) use node::GRAIN;
