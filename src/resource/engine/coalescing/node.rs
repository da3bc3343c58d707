//! The nodes of the coalescing index: one per block, linked to its neighbours in the chunk and
//! filed in a bin, and the per-stream tags that name the bins.

use super::live::NodeAddr;
use super::tlsf::FreeLinks;
use crate::resource::memory_resource::DEFAULT_ALIGNMENT;
use crate::stream::StreamId;

/// Every block is a multiple of this, at an address aligned to it.
pub(crate) const GRAIN: usize = DEFAULT_ALIGNMENT;

/// `Node::bin` of a live block, and of a node on the spare list.
pub(super) const LIVE: u32 = u32::MAX;
pub(super) const SPARE: u32 = u32::MAX - 1;
/// The bin of blocks any stream may take.
pub(super) const ANY: u32 = 0;

#[derive(Clone, Copy, Debug)]
pub(super) struct Node {
    pub(super) addr: usize,
    pub(super) size: usize,
    /// Neighbours in the chunk (NIL at its ends).
    pub(super) phys: (u32, u32),
    /// Free-list links, while filed.
    pub(super) link: (u32, u32),
    /// The bin it is filed in, or LIVE / SPARE.
    pub(super) bin: u32,
    /// While live, `size` minus the requested bytes (under a grain: a live block is the
    /// request rounded up to the grain), so a node takes 40 bytes, not 48.
    pub(super) slack: u8,
}

#[cfg(target_pointer_width = "64")]
static_assertions::assert_eq_size!(Node, [u64; 5]);

impl Node {
    /// The bytes requested for a live block.
    #[inline]
    pub(super) fn requested(&self) -> usize {
        self.size - self.slack as usize
    }
}

impl NodeAddr for Vec<Node> {
    #[inline]
    fn addr_of(&self, node: u32) -> usize {
        self[node as usize].addr
    }
}

impl FreeLinks for Vec<Node> {
    #[inline]
    fn units(&self, node: u32) -> usize {
        self[node as usize].size / GRAIN
    }
    #[inline]
    fn link(&mut self, node: u32) -> &mut (u32, u32) {
        &mut self[node as usize].link
    }
}

/// A stream's two bins: fresh is `2 * tag + 1`, sealed `2 * tag + 2`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Tag {
    pub(super) stream: StreamId,
    pub(super) frees_since_mark: u32,
    /// `PoolCore::demand` at this stream's last mark.
    pub(super) demand_seen: u64,
    /// `PoolCore::allocs` at this stream's last allocation (0: none yet).
    pub(super) last_alloc: u64,
    /// Sealed blocks wait for the driver to confirm this stream's last mark.
    pub(super) unconfirmed: bool,
    /// `PoolCore::allocs` before which that is not asked again.
    pub(super) query_at: u64,
}

#[inline]
pub(super) fn fresh_bin(tag: usize) -> u32 {
    2 * tag as u32 + 1
}
#[inline]
pub(super) fn sealed_bin(tag: usize) -> u32 {
    2 * tag as u32 + 2
}
#[inline]
pub(super) fn tag_of_bin(bin: u32) -> Option<usize> {
    (bin != ANY).then(|| (bin as usize - 1) / 2)
}
