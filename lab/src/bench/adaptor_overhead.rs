//! What each adaptor adds to an allocate + free pair, over the host resource and (with a GPU)
//! the cuda resource: is it cheap enough to leave on?

use std::io;
use std::sync::Arc;
use std::time::Instant;

use carve::adaptor::{
    LimitingResourceAdaptor, LoggingResourceAdaptor, StatisticsResourceAdaptor,
    TrackingResourceAdaptor,
};
use carve::{
    CudaMemoryResource, Device, HostMemoryResource, MemoryResource, SharedResource, StreamRef,
};

use super::table::{ns, Table};

const BYTES: usize = 4096;

/// Mean ns per allocate + free of `BYTES`, `iters` times, 64 blocks in flight.
fn time(mr: &dyn MemoryResource, iters: usize) -> carve::Result<f64> {
    let s = StreamRef::DEFAULT;
    let mut ring = Vec::with_capacity(64);
    let t = Instant::now();
    for i in 0..iters {
        if ring.len() == 64 {
            let p = ring.swap_remove(i % 64);
            // SAFETY: from `mr` with these arguments, freed once.
            unsafe { mr.deallocate(s, p, BYTES, 256)? };
        }
        ring.push(mr.allocate(s, BYTES, 256)?);
    }
    for p in ring {
        // SAFETY: as above.
        unsafe { mr.deallocate(s, p, BYTES, 256)? };
    }
    Ok(t.elapsed().as_nanos() as f64 / iters as f64)
}

fn stack(base: SharedResource) -> carve::Result<Vec<(&'static str, SharedResource)>> {
    Ok(vec![
        ("none", base.clone()),
        (
            "statistics",
            Arc::new(StatisticsResourceAdaptor::new(base.clone())),
        ),
        (
            "limiting",
            Arc::new(LimitingResourceAdaptor::new(base.clone(), usize::MAX)),
        ),
        (
            "tracking",
            Arc::new(TrackingResourceAdaptor::new(base.clone(), false)),
        ),
        (
            "logging (to a sink)",
            Arc::new(LoggingResourceAdaptor::to_writer(base, io::sink(), false)?),
        ),
    ])
}

/// The adaptor-overhead table (`--quick`: fewer iterations).
pub fn run(quick: bool) -> carve::Result<Table> {
    let iters = if quick { 2_000 } else { 200_000 };
    let mut table = Table::new(
        format!("adaptor_overhead: {iters} allocate + free pairs of {BYTES} B (ns per pair)"),
        &["upstream", "adaptor", "ns/pair", "added"],
    );
    let mut bases: Vec<(&str, SharedResource, usize)> =
        vec![("host", Arc::new(HostMemoryResource::new()), iters)];
    match Device::get(0) {
        Ok(dev) => bases.push(("cuda", Arc::new(CudaMemoryResource::new(&dev)), iters / 100)),
        Err(e) => table.note(format!("no GPU ({e}): host upstream only")),
    }
    for (name, base, n) in bases {
        let mut baseline = None;
        for (adaptor, mr) in stack(base)? {
            time(mr.as_ref(), n / 10)?; // warm-up
            let t = time(mr.as_ref(), n)?;
            let base_t = *baseline.get_or_insert(t);
            table.row(vec![
                name.into(),
                adaptor.into(),
                ns(t),
                ns((t - base_t).max(0.0)),
            ]);
        }
    }
    Ok(table)
}
