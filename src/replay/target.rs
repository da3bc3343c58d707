//! What a replay runs on: the resource `--resource` names, and one stream per logged stream.

use std::fmt;
use std::sync::Arc;

use crate::adaptor::TrackingResourceAdaptor;
use crate::driver::{Device, Stream};
use crate::error::{Error, Result};
use crate::resource::{
    ArenaMemoryResource, ArenaOptions, AsyncMemoryResource, BinningMemoryResource,
    CudaMemoryResource, FixedSizeMemoryResource, FixedSizeOptions, HostMemoryResource,
    PoolMemoryResource, PoolOptions, SharedResource, SimulatedMemoryResource,
};
use crate::stream::StreamRef;

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
    /// Fixed: block size; binning: largest bin.
    pub block_size: Option<usize>,
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
            simulate_capacity: None,
        }
    }
}

/// A resource ready to replay on, with the streams logged stream ids map to.
pub struct Target {
    /// The resource, type-erased.
    pub resource: SharedResource,
    /// A label for the report.
    pub name: String,
    /// By plan stream index; the real ones live in `_owned_streams` (see [`Target::streams`]).
    streams: Vec<StreamRef<'static>>,
    /// Fragmentation now (`1 - largest free / free`), when the resource can tell.
    pub fragmentation: Option<Probe>,
    /// Keeps real streams alive while their `StreamRef`s are in use.
    _owned_streams: Vec<Stream>,
    /// The device to synchronise at the end, for GPU resources.
    pub device: Option<Device>,
    /// For suballocators: their upstream, tracked, so the replay can report what they reserve
    /// (its outstanding bytes) and snapshot their segments.
    pub upstream: Option<TrackingResourceAdaptor<SharedResource>>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("name", &self.name)
            .field("streams", &self.streams)
            .finish_non_exhaustive()
    }
}

impl Target {
    /// A target over any resource, with `streams` by plan stream index (for embedding the
    /// replay in tests or tools with a resource `--resource` does not name).
    pub fn new(
        resource: SharedResource,
        name: impl Into<String>,
        streams: Vec<StreamRef<'static>>,
    ) -> Self {
        Target {
            resource,
            name: name.into(),
            streams,
            fragmentation: None,
            _owned_streams: Vec::new(),
            device: None,
            upstream: None,
        }
    }

    /// The streams, by plan stream index, borrowed from the target that keeps them alive.
    pub fn streams(&self) -> &[StreamRef<'_>] {
        &self.streams
    }
}

/// `upstream` behind a tracker (cheap: suballocators call their upstream rarely), and the tracker.
fn tracked(upstream: SharedResource) -> (SharedResource, TrackingResourceAdaptor<SharedResource>) {
    let tracker = TrackingResourceAdaptor::new(upstream, false);
    (Arc::new(tracker.clone()), tracker)
}

/// Builds the resource `opts` names, and a stream for each of `logged_streams` (logged ids: `0` is
/// the default stream; others get a new stream each on a GPU, a simulated one otherwise).
pub fn build_target(opts: &ResourceOptions, logged_streams: &[u64]) -> Result<Target> {
    if let Some(capacity) = opts.simulate_capacity {
        let sim = SimulatedMemoryResource::new(capacity)?;
        let probe = sim.clone();
        let mut upstream = None;
        let (resource, own_probe): (SharedResource, _) = if opts.kind.is_suballocator() {
            let (up, tracker) = tracked(Arc::new(sim));
            upstream = Some(tracker);
            suballocator(opts, up)?
        } else {
            // A plain resource over simulated memory is the simulated best-fit allocator itself.
            (Arc::new(sim), None)
        };
        let fragmentation: Probe =
            own_probe.unwrap_or_else(|| Box::new(move || probe.usage().fragmentation()));
        return Ok(Target {
            resource,
            name: format!(
                "{} over {:.2} GiB of simulated memory",
                opts.kind,
                capacity as f64 / (1u64 << 30) as f64
            ),
            streams: simulated_streams(logged_streams),
            fragmentation: Some(fragmentation),
            _owned_streams: Vec::new(),
            device: None,
            upstream,
        });
    }
    if opts.kind == ResourceKind::Host {
        return Ok(Target {
            resource: Arc::new(HostMemoryResource::new()),
            name: "host".to_owned(),
            streams: simulated_streams(logged_streams),
            fragmentation: None,
            _owned_streams: Vec::new(),
            device: None,
            upstream: None,
        });
    }
    let device = Device::get(opts.device)?;
    let mut upstream = None;
    let (resource, fragmentation): (SharedResource, _) = match opts.kind {
        ResourceKind::Cuda => (Arc::new(CudaMemoryResource::new(&device)), None),
        ResourceKind::Async => (Arc::new(AsyncMemoryResource::default_pool(&device)?), None),
        _ => {
            let (up, tracker) = tracked(Arc::new(CudaMemoryResource::new(&device)));
            upstream = Some(tracker);
            suballocator(opts, up)?
        }
    };
    let mut owned = Vec::new();
    let mut streams = Vec::with_capacity(logged_streams.len());
    for &id in logged_streams {
        streams.push(match id {
            // The legacy default stream, CU_STREAM_LEGACY (1) and CU_STREAM_PER_THREAD (2) are
            // special handles, valid in every context.
            0 | 1 => StreamRef::DEFAULT,
            2 => StreamRef::PER_THREAD,
            _ => {
                let s = device.new_stream()?;
                // SAFETY: the stream is kept in `_owned_streams` for the target's life, and the
                // private handle is only lent out borrowing the target (`Target::streams`).
                let r = unsafe { StreamRef::from_raw(s.as_ref().as_raw()) };
                owned.push(s);
                r
            }
        });
    }
    Ok(Target {
        resource,
        name: format!("{} on device {}", opts.kind, opts.device),
        streams,
        fragmentation,
        _owned_streams: owned,
        device: Some(device),
        upstream,
    })
}

fn simulated_streams(logged: &[u64]) -> Vec<StreamRef<'static>> {
    logged
        .iter()
        .enumerate()
        .map(|(i, &id)| {
            if id == 0 {
                StreamRef::DEFAULT
            } else {
                StreamRef::simulated(i)
            }
        })
        .collect()
}

/// The suballocator `opts.kind` over `upstream`, sized from `opts`.
///
/// Defaults when sizes are not given: the pool and arena start empty and grow without bound; the
/// fixed-size resource uses 1 MiB blocks; binning uses power-of-two bins from 256 B up to
/// `block_size` (4 MiB), larger requests going straight to the upstream.
///
/// Returns the resource and, for the pool, a probe of its fragmentation for the report.
fn suballocator(
    opts: &ResourceOptions,
    upstream: SharedResource,
) -> Result<(SharedResource, Option<Probe>)> {
    let mut pool = PoolOptions::new(opts.initial_size.unwrap_or(0));
    pool.maximum_size = opts.maximum_size;
    let resource: SharedResource = match opts.kind {
        ResourceKind::Pool => {
            let pool = PoolMemoryResource::new(upstream, pool)?;
            let probe = pool.clone();
            return Ok((
                Arc::new(pool),
                Some(Box::new(move || probe.stats().fragmentation)),
            ));
        }
        ResourceKind::Arena => Arc::new(ArenaMemoryResource::new(
            upstream,
            ArenaOptions {
                global: pool,
                ..ArenaOptions::default()
            },
        )?),
        ResourceKind::Fixed => Arc::new(FixedSizeMemoryResource::new(
            upstream,
            FixedSizeOptions::new(opts.block_size.unwrap_or(1 << 20)),
        )?),
        ResourceKind::Binning => {
            let largest = opts.block_size.unwrap_or(4 << 20);
            if !largest.is_power_of_two() || largest < 256 {
                return Err(Error::InvalidArgument(format!(
                    "--block-size {largest}: binning needs a power of two of at least 256"
                )));
            }
            Arc::new(BinningMemoryResource::new(
                upstream,
                8,
                largest.trailing_zeros(),
            )?)
        }
        ResourceKind::Cuda | ResourceKind::Async | ResourceKind::Host => {
            return Err(Error::InvalidArgument(format!(
                "{} is not a suballocator",
                opts.kind
            )))
        }
    };
    Ok((resource, None))
}

/// Reads a fragmentation ratio (0: none) for the report.
type Probe = Box<dyn Fn() -> f64 + Send + Sync>;
