//! Suballocators: resources that carve blocks out of an upstream resource's memory.

pub(crate) mod arena;
pub(crate) mod binning;
pub(crate) mod fixed_size;
pub(crate) mod graph_safe;
pub(crate) mod limits;
#[cfg(test)]
mod limits_tests;
pub(crate) mod pool;
