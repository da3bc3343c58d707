//! Resource adaptors: each wraps (and owns) an upstream resource, is a resource itself, and is a
//! cheap `Clone` handle, so adaptors stack in any order.
//!
//! | adaptor | does |
//! |---|---|
//! | [`LimitingResourceAdaptor`] | refuses requests past a byte limit ([`LimitBudget`]: one limit over several resources) |
//! | [`StatisticsResourceAdaptor`] | current / peak / total bytes and counts, in nested scopes |
//! | [`TrackingResourceAdaptor`] | outstanding blocks, leak report, double-free and foreign-pointer detection |
//! | [`LoggingResourceAdaptor`] | RMM's CSV allocation log, readable by `carve replay` |
//! | [`FailureCallbackResourceAdaptor`] | on out-of-memory, calls back and retries |
//! | [`AlignedResourceAdaptor`] | over-aligns requests at or above a size threshold |
//! | [`PrefetchResourceAdaptor`] | prefetches managed allocations to the device |
//! | [`FaultInjectingResource`] | fails chosen allocations and frees, delays frees (for tests) |

mod aligned;
mod failure_callback;
mod fault_injection;
mod limiting;
mod logging;
mod prefetch;
mod statistics;
mod tracking;

pub use crate::resource::FaultPattern;
pub use aligned::AlignedResourceAdaptor;
pub use failure_callback::FailureCallbackResourceAdaptor;
pub use fault_injection::{FaultInjectingResource, FaultOptions, FaultStats};
pub use limiting::{LimitBudget, LimitingResourceAdaptor};
pub use logging::{LogAction, LoggingResourceAdaptor, LOG_HEADER};
pub use prefetch::PrefetchResourceAdaptor;
pub use statistics::{Counter, StatisticsResourceAdaptor};
pub use tracking::{Allocation, TrackingResourceAdaptor};
