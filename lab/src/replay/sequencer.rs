//! Runs steps spread over several threads in one global order.
//!
//! Step `i` belongs to worker `owner[i]`. A worker waits (parked) until the turn counter reaches
//! its step, runs it, then advances the counter and unparks the owner of the next step: exactly
//! one wake-up per hand-over, none when the same worker owns the next step.

#[cfg(carve_loom)]
use loom::thread::{self, Thread};
#[cfg(not(carve_loom))]
use std::thread::{self, Thread};

use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::Mutex;

/// The turn value after [`Sequencer::abort`].
const ABORTED: usize = usize::MAX;

#[derive(Debug)]
pub(crate) struct Sequencer {
    turn: AtomicUsize,
    owner: Vec<usize>,
    waiters: Vec<Mutex<Option<Thread>>>,
}

impl Sequencer {
    /// `owner[i]` is the worker that runs step `i`; workers are `0..workers`.
    pub(crate) fn new(owner: Vec<usize>, workers: usize) -> Self {
        debug_assert!(owner.iter().all(|&w| w < workers));
        Self {
            turn: AtomicUsize::new(0),
            owner,
            waiters: (0..workers).map(|_| Mutex::new(None)).collect(),
        }
    }

    /// Called by worker `w` on its own thread before its first [`wait`](Self::wait).
    pub(crate) fn register(&self, w: usize) {
        *self.slot(w) = Some(thread::current());
    }

    /// Blocks until step `step` may run; `false` once the sequence is aborted.
    pub(crate) fn wait(&self, step: usize) -> bool {
        loop {
            match self.turn.load(Ordering::Acquire) {
                t if t == step => return true,
                ABORTED => return false,
                // A stale unpark token only costs one more trip round the loop.
                _ => thread::park(),
            }
        }
    }

    /// Marks step `step` done and wakes the owner of the next one.
    pub(crate) fn advance(&self, step: usize) {
        let next = step + 1;
        if self
            .turn
            .compare_exchange(step, next, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return; // aborted meanwhile
        }
        if let Some(&w) = self.owner.get(next) {
            if w != self.owner[step] {
                // The owner either registered already (and gets the token), or registers after
                // this lock, and then reads the new turn before it parks.
                if let Some(t) = self.slot(w).as_ref() {
                    t.unpark();
                }
            }
        }
    }

    /// Stops the sequence: every waiting worker returns `false`.
    pub(crate) fn abort(&self) {
        self.turn.store(ABORTED, Ordering::Release);
        for w in 0..self.waiters.len() {
            if let Some(t) = self.slot(w).as_ref() {
                t.unpark();
            }
        }
    }

    fn slot(&self, w: usize) -> crate::sync::MutexGuard<'_, Option<Thread>> {
        #[cfg(carve_loom)]
        return self.waiters[w].lock().unwrap();
        #[cfg(not(carve_loom))]
        self.waiters[w].lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Real threads, many hand-overs: the log of who ran what is exactly the global order.
    #[test]
    fn threads_run_steps_in_global_order() {
        let workers = 4;
        let owner: Vec<usize> = (0..2000).map(|i| (i * 7 + i / 3) % workers).collect();
        let seq = Arc::new(Sequencer::new(owner.clone(), workers));
        let done = Arc::new(std::sync::Mutex::new(Vec::new()));
        std::thread::scope(|s| {
            for w in 0..workers {
                let (seq, done, owner) = (seq.clone(), done.clone(), &owner);
                s.spawn(move || {
                    seq.register(w);
                    for step in (0..owner.len()).filter(|&i| owner[i] == w) {
                        assert!(seq.wait(step));
                        done.lock().unwrap().push((step, w));
                        seq.advance(step);
                    }
                });
            }
        });
        let done = done.lock().unwrap();
        let expect: Vec<_> = owner.iter().enumerate().map(|(i, &w)| (i, w)).collect();
        assert_eq!(*done, expect);
    }

    #[test]
    fn abort_releases_waiters() {
        let seq = Arc::new(Sequencer::new(vec![0, 1], 2));
        std::thread::scope(|s| {
            let waiter = {
                let seq = seq.clone();
                s.spawn(move || {
                    seq.register(1);
                    seq.wait(1)
                })
            };
            seq.register(0);
            assert!(seq.wait(0));
            seq.abort();
            assert!(!waiter.join().unwrap());
        });
    }
}

#[cfg(all(test, carve_loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;

    /// Two workers, interleaved steps 0..4 (owners 0,1,1,0): under every schedule the steps run
    /// in order, and no wake-up is lost (a lost one would deadlock, which loom reports).
    #[test]
    fn steps_run_in_order_without_lost_wakeups() {
        loom::model(|| {
            let owner = vec![0, 1, 1, 0];
            let seq = Arc::new(Sequencer::new(owner.clone(), 2));
            let next = Arc::new(AtomicUsize::new(0));
            let run = |w: usize, seq: Arc<Sequencer>, next: Arc<AtomicUsize>| {
                let owner = vec![0, 1, 1, 0];
                move || {
                    seq.register(w);
                    for step in (0..owner.len()).filter(|&i| owner[i] == w) {
                        assert!(seq.wait(step));
                        assert_eq!(next.load(Ordering::Relaxed), step);
                        next.store(step + 1, Ordering::Relaxed);
                        seq.advance(step);
                    }
                }
            };
            let t = loom::thread::spawn(run(1, seq.clone(), next.clone()));
            run(0, seq.clone(), next.clone())();
            t.join().unwrap();
            assert_eq!(next.load(Ordering::Relaxed), 4);
        });
    }
}
