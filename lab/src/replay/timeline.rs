//! Live and reserved bytes over the steps of a replay, for `carve replay --plot`.

use std::sync::Mutex;

/// How many points a timeline keeps at most (the replay samples every `steps / MAX_POINTS`
/// steps).
pub const MAX_POINTS: usize = 4000;

/// One resource's bytes over the replay.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    /// The resource (the report's name).
    pub resource: String,
    /// (step, live bytes, reserved bytes when the resource can tell).
    pub points: Vec<(usize, usize, Option<usize>)>,
}

/// Reads the bytes a resource holds from its upstream.
pub type ReservedProbe = Box<dyn Fn() -> usize + Send + Sync>;

/// Collects a [`Timeline`] while a replay runs; steps run one at a time (the sequencer), so the
/// lock is never contended.
pub struct Sampler {
    stride: usize,
    reserved: Option<ReservedProbe>,
    points: Mutex<Vec<(usize, usize, Option<usize>)>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("stride", &self.stride)
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// A sampler for a replay of `steps` steps.
    pub fn new(steps: usize, reserved: Option<ReservedProbe>) -> Self {
        Sampler {
            stride: steps.div_ceil(MAX_POINTS).max(1),
            reserved,
            points: Mutex::new(Vec::with_capacity(MAX_POINTS + 2)),
        }
    }

    /// Records step `step` (after it ran) if it falls on the stride, or when `last`.
    pub(crate) fn step(&self, step: usize, last: bool, live: impl FnOnce() -> usize) {
        if step % self.stride == 0 || last {
            let point = (step + 1, live(), self.reserved.as_ref().map(|r| r()));
            self.points
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(point);
        }
    }

    /// The timeline collected, under `resource`'s name.
    pub fn finish(self, resource: String) -> Timeline {
        let mut points = self.points.into_inner().unwrap_or_else(|e| e.into_inner());
        points.insert(0, (0, 0, points.first().and_then(|p| p.2.map(|_| 0))));
        Timeline { resource, points }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_on_the_stride_and_the_last_step() {
        let s = Sampler::new(3 * MAX_POINTS, Some(Box::new(|| 7)));
        for i in 0..3 * MAX_POINTS {
            s.step(i, i + 1 == 3 * MAX_POINTS, || i);
        }
        let t = s.finish("x".into());
        assert_eq!(t.points.len(), MAX_POINTS + 2, "start, every 3rd, last");
        assert_eq!(t.points[1], (1, 0, Some(7)));
        assert_eq!(
            *t.points.last().unwrap(),
            (3 * MAX_POINTS, 3 * MAX_POINTS - 1, Some(7))
        );
    }
}
