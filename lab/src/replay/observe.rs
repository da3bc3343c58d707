//! One replay with what `--plot` and `--snapshot` ask for: a sampler of live and reserved bytes,
//! and trackers on both sides of the resource whose history becomes a PyTorch snapshot.

use std::path::PathBuf;
use std::sync::Arc;

use carve::adaptor::TrackingResourceAdaptor;
use carve::error::Result;
use carve::resource::SharedResource;

use super::options::ResourceKind;
use super::plan::Plan;
use super::report::ReplayReport;
use super::run::{more_passes, replay_sampled};
use super::target::Target;
use super::timeline::{ReservedProbe, Sampler, Timeline};

/// Events kept for a snapshot at most (PyTorch's default ring is similar in size).
const SNAPSHOT_MAX_EVENTS: usize = 4 << 20;

/// One resource's replay.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// What it found.
    pub report: ReplayReport,
    /// Bytes over time, when `--plot` asked for them.
    pub timeline: Option<Timeline>,
    /// Where its snapshot went, when `--snapshot` asked for one.
    pub snapshot: Option<PathBuf>,
}

/// Replays `plan` on `target` (a `kind` resource on `device`), sampling bytes over time when
/// `sample`, and writing a snapshot to `snapshot` when given; then `passes - 1` more passes over
/// the same resource, folded into the report
/// ([`ReplayReport::absorb`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn replay_one(
    plan: &Plan,
    mut target: Target,
    kind: ResourceKind,
    device: usize,
    progress: bool,
    sample: bool,
    snapshot: Option<PathBuf>,
    passes: u32,
) -> Result<Replayed> {
    let clients = snapshot.as_ref().map(|_| {
        let t = TrackingResourceAdaptor::new(target.resource.clone(), false);
        t.record_history(SNAPSHOT_MAX_EVENTS);
        if let Some(up) = &target.upstream {
            up.record_history(SNAPSHOT_MAX_EVENTS);
        }
        target.resource = Arc::new(t.clone()) as SharedResource;
        t
    });
    let sampler = sample.then(|| {
        let probe: Option<ReservedProbe> = target.upstream.clone().map(|up| {
            let probe: ReservedProbe = Box::new(move || up.allocated_bytes());
            probe
        });
        Sampler::new(plan.steps.len(), probe)
    });
    let first = replay_sampled(plan, &target, progress, sampler.as_ref())?;
    let report = more_passes(plan, &target, first, passes)?;
    let timeline = sampler.map(|s| {
        let mut t = s.finish(kind.to_string());
        // cuMemAlloc and host memory reserve exactly what they hand out; the driver pool's
        // reserve is the driver's business, and the virtual resources map pages of their own
        // (their peak is in the report), so those are left out.
        let own_reserve = matches!(
            kind,
            ResourceKind::Async | ResourceKind::Virtual | ResourceKind::Expandable
        );
        if target.upstream.is_none() && !own_reserve {
            for p in &mut t.points {
                p.2 = Some(p.1);
            }
        }
        t
    });
    if let (Some(path), Some(clients)) = (&snapshot, &clients) {
        let snap = match &target.upstream {
            Some(up) => clients.snapshot_over(device as u64, up)?,
            None => clients.snapshot(device as u64)?,
        };
        snap.write(path)?;
    }
    Ok(Replayed {
        report,
        timeline,
        snapshot,
    })
}
