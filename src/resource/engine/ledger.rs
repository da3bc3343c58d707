//! Per-resource bookkeeping of live blocks, with an optional hard limit on bytes in use.
//!
//! The driver-backed resources (managed, pinned, driver pool) record every block here, so a
//! foreign pointer, a double free or a size mismatch is a typed error raised before the driver
//! sees the pointer, and a request over the limit fails before the driver is asked. Bytes are
//! reserved against the limit *before* the driver call ([`Ledger::admit`]), so concurrent
//! requests can never overshoot it together.

use std::collections::HashMap;
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::sync::lock;
use crate::sync::Mutex;

/// Live blocks and byte counts of one resource (shared by its clones).
#[derive(Debug)]
pub(crate) struct Ledger {
    resource: &'static str,
    limit: Option<usize>,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Address -> requested size.
    live: HashMap<usize, usize>,
    /// Bytes of live blocks plus admitted requests still at the driver.
    in_use: usize,
    /// Highest `in_use` seen.
    peak: usize,
}

/// Bytes admitted against the limit for one request. Dropping it without
/// [`commit`](Admission::commit) gives them back (the driver call failed).
#[must_use]
#[derive(Debug)]
pub(crate) struct Admission<'a> {
    ledger: &'a Ledger,
    bytes: usize,
}

/// True when `bytes` more fit under `limit` with `in_use` already taken.
pub(crate) fn fits(in_use: usize, bytes: usize, limit: Option<usize>) -> bool {
    match limit {
        None => true,
        Some(limit) => in_use
            .checked_add(bytes)
            .is_some_and(|total| total <= limit),
    }
}

impl Ledger {
    pub(crate) fn new(resource: &'static str, limit: Option<usize>) -> Self {
        Ledger {
            resource,
            limit,
            state: Mutex::new(State::default()),
        }
    }

    /// The hard limit on bytes in use, if any.
    pub(crate) fn limit(&self) -> Option<usize> {
        self.limit
    }

    /// Reserves `bytes` against the limit, or fails with [`Error::OutOfMemory`] naming it.
    pub(crate) fn admit(&self, bytes: usize) -> Result<Admission<'_>> {
        let mut s = lock(&self.state);
        if !fits(s.in_use, bytes, self.limit) {
            return Err(self.over_limit(bytes, s.in_use));
        }
        s.in_use += bytes;
        s.peak = s.peak.max(s.in_use);
        Ok(Admission {
            ledger: self,
            bytes,
        })
    }

    /// The error for a request the limit refuses (also used when the driver's own cap refuses).
    pub(crate) fn over_limit(&self, bytes: usize, in_use: usize) -> Error {
        let detail = match self.limit {
            Some(limit) => {
                format!("the hard limit is {limit} bytes and {in_use} bytes are already in use")
            }
            None => format!("{in_use} bytes are already in use"),
        };
        Error::OutOfMemory {
            bytes,
            resource: self.resource,
            detail,
        }
    }

    /// Removes a live block after checking it is ours and of this size. On error nothing changes.
    pub(crate) fn remove(&self, ptr: NonNull<u8>, bytes: usize) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        let mut s = lock(&self.state);
        let allocated = *s.live.get(&addr).ok_or(Error::UnknownPointer {
            resource: self.resource,
            ptr: addr,
        })?;
        if allocated != bytes {
            return Err(Error::SizeMismatch {
                resource: self.resource,
                ptr: addr,
                allocated,
                freed: bytes,
            });
        }
        s.live.remove(&addr);
        s.in_use -= bytes;
        Ok(())
    }

    /// Takes `ptr` out of the ledger, then runs `free`; if `free` fails the block goes back, so
    /// a failed driver call never loses it. Foreign pointers, double frees and size mismatches
    /// are refused before `free` runs.
    pub(crate) fn release(
        &self,
        ptr: NonNull<u8>,
        bytes: usize,
        free: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        self.remove(ptr, bytes)?;
        free().inspect_err(|_| self.restore(ptr, bytes))
    }

    /// Puts back a block that [`remove`](Self::remove) took out but the driver refused to free,
    /// so it is neither lost nor counted twice.
    pub(crate) fn restore(&self, ptr: NonNull<u8>, bytes: usize) {
        let mut s = lock(&self.state);
        if s.live.insert(ptr.as_ptr() as usize, bytes).is_none() {
            s.in_use += bytes;
            s.peak = s.peak.max(s.in_use);
        }
    }

    /// Bytes in live blocks (and in requests still at the driver).
    pub(crate) fn in_use(&self) -> usize {
        lock(&self.state).in_use
    }

    /// Highest [`in_use`](Self::in_use) seen.
    pub(crate) fn peak(&self) -> usize {
        lock(&self.state).peak
    }

    /// Number of live blocks.
    pub(crate) fn count(&self) -> usize {
        lock(&self.state).live.len()
    }
}

impl Admission<'_> {
    /// Records the block the driver returned for this request.
    pub(crate) fn commit(self, ptr: NonNull<u8>) {
        let bytes = self.bytes;
        let ledger = self.ledger;
        std::mem::forget(self);
        lock(&ledger.state)
            .live
            .insert(ptr.as_ptr() as usize, bytes);
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        lock(&self.ledger.state).in_use -= self.bytes;
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ptr(addr: usize) -> NonNull<u8> {
        NonNull::new(addr as *mut u8).unwrap()
    }

    #[test]
    fn limit_arithmetic() {
        assert!(fits(0, usize::MAX, None));
        assert!(fits(10, 90, Some(100)));
        assert!(!fits(10, 91, Some(100)));
        assert!(!fits(1, usize::MAX, Some(usize::MAX)));
        assert!(fits(0, 0, Some(0)));
    }

    #[test]
    fn over_limit_request_names_the_limit_and_changes_nothing() {
        let l = Ledger::new("TestResource", Some(100));
        l.admit(60).unwrap().commit(ptr(0x1000));
        let err = l.admit(41).unwrap_err();
        assert!(err.is_out_of_memory());
        let msg = err.to_string();
        assert!(msg.contains("hard limit is 100 bytes"), "{msg}");
        assert!(msg.contains("60 bytes are already in use"), "{msg}");
        assert_eq!((l.in_use(), l.count()), (60, 1));
        l.admit(40).unwrap().commit(ptr(0x2000));
        assert_eq!((l.in_use(), l.peak()), (100, 100));
    }

    #[test]
    fn failed_driver_call_returns_admitted_bytes() {
        let l = Ledger::new("TestResource", Some(100));
        drop(l.admit(100).unwrap());
        assert_eq!((l.in_use(), l.count(), l.peak()), (0, 0, 100));
        l.admit(100).unwrap().commit(ptr(0x1000));
    }

    #[test]
    fn foreign_double_and_mismatched_frees_are_typed_and_harmless() {
        let l = Ledger::new("TestResource", None);
        l.admit(64).unwrap().commit(ptr(0x1000));
        assert!(matches!(
            l.remove(ptr(0x2000), 64),
            Err(Error::UnknownPointer { ptr: 0x2000, .. })
        ));
        assert!(matches!(
            l.remove(ptr(0x1000), 32),
            Err(Error::SizeMismatch {
                allocated: 64,
                freed: 32,
                ..
            })
        ));
        assert_eq!((l.in_use(), l.count()), (64, 1));
        l.remove(ptr(0x1000), 64).unwrap();
        assert!(matches!(
            l.remove(ptr(0x1000), 64),
            Err(Error::UnknownPointer { .. })
        ));
        assert_eq!((l.in_use(), l.count()), (0, 0));
    }

    #[test]
    fn restore_puts_a_block_back_once() {
        let l = Ledger::new("TestResource", None);
        l.admit(64).unwrap().commit(ptr(0x1000));
        l.remove(ptr(0x1000), 64).unwrap();
        l.restore(ptr(0x1000), 64);
        l.restore(ptr(0x1000), 64);
        assert_eq!((l.in_use(), l.count()), (64, 1));
        l.remove(ptr(0x1000), 64).unwrap();
    }

    #[test]
    fn threads_never_overshoot_the_limit() {
        const LIMIT: usize = 1 << 20;
        let l = std::sync::Arc::new(Ledger::new("TestResource", Some(LIMIT)));
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                let l = l.clone();
                std::thread::spawn(move || {
                    let mut mine = Vec::new();
                    let mut refused = 0;
                    for i in 0..5_000usize {
                        let bytes = 1 + (i * 7919 + t * 104_729) % (LIMIT / 8);
                        let addr = ((t + 1) << 40) | (i << 8);
                        match l.admit(bytes) {
                            Ok(a) => {
                                a.commit(ptr(addr));
                                mine.push((addr, bytes));
                            }
                            Err(e) => {
                                assert!(e.is_out_of_memory());
                                refused += 1;
                            }
                        }
                        assert!(l.in_use() <= LIMIT);
                        if i % 3 != 0 {
                            if let Some((addr, bytes)) = mine.pop() {
                                l.remove(ptr(addr), bytes).unwrap();
                            }
                        }
                    }
                    for (addr, bytes) in mine {
                        l.remove(ptr(addr), bytes).unwrap();
                    }
                    refused
                })
            })
            .collect();
        let refused: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert!(refused > 0, "the workload must press against the limit");
        assert_eq!((l.in_use(), l.count()), (0, 0));
        assert!(l.peak() <= LIMIT);
    }

    proptest! {
        /// Against a model: in-use bytes equal the live blocks' sum, never pass the limit, and
        /// every refused or bad operation leaves the state as it was.
        #[test]
        fn matches_a_model(limit in 1usize..10_000, ops in prop::collection::vec((any::<bool>(), 1usize..4_000, 0usize..16), 1..200)) {
            let l = Ledger::new("TestResource", Some(limit));
            let mut model: HashMap<usize, usize> = HashMap::new();
            for (alloc, bytes, slot) in ops {
                let addr = (slot + 1) << 12;
                let used: usize = model.values().sum();
                if alloc && !model.contains_key(&addr) {
                    let ok = l.admit(bytes).map(|a| a.commit(ptr(addr))).is_ok();
                    prop_assert_eq!(ok, used + bytes <= limit);
                    if ok { model.insert(addr, bytes); }
                } else {
                    let expect_ok = model.get(&addr) == Some(&bytes);
                    prop_assert_eq!(l.remove(ptr(addr), bytes).is_ok(), expect_ok);
                    if expect_ok { model.remove(&addr); }
                }
                prop_assert_eq!(l.in_use(), model.values().sum::<usize>());
                prop_assert_eq!(l.count(), model.len());
                prop_assert!(l.in_use() <= limit);
            }
        }
    }
}

#[cfg(all(test, carve_loom))]
mod loom_tests {
    use super::*;

    /// Two threads race for a limit that fits one request: exactly one wins, and the loser's
    /// refusal leaves the count exact.
    #[test]
    fn racing_admissions_respect_the_limit() {
        loom::model(|| {
            let l = crate::sync::Arc::new(Ledger::new("TestResource", Some(100)));
            let handles: Vec<_> = (1..=2usize)
                .map(|t| {
                    let l = l.clone();
                    loom::thread::spawn(move || {
                        l.admit(60)
                            .map(|a| a.commit(NonNull::new((t << 12) as *mut u8).unwrap()))
                            .is_ok()
                    })
                })
                .collect();
            let wins = handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .filter(|&w| w)
                .count();
            assert_eq!(wins, 1);
            assert_eq!((l.in_use(), l.count()), (60, 1));
        });
    }
}
