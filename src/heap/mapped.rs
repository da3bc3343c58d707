//! A range of address space reserved once, with physical chunks mapped at offsets the caller
//! chooses: what a growable general heap needs, since each class grows inside its own stride
//! (a [`VirtualMemoryResource`](crate::VirtualMemoryResource) places blocks itself).

use std::collections::BTreeMap;

use crate::error::{Error, Result};
use crate::resource::{PhysicalBacking, PhysicalHandle};

/// Reserved address space and the mappings in it; everything is unmapped, released and the
/// reservation returned on drop, once the owner's wait for the device succeeded
/// ([`MappedRange::after_wait`]).
#[derive(Debug)]
pub(super) struct MappedRange<B: PhysicalBacking> {
    backing: B,
    base: usize,
    size: usize,
    /// Offset → (length, handle): one physical allocation per mapping.
    maps: BTreeMap<usize, (usize, PhysicalHandle)>,
    mapped: usize,
    /// Chunks out of `maps` whose unmap or release the backing refused: tried again by the next
    /// [`unmap`](MappedRange::unmap) and at drop.
    refused: Vec<Refused>,
    /// The owner's wait for the device failed: drop leaves everything as it is.
    leak: bool,
}

/// A chunk the backing did not take back.
#[derive(Clone, Copy, Debug)]
struct Refused {
    handle: PhysicalHandle,
    len: usize,
    /// Where it is still mapped (never used: its access grant or its unmap failed).
    mapped_at: Option<usize>,
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
            refused: Vec::new(),
            leak: false,
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

    /// Physical bytes held now: mapped, or refused by the backing and not yet taken back.
    pub(super) fn held(&self) -> usize {
        self.mapped + self.refused.iter().map(|r| r.len).sum::<usize>()
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
            // SAFETY: created above, mapped nowhere. The map's error is the one to report.
            let _ = unsafe { self.drop_chunk(h, len, None) };
            return Err(e);
        }
        // SAFETY: the range was just mapped whole.
        if let Err(e) = unsafe { self.backing.set_access(va, len) } {
            // SAFETY: the mapping above, never used (no access was granted). The grant's error
            // is the one to report.
            let _ = unsafe { self.drop_chunk(h, len, Some(va)) };
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
        // Chunks refused again stay for the next try; this call reports on its own mapping.
        let _ = self.retry_refused();
        // SAFETY: exactly one earlier map; the caller vouches that nothing uses it.
        unsafe { self.backing.unmap(self.base + offset, len) }?;
        self.maps.remove(&offset);
        self.mapped -= len;
        // SAFETY: unmapped above, never used again.
        unsafe { self.drop_chunk(h, len, None) }?;
        Ok(len)
    }

    /// Leaves everything mapped and reserved at drop when the owner's wait for the device
    /// failed (queued work may still use the range), recording the failure.
    pub(super) fn after_wait(&mut self, synced: Result<()>) {
        self.leak = synced.is_err();
        crate::deferred::record("DeviceHeap drop: waiting to unmap a general heap", synced);
    }

    /// Unmaps chunk `h` of `len` bytes from `mapped_at` (when mapped) and releases it; whatever
    /// the backing refuses stays in `refused`.
    ///
    /// # Safety
    /// `mapped_at` is exactly one earlier map of `h`, which nothing uses; `maps` no longer
    /// holds `h`.
    unsafe fn drop_chunk(
        &mut self,
        h: PhysicalHandle,
        len: usize,
        mapped_at: Option<usize>,
    ) -> Result<()> {
        if let Some(va) = mapped_at {
            // SAFETY: the caller's contract.
            if let Err(e) = unsafe { self.backing.unmap(va, len) } {
                self.refused.push(Refused {
                    handle: h,
                    len,
                    mapped_at,
                });
                return Err(e);
            }
        }
        // SAFETY: unmapped (above, or by the caller) and referenced nowhere else.
        if let Err(e) = unsafe { self.backing.release(h, len) } {
            self.refused.push(Refused {
                handle: h,
                len,
                mapped_at: None,
            });
            return Err(e);
        }
        Ok(())
    }

    /// Tries again to take back the chunks the backing refused; the first refusal (every one is
    /// tried, and those refused again stay).
    fn retry_refused(&mut self) -> Result<()> {
        let mut first = None;
        for r in std::mem::take(&mut self.refused) {
            // SAFETY: each is out of `maps`, never used since its failed call.
            if let Err(e) = unsafe { self.drop_chunk(r.handle, r.len, r.mapped_at) } {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

impl<B: PhysicalBacking> Drop for MappedRange<B> {
    fn drop(&mut self) {
        if self.leak {
            return;
        }
        let r = self.retry_refused();
        crate::deferred::record("MappedRange drop: unmapping a chunk", r);
        let offsets: Vec<usize> = self.maps.keys().copied().collect();
        for o in offsets {
            // SAFETY: the owner waited for the device before dropping us; nothing uses the range.
            let r = unsafe { self.unmap(o) };
            crate::deferred::record("MappedRange drop: unmapping a chunk", r.map(drop));
        }
        if self.maps.is_empty() && self.refused.iter().all(|r| r.mapped_at.is_none()) {
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
        assert_eq!(r.held(), 4 * G);
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
        assert_eq!(r.held(), 3 * G);
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

    fn held(b: &SimulatedBacking) -> (usize, usize, usize) {
        (b.live_chunks(), b.live_mappings(), b.live_reservations())
    }

    /// A chunk unmapped whose release the backing refuses stays in the books: the range
    /// releases it later, and at drop.
    #[test]
    fn a_chunk_whose_release_fails_is_released_later() {
        let b = Arc::new(SimulatedBacking::new(64 * G, G).unwrap());
        let mut r = MappedRange::new(b.clone(), 16 * G).unwrap();
        r.map(0, G).unwrap();
        r.map(4 * G, 2 * G).unwrap();
        b.set_faults(crate::resource::BackingFaults {
            releases: crate::adaptor::FaultPattern::Nth(1),
            ..Default::default()
        });
        // SAFETY: simulated memory; nothing uses it.
        assert!(unsafe { r.unmap(0) }.is_err());
        assert_eq!(held(&b), (2, 1, 1));
        drop(r);
        assert_eq!(
            held(&b),
            (0, 0, 0),
            "the refused chunk was released at drop"
        );
    }

    /// After a failed wait for the device, queued work may still use the range: nothing is
    /// unmapped or released, and the failure is recorded.
    #[test]
    fn a_failed_wait_before_drop_leaks_every_chunk() {
        let b = Arc::new(SimulatedBacking::new(64 * G, G).unwrap());
        let mut r = MappedRange::new(b.clone(), 16 * G).unwrap();
        r.map(0, G).unwrap();
        r.map(4 * G, 2 * G).unwrap();
        let errors = crate::deferred_error_count();
        let failed = Error::driver(
            "cuCtxSynchronize",
            cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_LAUNCH_FAILED),
        );
        r.after_wait(Err(failed));
        drop(r);
        assert_eq!(held(&b), (2, 2, 1), "everything leaked");
        assert_eq!(b.counters().unmaps, 0);
        // Other tests may record errors concurrently: at least this one was.
        assert!(crate::deferred_error_count() > errors);
        // A successful wait drops as before.
        let mut r = MappedRange::new(b.clone(), 16 * G).unwrap();
        r.map(0, G).unwrap();
        r.after_wait(Ok(()));
        drop(r);
        assert_eq!(held(&b), (2, 2, 1), "only the leaked range is left");
    }
}
