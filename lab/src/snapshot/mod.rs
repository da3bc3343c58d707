//! Reading PyTorch's memory snapshots (`torch.cuda.memory._snapshot()`, pickled) and carve's own
//! ([`Snapshot::to_pickle`]) into a [`Snapshot`]: what `carve replay --format torch` replays.
//! The library writes snapshots; reading them is only the lab's business.

mod read;
mod unpickle;

use std::path::Path;

use carve::snapshot::Snapshot;
use carve::Result;

/// Reading a pickled [`Snapshot`]: `use carve_lab::snapshot::ReadSnapshot` and call
/// `Snapshot::from_pickle` or `Snapshot::read`.
pub trait ReadSnapshot: Sized {
    /// Reads a pickled snapshot (PyTorch's or carve's). A bare list is read as the segments
    /// alone, as `torch.cuda._memory_viz` does.
    fn from_pickle(bytes: &[u8]) -> Result<Self>;

    /// Reads a pickled snapshot from `path`.
    fn read(path: impl AsRef<Path>) -> Result<Self>;
}

impl ReadSnapshot for Snapshot {
    fn from_pickle(bytes: &[u8]) -> Result<Snapshot> {
        read::from_pickle(bytes)
    }

    fn read(path: impl AsRef<Path>) -> Result<Snapshot> {
        Self::from_pickle(&std::fs::read(path)?)
    }
}
