//! What a replay runs on: the resource `--resource` names, and one stream per logged stream.

use std::fmt;
use std::sync::Arc;

use carve::adaptor::{StatisticsResourceAdaptor, TrackingResourceAdaptor};
use carve::driver::{Device, Stream};
use carve::error::{Error, Result};
use carve::resource::{
    ArenaMemoryResource, ArenaOptions, AsyncMemoryResource, BinningMemoryResource, CountingOrder,
    CudaBackingOptions, CudaMemoryResource, CudaOrder, ExpandableMemoryResource, ExpandableOptions,
    FixedSizeMemoryResource, FixedSizeOptions, HostMemoryResource, HostOrder, MemoryResource,
    PhysicalBacking, PoolMemoryResource, PoolOptions, SharedResource, SimulatedMemoryResource,
    StreamOrder, VirtualMemoryResource, VirtualOptions,
};
use carve::stream::StreamRef;

use super::options::{LargeUpstream, ResourceKind, ResourceOptions};
use super::timed::TimedUpstream;

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
    /// The most bytes the resource has taken from its upstream (the device) so far.
    pub peak_reserved: Option<SizeProbe>,
    /// The largest request the resource's memory could serve now (its largest free hole).
    pub largest_free: Option<SizeProbe>,
    /// A line about the resource's own work, for the report (chunks mapped and moved).
    pub notes: Option<NoteProbe>,
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
            peak_reserved: None,
            largest_free: None,
            notes: None,
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
        let probes = simulated(opts, capacity)?;
        return Ok(probes.into_target(
            format!(
                "{} over {:.2} GiB of simulated memory",
                opts.kind,
                capacity as f64 / (1u64 << 30) as f64
            ),
            simulated_streams(logged_streams),
            Vec::new(),
            None,
        ));
    }
    if opts.kind == ResourceKind::Host {
        let probes = Probes::plain(Arc::new(HostMemoryResource::new()));
        return Ok(probes.into_target(
            "host".to_owned(),
            simulated_streams(logged_streams),
            Vec::new(),
            None,
        ));
    }
    let device = Device::get(opts.device)?;
    let probes = match opts.kind {
        ResourceKind::Cuda => {
            // cuMemAlloc takes exactly what is asked (rounded by the driver, unseen here).
            let counted = StatisticsResourceAdaptor::new(CudaMemoryResource::new(&device));
            let mut p = Probes::plain(Arc::new(counted.clone()));
            p.peak_reserved = Some(Box::new(move || {
                counted.bytes_counter().peak.max(0) as usize
            }));
            p
        }
        ResourceKind::Async => {
            let pool = AsyncMemoryResource::default_pool(&device)?;
            pool.reset_high_water()?;
            let probe = pool.clone();
            let mut p = Probes::plain(Arc::new(pool));
            p.peak_reserved = Some(Box::new(move || {
                probe.stats().map_or(0, |s| s.reserved_high)
            }));
            p
        }
        ResourceKind::Virtual => virtual_resource(VirtualMemoryResource::on_device(
            &device,
            CudaBackingOptions::default(),
            virtual_options(opts),
        )?),
        ResourceKind::Expandable => expandable_resource(ExpandableMemoryResource::on_device(
            &device,
            CudaBackingOptions::default(),
            expandable_options(opts),
        )?),
        _ => counted_suballocator(opts, CudaMemoryResource::new(&device))?,
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
    Ok(probes.into_target(
        format!("{} on device {}", opts.kind, opts.device),
        streams,
        owned,
        Some(device),
    ))
}

/// The resource `opts` names over `capacity` bytes of address-only memory.
fn simulated(opts: &ResourceOptions, capacity: usize) -> Result<Probes> {
    match opts.kind {
        ResourceKind::Virtual => {
            return Ok(virtual_resource(VirtualMemoryResource::simulated(
                capacity,
                virtual_options(opts),
            )?))
        }
        ResourceKind::Expandable => {
            return Ok(expandable_resource(ExpandableMemoryResource::simulated(
                capacity,
                expandable_options(opts),
            )?))
        }
        _ => {}
    }
    let sim = SimulatedMemoryResource::new(capacity)?;
    let (frag, hole) = (sim.clone(), sim.clone());
    let mut p = if opts.kind.is_suballocator() {
        counted_suballocator(opts, sim.clone())?
    } else {
        // A plain resource over simulated memory is the simulated best-fit allocator itself.
        let peak = sim.clone();
        let mut p = Probes::plain(Arc::new(sim));
        p.peak_reserved = Some(Box::new(move || peak.usage().peak));
        p
    };
    p.fragmentation
        .get_or_insert_with(|| Box::new(move || frag.usage().fragmentation()));
    // Whatever the resource holds, it could still take the device's largest free range.
    p.largest_free = Some(Box::new(move || hole.usage().largest_free));
    Ok(p)
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

/// A call's total time for the resource notes, e.g. `3.25 ms`.
fn ms(d: std::time::Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1e3)
}

/// `--maximum-size` bounds the physical memory, `--block-size` sets the chunk size.
fn virtual_options(opts: &ResourceOptions) -> VirtualOptions {
    VirtualOptions {
        maximum: opts.maximum_size,
        chunk_size: opts.block_size,
        mark_every_free: opts.mark_every_free,
        ..VirtualOptions::default()
    }
}

/// `--maximum-size` bounds the physical memory, `--block-size` sets the large pages' size,
/// `--headroom` the headroom, `--small-limit` the small range's largest request.
fn expandable_options(opts: &ResourceOptions) -> ExpandableOptions {
    ExpandableOptions {
        maximum: opts.maximum_size,
        large_chunk: opts.block_size,
        headroom: opts.headroom,
        small_limit: opts.small_limit,
        mark_every_free: opts.mark_every_free,
        ..ExpandableOptions::default()
    }
}

fn expandable_resource<B: PhysicalBacking>(r: ExpandableMemoryResource<B>) -> Probes {
    let (peak, hole, notes) = (r.clone(), r.clone(), r.clone());
    Probes {
        resource: Arc::new(r),
        fragmentation: None,
        peak_reserved: Some(Box::new(move || peak.stats().peak_physical)),
        upstream: None,
        order: None,
        notes: Some(Box::new(move || {
            let s = notes.stats();
            let c = s.calls;
            format!(
                "headroom {}; chunks: small range ({} MiB) {} created, {} moved; large range \
                 ({} MiB) {} created, {} moved; driver calls: {} create ({}), {} map ({}), {} \
                 set_access ({}), {} unmap ({}), {} release ({}); synchronisations: {} of the \
                 device, {} of a stream ({}); {} marks and {} queries ({})",
                notes.headroom(),
                s.small.chunk_size >> 20,
                s.small.chunks_created,
                s.small.chunks_moved,
                s.large.chunk_size >> 20,
                s.large.chunks_created,
                s.large.chunks_moved,
                c.creates,
                ms(c.time.create),
                c.maps,
                ms(c.time.map),
                c.access_grants,
                ms(c.time.access),
                c.unmaps,
                ms(c.time.unmap),
                c.releases,
                ms(c.time.release),
                s.small.synchronizations + s.large.synchronizations,
                s.small.stream_synchronizations + s.large.stream_synchronizations,
                ms(s.small.synchronization_time + s.large.synchronization_time),
                s.small.marks + s.large.marks,
                s.small.mark_queries + s.large.mark_queries,
                ms(s.small.mark_time + s.large.mark_time)
            )
        })),
        // Free pages of either range can be released and mapped again where needed.
        largest_free: Some(Box::new(move || {
            let s = hole.stats();
            s.large.maximum.saturating_sub(s.physical) + s.small.free_mapped + s.large.free_mapped
        })),
    }
}

fn virtual_resource<B: PhysicalBacking>(r: VirtualMemoryResource<B>) -> Probes {
    let (peak, hole, notes) = (r.clone(), r.clone(), r.clone());
    Probes {
        resource: Arc::new(r),
        fragmentation: None,
        peak_reserved: Some(Box::new(move || peak.stats().peak_mapped)),
        // Free pages anywhere can be moved together: the largest request that fits.
        largest_free: Some(Box::new(move || hole.stats().mappable)),
        upstream: None,
        order: None,
        notes: Some(Box::new(move || {
            let s = notes.stats();
            format!(
                "chunks of {} MiB: {} created, {} moved; driver calls: {} map, {} set_access, {} \
                 unmap; synchronisations: {} of the device, {} of a stream ({}); {} marks and {} \
                 queries ({})",
                s.chunk_size >> 20,
                s.chunks_created,
                s.chunks_moved,
                s.maps,
                s.access_grants,
                s.unmaps,
                s.synchronizations,
                s.stream_synchronizations,
                ms(s.synchronization_time),
                s.marks,
                s.mark_queries,
                ms(s.mark_time)
            )
        })),
    }
}

/// The suballocator `opts.kind` over `upstream`, counting what it takes from the upstream.
fn counted_suballocator<U: carve::resource::MemoryResource + 'static>(
    opts: &ResourceOptions,
    upstream: U,
) -> Result<Probes> {
    let counted = StatisticsResourceAdaptor::new(upstream);
    let timed = TimedUpstream::new(Arc::new(counted.clone()));
    let (up, tracker) = tracked(Arc::new(timed.clone()));
    let mut p = suballocator(opts, up)?;
    p.upstream = Some(tracker);
    let traffic = counted.clone();
    p.peak_reserved = Some(Box::new(move || {
        counted.bytes_counter().peak.max(0) as usize
    }));
    // What the driver was asked for, on a GPU: a suballocator's time beyond its own
    // bookkeeping is mostly these calls (growth costs by the byte, ordering by the call).
    let order = p.order.take();
    p.notes.get_or_insert_with(|| {
        Box::new(move || {
            let (bytes, blocks) = (traffic.bytes_counter(), traffic.allocations_counter());
            let mut line = format!(
                "upstream: {} allocation(s) of {:.2} GiB in all, {} freed so far ({})",
                blocks.total,
                bytes.total as f64 / (1u64 << 30) as f64,
                blocks.total - blocks.value,
                ms(timed.time()),
            );
            if let Some(o) = &order {
                let c = o.counts();
                line += &format!(
                    "; ordering: {} mark(s), {} query(ies), {} wait(s), {} device and {} \
                     stream synchronisation(s) ({})",
                    c.marks,
                    c.queries,
                    c.waits,
                    c.device_synchronizations,
                    c.stream_synchronizations,
                    ms(c.time)
                );
            }
            line
        })
    });
    Ok(p)
}

/// The suballocator `opts.kind` over `upstream`, sized from `opts`.
///
/// Defaults when sizes are not given: the pool and arena start empty and grow without bound; the
/// fixed-size resource uses 1 MiB blocks; binning uses power-of-two bins from 256 B up to
/// `block_size` (4 MiB), refilled from a pool over the upstream that also serves larger
/// requests (or, with [`LargeUpstream::Direct`], bins and larger requests over the upstream
/// itself).
///
/// For the pool, the probes include its fragmentation and largest free block.
fn suballocator(opts: &ResourceOptions, upstream: SharedResource) -> Result<Probes> {
    // The order the resource would pick itself, counted for the report.
    let order = Arc::new(CountingOrder::new(default_order(&upstream)?));
    let mut pool = PoolOptions::new(opts.initial_size.unwrap_or(0)).order(order.clone());
    pool.maximum_size = opts.maximum_size;
    let resource: SharedResource = match opts.kind {
        ResourceKind::Pool => {
            let pool = PoolMemoryResource::new(upstream, pool)?;
            let (frag, hole) = (pool.clone(), pool.clone());
            let mut p = Probes::plain(Arc::new(pool));
            p.fragmentation = Some(Box::new(move || frag.stats().fragmentation));
            p.largest_free = Some(Box::new(move || hole.stats().largest_free_block));
            p.order = Some(order);
            return Ok(p);
        }
        ResourceKind::Arena => Arc::new(ArenaMemoryResource::new(
            upstream,
            ArenaOptions {
                global: pool,
                ..ArenaOptions::default()
            },
        )?),
        ResourceKind::Fixed => {
            let mut fixed = FixedSizeOptions::new(opts.block_size.unwrap_or(1 << 20));
            fixed.order = Some(order.clone());
            Arc::new(FixedSizeMemoryResource::new(upstream, fixed)?)
        }
        ResourceKind::Binning => {
            let largest = opts.block_size.unwrap_or(4 << 20);
            if !largest.is_power_of_two() || largest < 256 {
                return Err(Error::InvalidArgument(format!(
                    "--block-size {largest}: binning needs a power of two of at least 256"
                )));
            }
            let max_exp = largest.trailing_zeros();
            match opts.large_upstream {
                LargeUpstream::Pool => Arc::new(BinningMemoryResource::over_pool(
                    upstream, 8, max_exp, pool,
                )?),
                LargeUpstream::Direct => {
                    // Its bins pick their own order, so there is nothing complete to count.
                    let binning = BinningMemoryResource::new(upstream, 8, max_exp)?;
                    return Ok(Probes::plain(Arc::new(binning)));
                }
            }
        }
        ResourceKind::Cuda
        | ResourceKind::Async
        | ResourceKind::Host
        | ResourceKind::Virtual
        | ResourceKind::Expandable => {
            return Err(Error::InvalidArgument(format!(
                "{} is not a suballocator",
                opts.kind
            )))
        }
    };
    let mut p = Probes::plain(resource);
    p.order = Some(order);
    Ok(p)
}

/// Reads a fragmentation ratio (0: none) for the report.
type Probe = Box<dyn Fn() -> f64 + Send + Sync>;

/// Reads a byte count for the report.
pub type SizeProbe = Box<dyn Fn() -> usize + Send + Sync>;

/// Reads a line of notes for the report.
pub type NoteProbe = Box<dyn Fn() -> String + Send + Sync>;

/// A resource and what the report can read from it.
struct Probes {
    resource: SharedResource,
    fragmentation: Option<Probe>,
    peak_reserved: Option<SizeProbe>,
    largest_free: Option<SizeProbe>,
    notes: Option<NoteProbe>,
    upstream: Option<TrackingResourceAdaptor<SharedResource>>,
    /// The suballocator's stream ordering, counted, where every part of it uses that order.
    order: Option<Arc<CountingOrder>>,
}

impl Probes {
    fn plain(resource: SharedResource) -> Self {
        Probes {
            resource,
            fragmentation: None,
            peak_reserved: None,
            largest_free: None,
            notes: None,
            upstream: None,
            order: None,
        }
    }

    fn into_target(
        self,
        name: String,
        streams: Vec<StreamRef<'static>>,
        owned: Vec<Stream>,
        device: Option<Device>,
    ) -> Target {
        Target {
            resource: self.resource,
            name,
            streams,
            fragmentation: self.fragmentation,
            peak_reserved: self.peak_reserved,
            largest_free: self.largest_free,
            notes: self.notes,
            _owned_streams: owned,
            device,
            upstream: self.upstream,
        }
    }
}

/// The stream order a suballocator over `upstream` uses by default: the driver's events for
/// device-accessible memory, none for host memory (as the library's own default).
fn default_order(upstream: &SharedResource) -> Result<Arc<dyn StreamOrder>> {
    match (upstream.properties().device_accessible, upstream.device()) {
        (true, Some(device)) => Ok(Arc::new(CudaOrder::new(&device))),
        (true, None) => Err(Error::InvalidArgument(format!(
            "{upstream:?} gives device-accessible memory but names no device; pass a stream \
             order explicitly"
        ))),
        (false, _) => Ok(Arc::new(HostOrder)),
    }
}
