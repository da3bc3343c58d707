//! Address -> slab lookup for frees, readable without locks: a sorted array of slab bases under
//! a sequence lock. Slabs are only ever added (under the refill lock, the single writer), so
//! readers almost never retry, and they share the array's cache lines read-only.

use crate::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};
use crate::sync::spin_loop;

#[derive(Debug)]
pub(crate) struct SlabLookup {
    version: AtomicUsize,
    len: AtomicUsize,
    bases: Box<[AtomicUsize]>,
    slabs: Box<[AtomicU32]>,
}

impl SlabLookup {
    pub fn with_capacity(cap: usize) -> Self {
        SlabLookup {
            version: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            bases: (0..cap).map(|_| AtomicUsize::new(0)).collect(),
            slabs: (0..cap).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Adds a slab. The caller is the only writer (it holds the refill lock) and has checked
    /// capacity.
    pub fn insert(&self, base: usize, slab: u32) {
        let n = self.len.load(Ordering::Relaxed);
        debug_assert!(n < self.bases.len());
        let v = self.version.load(Ordering::Relaxed);
        self.version.store(v.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let mut pos = n;
        while pos > 0 && self.bases[pos - 1].load(Ordering::Relaxed) > base {
            let (b, s) = (&self.bases[pos - 1], &self.slabs[pos - 1]);
            self.bases[pos].store(b.load(Ordering::Relaxed), Ordering::Relaxed);
            self.slabs[pos].store(s.load(Ordering::Relaxed), Ordering::Relaxed);
            pos -= 1;
        }
        self.bases[pos].store(base, Ordering::Relaxed);
        self.slabs[pos].store(slab, Ordering::Relaxed);
        self.len.store(n + 1, Ordering::Relaxed);
        self.version.store(v.wrapping_add(2), Ordering::Release);
    }

    /// The slab with the greatest base not above `addr`, with that base.
    pub fn find(&self, addr: usize) -> Option<(usize, u32)> {
        loop {
            let v1 = self.version.load(Ordering::Acquire);
            if v1 & 1 == 1 {
                spin_loop();
                continue;
            }
            let n = self.len.load(Ordering::Relaxed).min(self.bases.len());
            let (mut lo, mut hi) = (0, n);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if self.bases[mid].load(Ordering::Relaxed) <= addr {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            let found = (lo > 0).then(|| {
                (
                    self.bases[lo - 1].load(Ordering::Relaxed),
                    self.slabs[lo - 1].load(Ordering::Relaxed),
                )
            });
            fence(Ordering::Acquire);
            if self.version.load(Ordering::Relaxed) == v1 {
                return found;
            }
        }
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;

    #[test]
    fn finds_the_slab_below_an_address() {
        let l = SlabLookup::with_capacity(4);
        assert_eq!(l.find(100), None);
        l.insert(3000, 0);
        l.insert(1000, 1);
        l.insert(2000, 2);
        assert_eq!(l.find(999), None);
        assert_eq!(l.find(1000), Some((1000, 1)));
        assert_eq!(l.find(2999), Some((2000, 2)));
        assert_eq!(l.find(9999), Some((3000, 0)));
    }
}
