//! A range of address space reserved once, with physical chunks mapped at offsets the caller
//! chooses: what a growable general heap needs, since each class grows inside its own stride
//! (a [`VirtualMemoryResource`](crate::VirtualMemoryResource) places blocks itself).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::resource::{PhysicalBacking, PhysicalHandle};

/// Reserved address space and the mappings in it; everything is unmapped, released and the
/// reservation returned on drop (the owner waits for the device first).
#[derive(Debug)]
pub(super) struct MappedRange<B: PhysicalBacking> {
    backing: B,
    base: usize,
    size: usize,
    /// Offset → (length, handle): one physical allocation per mapping.
    maps: BTreeMap<usize, (usize, PhysicalHandle)>,
    mapped: usize,
}

impl<B: PhysicalBacking> MappedRange<B> {
    /// Reserves `size` bytes (rounded up to the granularity) aligned to the granularity.
    pub(super) fn new(backing: B, size: usize) -> Result<Self> {
        let g = backing.granularity();
        let size = size
            .checked_next_multiple_of(g)
            .ok_or(Error::SizeOverflow {
                bytes: size,
                align: g,
            })?;
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let base = backing.reserve(size, g)?;
        Ok(MappedRange {
            backing,
            base,
            size,
            maps: BTreeMap::new(),
            mapped: 0,
        })
    }

    /// The start of the reservation.
    pub(super) fn base(&self) -> usize {
        self.base
    }

    /// The mapping unit.
    pub(super) fn granularity(&self) -> usize {
        self.backing.granularity()
    }

    /// Physical bytes mapped now.
    pub(super) fn mapped(&self) -> usize {
        self.mapped
    }

    /// Maps `len` new bytes at `offset` (both multiples of the granularity, inside the range,
    /// over nothing mapped) with device access. On failure nothing stays mapped or created.
    pub(super) fn map(&mut self, offset: usize, len: usize) -> Result<()> {
        let g = self.granularity();
        let end = offset.checked_add(len);
        if len == 0 || offset % g != 0 || len % g != 0 || end.is_none_or(|e| e > self.size) {
            return Err(Error::InvalidArgument(format!(
                "a mapping of {len} bytes at offset {offset} of a {} byte range (granularity {g})",
                self.size
            )));
        }
        let end = offset + len;
        let before = self.maps.range(..end).next_back();
        if before.is_some_and(|(&o, &(l, _))| o + l > offset) {
            return Err(Error::InvalidArgument(format!(
                "a mapping at offset {offset} overlaps one already there"
            )));
        }
        let h = self.backing.create(len)?;
        let va = self.base + offset;
        // SAFETY: [va, va + len) lies in our reservation, is aligned and has nothing mapped
        // (checked above); `h` is a fresh chunk of `len` bytes.
        if let Err(e) = unsafe { self.backing.map(va, len, h) } {
            // SAFETY: created above, mapped nowhere.
            let _ = unsafe { self.backing.release(h, len) };
            return Err(e);
        }
        // SAFETY: the range was just mapped whole.
        if let Err(e) = unsafe { self.backing.set_access(va, len) } {
            // SAFETY: the mapping above, never used (no access was granted); then its chunk.
            let _ = unsafe { self.backing.unmap(va, len) };
            // SAFETY: unmapped just above.
            let _ = unsafe { self.backing.release(h, len) };
            return Err(e);
        }
        self.maps.insert(offset, (len, h));
        self.mapped += len;
        Ok(())
    }

    /// Unmaps and releases the mapping that starts at `offset`; returns its length.
    ///
    /// # Safety
    /// No queued or running work and no live pointer uses the mapping.
    pub(super) unsafe fn unmap(&mut self, offset: usize) -> Result<usize> {
        let Some(&(len, h)) = self.maps.get(&offset) else {
            return Err(Error::InvalidArgument(format!(
                "no mapping starts at offset {offset}"
            )));
        };
        // SAFETY: exactly one earlier map; the caller vouches that nothing uses it.
        unsafe { self.backing.unmap(self.base + offset, len) }?;
        self.maps.remove(&offset);
        self.mapped -= len;
        // SAFETY: unmapped above, never used again.
        unsafe { self.backing.release(h, len) }?;
        Ok(len)
    }
}

impl<B: PhysicalBacking> Drop for MappedRange<B> {
    fn drop(&mut self) {
        let offsets: Vec<usize> = self.maps.keys().copied().collect();
        for o in offsets {
            // SAFETY: the owner waited for the device before dropping us; nothing uses the range.
            let r = unsafe { self.unmap(o) };
            crate::deferred::record("MappedRange drop: unmapping a chunk", r.map(drop));
        }
        if self.maps.is_empty() {
            // SAFETY: our reservation, with nothing mapped in it; never used again.
            let r = unsafe { self.backing.free_reservation(self.base, self.size) };
            crate::deferred::record("MappedRange drop: returning the reservation", r);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resource::SimulatedBacking;
    use std::sync::Arc;

    const G: usize = 2 << 20;

    #[test]
    fn maps_where_asked_and_releases_everything() {
        let b = Arc::new(SimulatedBacking::new(64 * G, G).unwrap());
        let mut r = MappedRange::new(b.clone(), 100 * G + 1).unwrap();
        assert_eq!(r.base() % G, 0);
        r.map(0, G).unwrap();
        r.map(10 * G, 3 * G).unwrap();
        assert_eq!(r.mapped(), 4 * G);
        // Overlaps, misalignment, out of range, zero: typed errors, nothing created.
        let creates = b.counters().creates;
        for (o, l) in [
            (11 * G, G),
            (9 * G, 2 * G),
            (G / 2, G),
            (G, G / 2),
            (101 * G, G),
            (100 * G, 2 * G),
            (G, 0),
            (usize::MAX - G + 1, G),
        ] {
            assert!(
                matches!(r.map(o, l), Err(Error::InvalidArgument(_))),
                "{o} {l}"
            );
        }
        assert_eq!(b.counters().creates, creates);
        // Adjacent mappings are fine.
        r.map(13 * G, G).unwrap();
        r.map(9 * G, G).unwrap();
        // SAFETY: simulated memory; nothing uses it.
        assert_eq!(unsafe { r.unmap(10 * G) }.unwrap(), 3 * G);
        // SAFETY: as above.
        assert!(unsafe { r.unmap(10 * G) }.is_err());
        assert_eq!(r.mapped(), 3 * G);
        assert_eq!(b.live_mappings(), 3);
        // Out of physical memory: typed, nothing left behind.
        let e = r.map(20 * G, 80 * G).unwrap_err();
        assert!(e.is_out_of_memory(), "{e}");
        assert_eq!(b.live_mappings(), 3);
        drop(r);
        let c = b.counters();
        assert_eq!(b.live_mappings(), 0);
        assert_eq!(c.physical, 0);
        assert_eq!(c.creates, c.releases);
        assert_eq!(c.maps, c.unmaps);
    }
}
