//! Freeing an owned block exactly once, without losing it when the call that must come first
//! (binding the device's context, waiting for other streams) fails.

use crate::error::Result;

/// Frees the block in `slot`, if any: `prepare` first (bind, wait), then `free`.
///
/// The block leaves `slot` only once `prepare` has succeeded, so a failed `prepare` leaves it
/// for a retry (a later call, or `Drop`, which records the error and leaks if that fails too).
/// Once `free` is called the block is the resource's, whatever it returns: a resource that
/// refuses a free keeps its books (the [`MemoryResource`](crate::resource::MemoryResource)
/// contract), and a second free could reach a block that is no longer this owner's.
pub(crate) fn release_once<P: Copy>(
    slot: &mut Option<P>,
    prepare: impl FnOnce() -> Result<()>,
    free: impl FnOnce(P) -> Result<()>,
) -> Result<()> {
    let Some(p) = *slot else {
        return Ok(());
    };
    prepare()?;
    *slot = None;
    free(p)
}

/// `Drop`'s release: on failure, records the error for
/// [`take_deferred_error`](crate::take_deferred_error) and tries once more (binding takes the
/// context's recorded error, often an earlier call's, so a second try may go through); if that
/// fails too, records it and leaves the block leaked.
pub(crate) fn release_in_drop(context: &'static str, mut release: impl FnMut() -> Result<()>) {
    let first = release();
    if first.is_err() {
        crate::deferred::record(context, first);
        crate::deferred::record(context, release());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn a_failed_preparation_keeps_the_block_for_a_retry() {
        let mut slot = Some(7u64);
        let mut freed = Vec::new();
        let r = release_once(
            &mut slot,
            || Err(Error::ZeroSize),
            |p| {
                freed.push(p);
                Ok(())
            },
        );
        assert!(matches!(r, Err(Error::ZeroSize)));
        assert_eq!(slot, Some(7), "the block was lost");
        assert!(freed.is_empty());

        release_once(
            &mut slot,
            || Ok(()),
            |p| {
                freed.push(p);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!((slot, &freed[..]), (None, &[7][..]));
        // Freed once: a further release is a no-op.
        release_once(
            &mut slot,
            || Ok(()),
            |p| {
                freed.push(p);
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(freed, [7]);
    }

    #[test]
    fn a_failed_free_is_not_retried() {
        let mut slot = Some(7u64);
        let mut calls = 0;
        let mut free = |_| {
            calls += 1;
            Err(Error::ZeroSize)
        };
        assert!(release_once(&mut slot, || Ok(()), &mut free).is_err());
        assert!(release_once(&mut slot, || Ok(()), &mut free).is_ok());
        assert_eq!((slot, calls), (None, 1));
    }
}
