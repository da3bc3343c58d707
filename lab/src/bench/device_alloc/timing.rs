//! How every device-alloc row is timed: the run's context, launches between events with the
//! median of [`RUNS`], and CUDA's in-kernel malloc bounded in time.

use std::time::{Duration, Instant};

use carve::{Device, DeviceVec, Event, SharedResource, Stream};

use super::args::DeviceAllocArgs;
use crate::heap::HeapKernels;

/// Timed runs per figure, after one untimed; the median is reported.
pub(super) const RUNS: usize = 5;
/// How long CUDA's in-kernel malloc may run before it is reported as not finishing.
pub(super) const MALLOC_LIMIT: Duration = Duration::from_secs(10);

/// The device, stream and memory every row uses, and the run's flags.
pub(super) struct Ctx {
    pub dev: Device,
    pub stream: Stream,
    pub mr: SharedResource,
    pub args: DeviceAllocArgs,
}

impl Ctx {
    pub fn kernels(&self) -> HeapKernels<'_> {
        HeapKernels::new(&self.stream)
    }
}

/// Median milliseconds of `RUNS` timed runs of `body` (after one untimed), each between events;
/// `between` runs untimed after each.
pub(super) fn time(
    dev: &Device,
    stream: &Stream,
    mut body: impl FnMut() -> carve::Result<()>,
    mut between: impl FnMut() -> carve::Result<()>,
) -> carve::Result<f64> {
    let (start, end) = (Event::new(dev, true)?, Event::new(dev, true)?);
    body()?;
    between()?;
    let mut ms = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        start.record(stream.as_ref())?;
        body()?;
        end.record(stream.as_ref())?;
        end.synchronize()?;
        ms.push(start.elapsed_ms(&end)? as f64);
        between()?;
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[RUNS / 2])
}

/// Median milliseconds of `alloc` (each run after a `free`) and then of `free` (each run after
/// an `alloc`, which starts it from a full set of blocks). The last run leaves the blocks
/// allocated.
pub(super) fn time_alloc_free<A, F>(c: &Ctx, alloc: A, free: F) -> carve::Result<(f64, f64)>
where
    A: FnMut() -> carve::Result<()> + Copy,
    F: FnMut() -> carve::Result<()> + Copy,
{
    let alloc_ms = time(&c.dev, &c.stream, alloc, free)?;
    let mut alloc = alloc;
    alloc()?;
    Ok((alloc_ms, time(&c.dev, &c.stream, free, alloc)?))
}

/// `n` requests in `ms` milliseconds, in G requests/s.
pub(super) fn per_s(n: u64, ms: f64) -> f64 {
    n as f64 / (ms * 1e6)
}

/// Times `malloc` (a launch of CUDA's in-kernel malloc into `out`) and then CUDA's free of what
/// it wrote, bounded to `MALLOC_LIMIT`: rates in M/s, with the nulls counted.
pub(super) fn timed_malloc_free(
    c: &Ctx,
    n: u64,
    out: &DeviceVec<u64>,
    malloc: impl FnOnce() -> carve::Result<()>,
) -> carve::Result<(String, String)> {
    let k = c.kernels();
    let (start, mid, end) = (
        Event::new(&c.dev, true)?,
        Event::new(&c.dev, true)?,
        Event::new(&c.dev, true)?,
    );
    start.record(c.stream.as_ref())?;
    malloc()?;
    mid.record(c.stream.as_ref())?;
    // SAFETY: frees what the launch above allocated (nulls are ignored by free).
    unsafe { k.cuda_free(n, out.as_ptr(), n) }?;
    end.record(c.stream.as_ref())?;
    let t = Instant::now();
    while !end.is_complete()? {
        if t.elapsed() > MALLOC_LIMIT {
            let msg = format!("did not finish in {} s", MALLOC_LIMIT.as_secs());
            // Nothing can stop a running kernel: wait, so later rows are not skewed.
            end.synchronize()?;
            return Ok((msg.clone(), msg));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let nulls = out.to_vec()?.iter().filter(|&&p| p == 0).count();
    let note = if nulls > 0 {
        format!(" ({nulls} null)")
    } else {
        String::new()
    };
    let a = start.elapsed_ms(&mid)? as f64;
    let f = mid.elapsed_ms(&end)? as f64;
    Ok((
        format!("{:.2} M/s{note}", n as f64 / (a * 1e3)),
        format!("{:.2} M/s", n as f64 / (f * 1e3)),
    ))
}
