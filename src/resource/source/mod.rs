//! Sources: resources that get memory from the driver or the host, with no upstream.

pub(crate) mod async_pool;
pub(crate) mod cuda;
pub(crate) mod host;
pub(crate) mod host_buffer;
pub(crate) mod location;
pub(crate) mod managed;
pub(crate) mod pinned;
pub(crate) mod simulated;
pub(crate) mod virtual_memory;
