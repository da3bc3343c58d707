//! The options `--resource` and its companions parse into: which resource a replay builds, and
//! how it is sized.

use std::fmt;

#[cfg(doc)]
use carve::resource::ExpandableOptions;

/// `--resource`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ResourceKind {
    /// cuMemAlloc / cuMemFree for every request.
    Cuda,
    /// The driver's default pool: cuMemAllocAsync / cuMemFreeAsync.
    Async,
    /// Pageable host memory (no GPU needed).
    Host,
    /// carve's coalescing pool.
    Pool,
    /// carve's size-class bins.
    Binning,
    /// carve's arena.
    Arena,
    /// carve's fixed-size blocks.
    Fixed,
    /// carve's virtual-memory resource: one reserved range, whole chunks per block.
    Virtual,
    /// carve's expandable pool: growing ranges (small and large requests) whose free pages are
    /// unmapped and moved where needed.
    Expandable,
}

impl ResourceKind {
    /// True for the suballocators, which take sizes and an upstream.
    pub fn is_suballocator(self) -> bool {
        matches!(
            self,
            ResourceKind::Pool | ResourceKind::Binning | ResourceKind::Arena | ResourceKind::Fixed
        )
    }
}

impl fmt::Display for ResourceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            ResourceKind::Cuda => "cuda",
            ResourceKind::Async => "async",
            ResourceKind::Host => "host",
            ResourceKind::Pool => "pool",
            ResourceKind::Binning => "binning",
            ResourceKind::Arena => "arena",
            ResourceKind::Fixed => "fixed",
            ResourceKind::Virtual => "virtual",
            ResourceKind::Expandable => "expandable",
        };
        f.write_str(name)
    }
}

/// The parsed `--resource` options.
#[derive(Clone, Debug, PartialEq)]
pub struct ResourceOptions {
    /// Which resource to build.
    pub kind: ResourceKind,
    /// Device ordinal for GPU resources.
    pub device: usize,
    /// Suballocators: initial pool size.
    pub initial_size: Option<usize>,
    /// Suballocators: maximum pool size.
    pub maximum_size: Option<usize>,
    /// Fixed: block size; binning: largest bin; virtual and expandable: chunk size.
    pub block_size: Option<usize>,
    /// Expandable: the headroom ([`ExpandableOptions::headroom`]).
    pub headroom: Option<f64>,
    /// Expandable: the largest request for the small range
    /// ([`ExpandableOptions::small_limit`]).
    pub small_limit: Option<usize>,
    /// Virtual and expandable: [`ExpandableOptions::mark_every_free`].
    pub mark_every_free: bool,
    /// Binning: where requests above the largest bin go.
    pub large_upstream: LargeUpstream,
    /// Replay over address-only memory of this many bytes instead of a device.
    pub simulate_capacity: Option<usize>,
}

impl ResourceOptions {
    /// Options for `kind` with no sizes, on device 0, not simulated.
    pub fn new(kind: ResourceKind) -> Self {
        Self {
            kind,
            device: 0,
            initial_size: None,
            maximum_size: None,
            block_size: None,
            headroom: None,
            small_limit: None,
            mark_every_free: false,
            large_upstream: LargeUpstream::Pool,
            simulate_capacity: None,
        }
    }
}

/// `--large-upstream`: where binning sends requests above its largest bin.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LargeUpstream {
    /// A coalescing pool over the upstream, which the bins refill from too.
    #[default]
    Pool,
    /// The upstream itself, one request at a time (cuMemAlloc on a GPU).
    Direct,
}
