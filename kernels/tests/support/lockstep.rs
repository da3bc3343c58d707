//! A host warp in lock-step: `n <= 32` CPU threads, one per lane, each running the same closure,
//! whose [`Warp`] collectives are real rendezvous, so the multi-lane paths of the allocators run
//! in `cargo test` (and under Miri).
//!
//! - **Collectives** (`shfl`, `ballot`, `match_any`, `match_all`): every lane of `mask` publishes
//!   its value into one record of that call, waits until every lane of `mask` that is still
//!   running has published, then reads them all. Each call has its own record (found by its
//!   mask, among those still gathering, and removed by its last reader), so calls with
//!   different masks can be open at once: a subset of lanes may run collectives of its own
//!   while the rest wait at one over the whole warp, and a record is never reused while a lane
//!   still reads it. A lane that has finished its closure never arrives: a collective whose
//!   mask names it fails the test (on the GPU, a `.sync` collective naming a lane that left is
//!   undefined behaviour). Only the test's own [`Lane::sync`] waits for the running lanes. Lanes of one call must make the same collective at the same place in
//!   the source: a lane that skipped one (a short-circuit `&&` before a shuffle, or a return
//!   before the others' collective) and meets the others at its next fails the test, where on
//!   the GPU the warp hangs.
//! - **`active()`** emulates `activemask` under divergence: the lanes that call it wait until
//!   every running lane is blocked (at a collective, at `active()`, or finished), and those at
//!   `active()` together get their own set. So `if want { alloc }` in the closure gives the
//!   allocator the lanes that want, as the GPU does, and a lane that finished leaves the mask.
//!   As on the GPU, lanes at `active()` at different places are not told apart: a test that
//!   needs rounds kept apart calls [`Lane::sync`] (`__syncwarp`) between them.
//! - A malformed program (lanes waiting on each other with nothing left to run) is detected when
//!   it happens, and every lane panics instead of hanging; so does every lane when one panics.
#![allow(dead_code)]

use std::sync::{Condvar, Mutex, MutexGuard};
use std::thread;

use carve_kernels::warp::Warp;

/// One collective call in progress.
struct Record {
    id: u64,
    /// The instruction (`shfl`, `ballot`, ...) and where it is called: lanes of one call must
    /// all make the same one at the same place.
    op: (&'static str, &'static std::panic::Location<'static>),
    mask: u32,
    /// Lanes that returned count as arrived ([`Lane::sync`] only).
    exits_arrive: bool,
    arrived: u32,
    vals: [u64; 32],
    complete: bool,
    /// Lanes that have not read the values yet (after `complete`).
    unread: u32,
}

struct State {
    /// The lanes launched.
    lanes: u32,
    /// Lanes whose closure returned (or panicked).
    exited: u32,
    /// Lanes blocked: at an incomplete collective or at `active()`.
    blocked: u32,
    /// Lanes at `active()`.
    at_active: u32,
    /// What `active()` returns to each lane once its group is formed (0: not yet).
    active_result: [u32; 32],
    records: Vec<Record>,
    next_id: u64,
    /// A lane panicked or the warp deadlocked: every lane stops.
    failed: Option<String>,
}

impl State {
    /// Completes what can complete; returns true when anything changed.
    fn progress(&mut self) -> bool {
        // The first failure stands: every lane reports it.
        if self.failed.is_some() {
            return false;
        }
        if let Some(r) = self
            .records
            .iter()
            .find(|r| !r.complete && !r.exits_arrive && r.mask & self.exited & !r.arrived != 0)
        {
            let gone = r.mask & self.exited & !r.arrived;
            self.failed = Some(format!(
                "lanes {gone:#x} returned, but lanes {:#x} wait for them at {} at {} over {:#x}",
                r.arrived, r.op.0, r.op.1, r.mask
            ));
            return true;
        }
        let mut changed = false;
        let running = self.lanes & !self.exited;
        for r in &mut self.records {
            let waits_for = if r.exits_arrive { running } else { u32::MAX };
            if !r.complete && r.mask & waits_for & !r.arrived == 0 {
                r.complete = true;
                r.unread = r.arrived;
                self.blocked &= !r.arrived;
                changed = true;
            }
        }
        let running = self.lanes & !self.exited;
        if !changed && running & !self.blocked == 0 && running != 0 {
            if self.at_active != 0 {
                // Nothing else can move: the lanes at `active()` run on together.
                let group = self.at_active;
                for l in lanes_of(group) {
                    self.active_result[l as usize] = group;
                }
                self.blocked &= !group;
                self.at_active = 0;
                changed = true;
            } else {
                let open: Vec<(u32, u32)> = self
                    .records
                    .iter()
                    .filter(|r| !r.complete)
                    .map(|r| (r.mask, r.arrived))
                    .collect();
                self.failed = Some(format!(
                    "lock-step warp deadlocked: running {running:#x}, open collectives \
                     (mask, arrived) {open:x?}"
                ));
                changed = true;
            }
        }
        changed
    }
}

fn lanes_of(mask: u32) -> impl Iterator<Item = u32> {
    (0..32).filter(move |l| mask >> l & 1 != 0)
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A lane that panicked while holding the lock leaves `failed` set; carry on to read it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.cv.wait(g).unwrap_or_else(|e| e.into_inner())
    }
}

/// One lane of a lock-step warp: what the closure gets, and the [`Warp`] it passes on.
pub struct Lane<'a> {
    shared: &'a Shared,
    lane: u32,
    slot: u32,
}

impl Lane<'_> {
    /// The lanes launched (whether or not still running).
    pub fn launched(&self) -> u32 {
        self.shared.lock().lanes
    }

    /// `__syncwarp()`: waits for every running lane (the only call where lanes that returned
    /// count as arrived).
    #[track_caller]
    pub fn sync(&self) {
        let mask = self.launched();
        self.exchange("syncwarp", mask, 0);
    }

    fn check(&self, g: &State) {
        if let Some(why) = &g.failed {
            panic!("lane {}: {why}", self.lane);
        }
    }

    /// Publishes `v` to the call of `mask` and returns every lane's value, with the lanes that
    /// published (all of `mask`, less lanes that returned before a [`Lane::sync`]).
    #[track_caller]
    fn exchange(&self, op: &'static str, mask: u32, v: u64) -> ([u64; 32], u32) {
        let op = (op, std::panic::Location::caller());
        let me = 1u32 << self.lane;
        let mut g = self.shared.lock();
        self.check(&g);
        assert!(
            mask & me != 0,
            "lane {} calls a collective of {mask:#x}",
            self.lane
        );
        assert!(
            mask & !g.lanes == 0,
            "mask {mask:#x} names lanes never launched"
        );
        let exits_arrive = op.0 == "syncwarp";
        let running = g.lanes & !g.exited;
        if !exits_arrive && mask & g.exited != 0 {
            let why = format!(
                "lane {} calls {} at {} over {mask:#x}, which names lanes {:#x} that returned",
                self.lane,
                op.0,
                op.1,
                mask & g.exited
            );
            g.failed = Some(why.clone());
            self.shared.cv.notify_all();
            panic!("{why}");
        }
        // The open call with this mask that this lane has not joined yet, else a new one.
        let found = g.records.iter().position(|r| {
            !r.complete
                && r.arrived & me == 0
                && r.exits_arrive == exits_arrive
                && r.mask & running == mask & running
        });
        let i = match found {
            // A lane that skipped a collective the others wait at (a short-circuit `&&`, say)
            // would meet them at its next one: on the GPU the warp hangs.
            Some(i) if g.records[i].op != op => {
                let (theirs, at) = g.records[i].op;
                let (lane, arrived) = (self.lane, g.records[i].arrived);
                let why = format!(
                    "lane {lane} calls {} at {} over {mask:#x} where lanes {arrived:#x} wait at \
                     {theirs} at {at}",
                    op.0, op.1
                );
                g.failed = Some(why.clone());
                self.shared.cv.notify_all();
                panic!("{why}");
            }
            Some(i) => i,
            None => {
                let id = g.next_id;
                g.next_id += 1;
                g.records.push(Record {
                    id,
                    op,
                    mask,
                    exits_arrive,
                    arrived: 0,
                    vals: [0; 32],
                    complete: false,
                    unread: 0,
                });
                g.records.len() - 1
            }
        };
        let id = g.records[i].id;
        g.records[i].vals[self.lane as usize] = v;
        g.records[i].arrived |= me;
        g.blocked |= me;
        if g.progress() {
            self.shared.cv.notify_all();
        }
        loop {
            self.check(&g);
            let i = g.records.iter().position(|r| r.id == id).unwrap();
            if g.records[i].complete {
                let r = &mut g.records[i];
                let out = (r.vals, r.arrived);
                r.unread &= !me;
                if r.unread == 0 {
                    g.records.swap_remove(i);
                }
                return out;
            }
            g = self.shared.wait(g);
        }
    }
}

impl Warp for Lane<'_> {
    // `active()` emulates `activemask`: lanes that returned leave it by themselves.
    const TRACKS_ACTIVE: bool = true;

    fn active(&self) -> u32 {
        let me = 1u32 << self.lane;
        let mut g = self.shared.lock();
        self.check(&g);
        g.at_active |= me;
        g.blocked |= me;
        if g.progress() {
            self.shared.cv.notify_all();
        }
        loop {
            self.check(&g);
            let m = g.active_result[self.lane as usize];
            if m != 0 {
                g.active_result[self.lane as usize] = 0;
                return m;
            }
            g = self.shared.wait(g);
        }
    }

    fn lane(&self) -> u32 {
        self.lane
    }

    #[track_caller]
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
        let (vals, arrived) = self.exchange("shfl", mask, v as u64);
        // `shfl.sync.idx` with c = 31 reads lane `src mod 32`.
        let src = src & 31;
        assert!(
            arrived >> src & 1 != 0,
            "lane {} shuffles from lane {src}, not a running lane of {mask:#x}",
            self.lane
        );
        vals[src as usize] as u32
    }

    #[track_caller]
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        let (vals, arrived) = self.exchange("match_any", mask, v);
        lanes_of(arrived)
            .filter(|&l| vals[l as usize] == v)
            .fold(0, |m, l| m | 1 << l)
    }

    #[track_caller]
    fn match_all(&self, mask: u32, v: u64) -> bool {
        let (vals, arrived) = self.exchange("match_all", mask, v);
        lanes_of(arrived).all(|l| vals[l as usize] == v)
    }

    #[track_caller]
    fn ballot(&self, mask: u32, pred: bool) -> u32 {
        let (vals, arrived) = self.exchange("ballot", mask, pred as u64);
        lanes_of(arrived)
            .filter(|&l| vals[l as usize] != 0)
            .fold(0, |m, l| m | 1 << l)
    }

    fn slot_hint(&self) -> u32 {
        self.slot
    }
}

/// Marks its lane finished when the closure returns or unwinds.
struct Exit<'a> {
    shared: &'a Shared,
    lane: u32,
}

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        let mut g = self.shared.lock();
        let me = 1u32 << self.lane;
        g.exited |= me;
        g.blocked &= !me;
        if thread::panicking() && g.failed.is_none() {
            g.failed = Some(format!("lane {} panicked", self.lane));
        }
        g.progress();
        self.shared.cv.notify_all();
    }
}

/// Runs `f` on `lanes` lanes of one warp (lanes `0..lanes`), with `slot_hint` `slot`; returns each
/// lane's result, by lane. Panics if a lane panics or the warp deadlocks.
pub fn run<R, F>(lanes: u32, slot: u32, f: F) -> Vec<R>
where
    R: Send,
    F: Fn(&Lane<'_>) -> R + Sync,
{
    assert!((1..=32).contains(&lanes));
    let shared = Shared {
        state: Mutex::new(State {
            lanes: (u64::MAX >> (64 - lanes)) as u32,
            exited: 0,
            blocked: 0,
            at_active: 0,
            active_result: [0; 32],
            records: Vec::new(),
            next_id: 0,
            failed: None,
        }),
        cv: Condvar::new(),
    };
    thread::scope(|s| {
        let handles: Vec<_> = (0..lanes)
            .map(|l| {
                let (shared, f) = (&shared, &f);
                s.spawn(move || {
                    let _exit = Exit { shared, lane: l };
                    f(&Lane {
                        shared,
                        lane: l,
                        slot,
                    })
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    })
}
