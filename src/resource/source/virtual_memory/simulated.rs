//! [`SimulatedBacking`]: address-only virtual memory that maps nothing but checks every call as
//! the driver would.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use cudarc::driver::sys::CUresult;
use cudarc::driver::DriverError;

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::error::{Error, Result};
use crate::resource::memory_resource::Properties;
use crate::resource::FaultPattern;
use crate::sync::lock;

/// Where simulated reservations start: far from null and from [`SimulatedMemoryResource`]'s
/// range (1 TiB).
///
/// [`SimulatedMemoryResource`]: crate::resource::SimulatedMemoryResource
const SIMULATED_BASE: usize = 1 << 44;

/// Address-only virtual memory: reservations are fake address ranges, chunks are numbers
/// counted against a physical capacity, and mappings are bookkeeping. Every call is checked as
/// the driver would check it (alignment, overlapping maps, unmapping part of a mapping,
/// releasing a mapped chunk), so a resource over it is tested for the calls it would make on a
/// GPU; the mapped memory must never be dereferenced.
#[derive(Debug)]
pub struct SimulatedBacking {
    granularity: usize,
    capacity: usize,
    state: Mutex<SimState>,
}

#[derive(Debug, Default)]
struct SimState {
    next_va: usize,
    /// Reservation start -> size.
    reservations: BTreeMap<usize, usize>,
    /// Handle -> (size, times mapped now).
    chunks: HashMap<PhysicalHandle, (usize, u32)>,
    /// Mapping start -> (size, handle).
    maps: BTreeMap<usize, (usize, PhysicalHandle)>,
    next_handle: PhysicalHandle,
    physical: usize,
    counters: BackingCounters,
    faults: BackingFaults,
    /// `unmap` and `release` calls since the faults were set.
    unmap_calls: u64,
    release_calls: u64,
}

/// Which of a [`SimulatedBacking`]'s calls the driver refuses (`CUDA_ERROR_UNKNOWN`, nothing
/// changed), for tests of what a resource does when an unmap or a release fails.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackingFaults {
    /// `unmap` calls that fail, numbered from 1 since [`SimulatedBacking::set_faults`].
    pub unmaps: FaultPattern,
    /// `release` calls that fail, numbered likewise.
    pub releases: FaultPattern,
}

/// What a [`SimulatedBacking`] was asked to do, for tests and reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackingCounters {
    /// Successful `create` calls.
    pub creates: u64,
    /// `release` calls.
    pub releases: u64,
    /// Successful `map` calls.
    pub maps: u64,
    /// `unmap` calls.
    pub unmaps: u64,
    /// Successful `set_access` calls (one may cover many mappings).
    pub access_grants: u64,
    /// Physical bytes held now.
    pub physical: usize,
    /// The most physical bytes held at once.
    pub peak_physical: usize,
    /// Time spent in those calls (filled in by [`super::CountingBacking`]; zero here).
    pub time: CallTimes,
}

/// Wall time spent in a backing's calls, by kind, successful or not: on a GPU, what growing and
/// moving pages cost beyond the resource's own bookkeeping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallTimes {
    /// In `create`.
    pub create: std::time::Duration,
    /// In `release`.
    pub release: std::time::Duration,
    /// In `map`.
    pub map: std::time::Duration,
    /// In `unmap`.
    pub unmap: std::time::Duration,
    /// In `set_access`.
    pub access: std::time::Duration,
}

impl CallTimes {
    /// All calls together.
    pub fn total(&self) -> std::time::Duration {
        self.create + self.release + self.map + self.unmap + self.access
    }
}

impl SimulatedBacking {
    /// A simulated device with `capacity` bytes of physical memory (rounded down to the
    /// granularity, a power of two, e.g. 2 MiB as on current GPUs).
    pub fn new(capacity: usize, granularity: usize) -> Result<Self> {
        if !granularity.is_power_of_two() || granularity < 256 {
            return Err(Error::InvalidArgument(format!(
                "simulated granularity {granularity}: a power of two of at least 256"
            )));
        }
        let capacity = capacity & !(granularity - 1);
        if capacity == 0 || capacity > 1 << 46 {
            return Err(Error::InvalidArgument(format!(
                "simulated capacity must be between one granule ({granularity} bytes) and 64 TiB"
            )));
        }
        Ok(SimulatedBacking {
            granularity,
            capacity,
            state: Mutex::new(SimState {
                next_va: SIMULATED_BASE,
                next_handle: 1,
                ..SimState::default()
            }),
        })
    }

    /// The physical capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Calls so far, and physical bytes held.
    pub fn counters(&self) -> BackingCounters {
        lock(&self.state).counters
    }

    /// Makes the calls `faults` picks fail from now on (call numbers restart at 1).
    pub fn set_faults(&self, faults: BackingFaults) {
        let mut s = lock(&self.state);
        s.faults = faults;
        (s.unmap_calls, s.release_calls) = (0, 0);
    }

    /// Chunks created and not released.
    pub fn live_chunks(&self) -> usize {
        lock(&self.state).chunks.len()
    }

    /// Reservations live now.
    pub fn live_reservations(&self) -> usize {
        lock(&self.state).reservations.len()
    }

    /// Mappings live now.
    pub fn live_mappings(&self) -> usize {
        lock(&self.state).maps.len()
    }

    fn check_aligned(&self, what: &str, value: usize) -> Result<()> {
        if value % self.granularity != 0 || value == 0 {
            return Err(Error::InvalidArgument(format!(
                "SimulatedBacking: {what} {value:#x} is not a non-zero multiple of the granularity \
                 {}",
                self.granularity
            )));
        }
        Ok(())
    }
}

/// An injected driver failure of `call`.
fn injected(call: &'static str) -> Error {
    Error::driver(call, DriverError(CUresult::CUDA_ERROR_UNKNOWN))
}

fn bad(why: String) -> Error {
    Error::InvalidArgument(format!("SimulatedBacking: {why}"))
}

// SAFETY: reservations are disjoint fake ranges above 2^44 (bumped, never reused); chunks are
// counted against the capacity; mappings are checked to lie in a reservation and not overlap.
// Nothing is accessible, as `properties` says.
unsafe impl PhysicalBacking for SimulatedBacking {
    fn granularity(&self) -> usize {
        self.granularity
    }

    fn properties(&self) -> Properties {
        Properties {
            device_accessible: false,
            host_accessible: false,
        }
    }

    fn reserve(&self, size: usize, align: usize) -> Result<usize> {
        self.check_aligned("reservation size", size)?;
        self.check_aligned("reservation alignment", align)?;
        if !align.is_power_of_two() {
            return Err(bad(format!("reservation alignment {align}")));
        }
        let mut s = lock(&self.state);
        let va = s.next_va.next_multiple_of(align);
        let end = va
            .checked_add(size)
            .filter(|&e| e <= isize::MAX as usize)
            .ok_or_else(|| bad(format!("no address space left for {size} bytes")))?;
        s.next_va = end;
        s.reservations.insert(va, size);
        Ok(va)
    }

    unsafe fn free_reservation(&self, va: usize, size: usize) -> Result<()> {
        let mut s = lock(&self.state);
        if s.reservations.get(&va) != Some(&size) {
            return Err(bad(format!("{va:#x}+{size} is not a reservation")));
        }
        if s.maps.range(va..va + size).next().is_some() {
            return Err(bad(format!("reservation {va:#x} still has mappings")));
        }
        s.reservations.remove(&va);
        Ok(())
    }

    fn create(&self, size: usize) -> Result<PhysicalHandle> {
        self.check_aligned("chunk size", size)?;
        let mut s = lock(&self.state);
        if s.physical + size > self.capacity {
            return Err(Error::OutOfMemory {
                bytes: size,
                resource: "SimulatedBacking",
                detail: format!(
                    "{} of {} physical bytes are in chunks",
                    s.physical, self.capacity
                ),
            });
        }
        let h = s.next_handle;
        s.next_handle += 1;
        s.chunks.insert(h, (size, 0));
        s.physical += size;
        s.counters.creates += 1;
        s.counters.physical = s.physical;
        s.counters.peak_physical = s.counters.peak_physical.max(s.physical);
        Ok(h)
    }

    unsafe fn release(&self, handle: PhysicalHandle, size: usize) -> Result<()> {
        let mut s = lock(&self.state);
        s.release_calls += 1;
        if s.faults.releases.fails(s.release_calls) {
            return Err(injected("cuMemRelease"));
        }
        match s.chunks.get(&handle) {
            None => return Err(bad(format!("release of unknown chunk {handle}"))),
            Some(&(_, mapped)) if mapped > 0 => {
                return Err(bad(format!("release of chunk {handle} while mapped")))
            }
            Some(&(cs, _)) if cs != size => {
                return Err(bad(format!(
                    "release of chunk {handle} as {size} bytes, not {cs}"
                )))
            }
            Some(_) => {}
        }
        let (size, _) = s.chunks.remove(&handle).expect("checked above");
        s.physical -= size;
        s.counters.releases += 1;
        s.counters.physical = s.physical;
        Ok(())
    }

    unsafe fn map(&self, va: usize, size: usize, handle: PhysicalHandle) -> Result<()> {
        self.check_aligned("mapping address", va)?;
        self.check_aligned("mapping size", size)?;
        let mut s = lock(&self.state);
        let end = va + size;
        let inside = s
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&r, &rs)| end <= r + rs);
        if !inside {
            return Err(bad(format!(
                "mapping {va:#x}+{size} outside any reservation"
            )));
        }
        let overlaps = s
            .maps
            .range(..end)
            .next_back()
            .is_some_and(|(&m, &(ms, _))| m + ms > va);
        if overlaps {
            return Err(bad(format!("mapping {va:#x}+{size} overlaps a mapping")));
        }
        match s.chunks.get_mut(&handle) {
            Some((cs, n)) if *cs == size => *n += 1,
            Some(_) => return Err(bad(format!("chunk {handle} is not {size} bytes"))),
            None => return Err(bad(format!("map of unknown chunk {handle}"))),
        }
        s.maps.insert(va, (size, handle));
        s.counters.maps += 1;
        Ok(())
    }

    unsafe fn set_access(&self, va: usize, size: usize) -> Result<()> {
        let mut s = lock(&self.state);
        // Every byte must be mapped: walk the mappings from `va`.
        let mut at = va;
        let end = va + size;
        while at < end {
            match s.maps.range(..=at).next_back() {
                Some((&m, &(ms, _))) if m + ms > at => at = m + ms,
                _ => return Err(bad(format!("set_access over {at:#x}, which is not mapped"))),
            }
        }
        s.counters.access_grants += 1;
        Ok(())
    }

    unsafe fn unmap(&self, va: usize, size: usize) -> Result<()> {
        let mut s = lock(&self.state);
        s.unmap_calls += 1;
        if s.faults.unmaps.fails(s.unmap_calls) {
            return Err(injected("cuMemUnmap"));
        }
        let Some(&(ms, h)) = s.maps.get(&va) else {
            return Err(bad(format!("unmap of {va:#x}, which is not a mapping")));
        };
        if ms != size {
            return Err(bad(format!(
                "unmap of {va:#x}+{size}, but the mapping is {ms} bytes"
            )));
        }
        s.maps.remove(&va);
        if let Some((_, n)) = s.chunks.get_mut(&h) {
            *n -= 1;
        }
        s.counters.unmaps += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: usize = 2 << 20;

    #[test]
    fn checks_calls_as_the_driver_would() {
        let b = SimulatedBacking::new(4 * G, G).unwrap();
        let va = b.reserve(8 * G, 4 * G).unwrap();
        assert_eq!(va % (4 * G), 0);
        assert_eq!(va % G, 0);
        let h = b.create(G).unwrap();
        // SAFETY: simulated; nothing is dereferenced. The calls are checked, not trusted.
        unsafe {
            assert!(b.map(va + 1, G, h).is_err(), "unaligned");
            assert!(b.map(va + 8 * G, G, h).is_err(), "outside the reservation");
            assert!(b.map(va, 2 * G, h).is_err(), "size is not the chunk's");
            b.map(va, G, h).unwrap();
            b.set_access(va, G).unwrap();
            assert!(b.set_access(va, 2 * G).is_err(), "not wholly mapped");
            let h2 = b.create(G).unwrap();
            assert!(b.map(va, G, h2).is_err(), "overlap");
            assert!(b.release(h, G).is_err(), "mapped");
            assert!(b.free_reservation(va, 8 * G).is_err(), "has mappings");
            assert!(b.unmap(va, 2 * G).is_err(), "part of a mapping");
            b.unmap(va, G).unwrap();
            b.release(h, G).unwrap();
            b.release(h2, G).unwrap();
            b.free_reservation(va, 8 * G).unwrap();
        }
        let c = b.counters();
        assert_eq!((c.creates, c.releases, c.maps, c.unmaps), (2, 2, 1, 1));
        assert_eq!(c.access_grants, 1, "the refused grant is not counted");
        assert_eq!((c.physical, c.peak_physical), (0, 2 * G));
    }

    #[test]
    fn capacity_is_physical_only() {
        let b = SimulatedBacking::new(2 * G, G).unwrap();
        let _va = b.reserve(1 << 40, G).unwrap();
        let _x = b.create(G).unwrap();
        let _y = b.create(G).unwrap();
        assert!(b.create(G).unwrap_err().is_out_of_memory());
        assert!(SimulatedBacking::new(G, 3).is_err());
        assert!(SimulatedBacking::new(G - 1, G).is_err());
    }
}
