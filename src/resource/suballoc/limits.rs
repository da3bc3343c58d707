//! The check of a count in resource options against its upper bound (`PoolOptions::MAX_SHARDS`,
//! `ArenaOptions::MAX_ARENAS`, `FixedSizeOptions::MAX_REFILLS`). Each count sizes a table that is
//! built up front, so a count that no machine could hold (a C or Python caller passing
//! `SIZE_MAX`) is refused as [`Error::InvalidArgument`] instead of aborting on a failed
//! allocation.

use crate::error::{Error, Result};

/// `n`, or [`Error::InvalidArgument`] naming `resource` and `what` when `n` exceeds `max`.
pub(crate) fn count(resource: &str, what: &str, n: usize, max: usize) -> Result<usize> {
    if n > max {
        return Err(Error::InvalidArgument(format!(
            "{resource}: {what} = {n} exceeds the maximum {max}"
        )));
    }
    Ok(n)
}
