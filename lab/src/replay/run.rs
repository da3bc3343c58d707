//! The replay itself: one thread per logged thread, in the logged order.

use std::ptr::NonNull;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::plan::{Op, Plan};
use super::report::{FirstFailure, ReplayReport};
use super::sequencer::Sequencer;
use super::target::Target;
use super::timeline::Sampler;
use crate::sync::atomic::{AtomicUsize, Ordering};
use carve::error::Result;
use carve::resource::{MemoryResource, SharedResource, DEFAULT_ALIGNMENT};

/// Logs with at least this many steps get a progress bar (when asked for and stderr is a terminal).
const PROGRESS_MIN_STEPS: usize = 10_000;
/// The bar moves every this many steps, to keep it off the hot path.
const PROGRESS_STRIDE: usize = 4096;

/// Shared state of the workers. The sequencer orders every step, so relaxed loads and stores
/// suffice: no read-modify-write, whose locked instructions would cost more than some
/// resources' own work and be charged to them.
struct Shared<'a> {
    plan: &'a Plan,
    target: &'a Target,
    mr: SharedResource,
    /// Bytes live, and their peak.
    live: AtomicUsize,
    peak: AtomicUsize,
    /// Exposed address of each slot's block; 0 when not allocated (or its allocation failed).
    slots: Vec<AtomicUsize>,
    failed_allocs: AtomicUsize,
    failed_frees: AtomicUsize,
    first_failure: Mutex<Option<FirstFailure>>,
    first_failed_free: Mutex<Option<(u64, String)>>,
    bar: ProgressBar,
}

/// Replays `plan` on `target` and reports. Failed allocations are counted (their frees skipped),
/// never fatal; see [`ReplayReport::succeeded`]. Blocks the log leaves live are freed at the end.
pub fn replay(plan: &Plan, target: &Target, progress: bool) -> Result<ReplayReport> {
    replay_sampled(plan, target, progress, None)
}

/// [`replay`], then `passes - 1` more passes of the same log over the same resource, folded into
/// the first pass's report ([`ReplayReport::absorb`]); `passes` of 0 or 1 replay once. Peak
/// reserved and the resource's notes are read after the last pass.
pub fn replay_passes(plan: &Plan, target: &Target, passes: u32) -> Result<ReplayReport> {
    let first = replay(plan, target, false)?;
    more_passes(plan, target, first, passes)
}

/// Folds `passes - 1` more passes of `plan` over `target` into `report`, its first pass's.
pub(crate) fn more_passes(
    plan: &Plan,
    target: &Target,
    mut report: ReplayReport,
    passes: u32,
) -> Result<ReplayReport> {
    for _ in 1..passes {
        report.absorb(replay(plan, target, false)?);
    }
    report.peak_reserved = target.peak_reserved.as_ref().map(|f| f());
    report.resource_notes = target.notes.as_ref().map(|f| f());
    Ok(report)
}

/// [`replay`], recording live (and, where the sampler can read them, reserved) bytes after the
/// steps `sampler` picks.
pub fn replay_sampled(
    plan: &Plan,
    target: &Target,
    progress: bool,
    sampler: Option<&Sampler>,
) -> Result<ReplayReport> {
    let steps = plan.steps.len();
    let bar = if progress && steps >= PROGRESS_MIN_STEPS {
        let bar = ProgressBar::with_draw_target(Some(steps as u64), ProgressDrawTarget::stderr());
        if let Ok(style) =
            ProgressStyle::with_template("replay {bar:40} {pos}/{len} steps ({per_sec}, eta {eta})")
        {
            bar.set_style(style);
        }
        bar
    } else {
        ProgressBar::hidden()
    };
    let shared = Shared {
        plan,
        target,
        mr: target.resource.clone(),
        live: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        slots: (0..plan.slots.len()).map(|_| AtomicUsize::new(0)).collect(),
        failed_allocs: AtomicUsize::new(0),
        failed_frees: AtomicUsize::new(0),
        first_failure: Mutex::new(None),
        first_failed_free: Mutex::new(None),
        bar,
    };

    let workers = plan.threads.len();
    let owner: Vec<usize> = plan.steps.iter().map(|s| s.thread).collect();
    let seq = Sequencer::new(owner, workers);
    let mut mine: Vec<Vec<usize>> = vec![Vec::new(); workers];
    for (i, s) in plan.steps.iter().enumerate() {
        mine[s.thread].push(i);
    }

    let start = Instant::now();
    std::thread::scope(|scope| {
        for (w, steps) in mine.iter().enumerate() {
            let (shared, seq) = (&shared, &seq);
            scope.spawn(move || {
                let _abort_on_panic = AbortOnPanic(seq);
                seq.register(w);
                for &i in steps {
                    if !seq.wait(i) {
                        return;
                    }
                    shared.run_step(i);
                    if let Some(s) = sampler {
                        s.step(i, i + 1 == plan.steps.len(), || shared.live());
                    }
                    if i % PROGRESS_STRIDE == 0 {
                        shared.bar.set_position(i as u64);
                    }
                    seq.advance(i);
                }
            });
        }
    });
    if let Some(dev) = &target.device {
        dev.synchronize()?;
    }
    let elapsed = start.elapsed();
    shared.bar.finish_and_clear();

    let peak = shared.peak.load(Ordering::Relaxed);
    let peak_reserved = target.peak_reserved.as_ref().map(|f| f());
    let resource_notes = target.notes.as_ref().map(|f| f());
    shared.free_leftovers();
    if let Some(dev) = &target.device {
        dev.synchronize()?;
    }
    let mut report = shared.report(peak, elapsed);
    report.peak_reserved = peak_reserved;
    report.resource_notes = resource_notes;
    Ok(report)
}

/// Ends the sequence if a worker panics, so the others do not wait for it forever.
struct AbortOnPanic<'a>(&'a Sequencer);

impl Drop for AbortOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.abort();
        }
    }
}

impl Shared<'_> {
    fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Moves the live bytes by `bytes` up (`grow`) or down, in step order (see [`Shared`]).
    fn count(&self, bytes: usize, grow: bool) {
        let live = if grow {
            self.live() + bytes
        } else {
            self.live().saturating_sub(bytes)
        };
        self.live.store(live, Ordering::Relaxed);
        if live > self.peak.load(Ordering::Relaxed) {
            self.peak.store(live, Ordering::Relaxed);
        }
    }

    fn run_step(&self, i: usize) {
        let step = self.plan.steps[i];
        match step.op {
            Op::Alloc {
                slot,
                bytes,
                stream,
            } => {
                match self
                    .mr
                    .allocate(self.target.streams()[stream], bytes, DEFAULT_ALIGNMENT)
                {
                    Ok(p) => {
                        self.count(bytes, true);
                        self.slots[slot].store(p.as_ptr().expose_provenance(), Ordering::Relaxed)
                    }
                    Err(e) => {
                        self.failed_allocs.fetch_add(1, Ordering::Relaxed);
                        let mut first =
                            self.first_failure.lock().unwrap_or_else(|e| e.into_inner());
                        if first.is_none() {
                            *first = Some(FirstFailure {
                                line: step.line,
                                bytes,
                                in_use: self.live(),
                                fragmentation: self.target.fragmentation.as_ref().map(|f| f()),
                                largest_free: self.target.largest_free.as_ref().map(|f| f()),
                                error: e.to_string(),
                            });
                        }
                    }
                }
            }
            Op::Free {
                slot,
                bytes,
                stream,
            } => {
                let addr = self.take_slot(slot);
                if addr != 0 {
                    if let Err(e) = self.free(addr, bytes, stream) {
                        self.failed_frees.fetch_add(1, Ordering::Relaxed);
                        let mut first = self
                            .first_failed_free
                            .lock()
                            .unwrap_or_else(|e| e.into_inner());
                        first.get_or_insert((step.line, e.to_string()));
                    }
                }
            }
        }
    }

    /// Empties `slot` and returns what it held (a load and a store: see [`Shared`]).
    fn take_slot(&self, slot: usize) -> usize {
        let addr = self.slots[slot].load(Ordering::Relaxed);
        self.slots[slot].store(0, Ordering::Relaxed);
        addr
    }

    /// Frees the block at `addr` and counts it freed.
    fn free(&self, addr: usize, bytes: usize, stream: usize) -> Result<()> {
        let ptr = NonNull::new(std::ptr::with_exposed_provenance_mut::<u8>(addr))
            .expect("slots hold non-zero addresses");
        // SAFETY: `addr` is the exposed address of a block this replay allocated from `self.mr`
        // with `bytes` and DEFAULT_ALIGNMENT, taken out of its slot so it is freed once; the
        // replay never touches the memory.
        unsafe {
            self.mr
                .deallocate(self.target.streams()[stream], ptr, bytes, DEFAULT_ALIGNMENT)
        }?;
        self.count(bytes, false);
        Ok(())
    }

    /// Frees what the log never frees, so the resource is left empty.
    fn free_leftovers(&self) {
        for (slot, &(bytes, stream)) in self.plan.slots.iter().enumerate() {
            let addr = self.take_slot(slot);
            if addr != 0 && self.free(addr, bytes, stream).is_err() {
                self.failed_frees.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    fn report(&self, peak: usize, elapsed: Duration) -> ReplayReport {
        let allocations = self
            .plan
            .steps
            .iter()
            .filter(|s| matches!(s.op, Op::Alloc { .. }))
            .count();
        ReplayReport {
            resource: self.target.name.clone(),
            allocations,
            frees: self.plan.steps.len() - allocations,
            threads: self.plan.threads.len(),
            streams: self.plan.streams.len(),
            peak_bytes: peak,
            logged_peak_bytes: self.plan.logged_peak,
            peak_reserved: None,
            resource_notes: None,
            elapsed,
            later_passes: vec![],
            failed_allocations: self.failed_allocs.load(Ordering::Relaxed),
            first_failure: self
                .first_failure
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            failed_frees: self.failed_frees.load(Ordering::Relaxed),
            first_failed_free: self
                .first_failed_free
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
            logged_failures: self.plan.logged_failures,
            unfreed: self.plan.unfreed,
        }
    }
}
