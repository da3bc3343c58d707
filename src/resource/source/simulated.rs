//! Address-only memory: a resource that hands out fake addresses inside a fixed capacity and never
//! touches memory. It answers "would this workload fit on a card of N GiB?" with no GPU, on its own
//! (as a best-fit allocator with coalescing, much like the driver's) or as the upstream of a
//! suballocator, which never writes into its upstream's memory either.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::resource::memory_resource::{
    align_up, check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT,
};
use crate::stream::StreamRef;
use crate::sync::lock;

const NAME: &str = "SimulatedMemoryResource";

/// Where the fake address range starts: 1 TiB, aligned to any alignment a request can sensibly
/// ask for, and far from null.
const BASE: usize = 1 << 40;

/// Fake memory of a fixed capacity. Its pointers must never be dereferenced: its
/// [`properties`](MemoryResource::properties) say neither host nor device may access them.
///
/// Sizes are rounded up to 256 bytes, as the driver does. Allocation is best fit over a free list
/// kept by size and by address (O(log n)), and frees coalesce with their neighbours, so it
/// reports real fragmentation. Foreign pointers, double frees and size mismatches are refused.
#[derive(Clone, Debug)]
pub struct SimulatedMemoryResource {
    inner: Arc<Mutex<Arena>>,
    capacity: usize,
}

#[derive(Debug, Default)]
struct Arena {
    /// Free ranges: start -> length.
    by_addr: BTreeMap<usize, usize>,
    /// The same free ranges as (length, start), for best fit.
    by_size: BTreeSet<(usize, usize)>,
    /// Live blocks: start -> (requested bytes, reserved length).
    live: HashMap<usize, (usize, usize)>,
    used: usize,
    peak: usize,
}

/// A snapshot of a simulated resource's occupancy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimulatedUsage {
    /// The simulated capacity in bytes.
    pub capacity: usize,
    /// Bytes reserved by live blocks (rounded sizes).
    pub used: usize,
    /// The highest bytes in use.
    pub peak: usize,
    /// The largest free hole.
    pub largest_free: usize,
    /// Blocks allocated and not yet freed.
    pub live_blocks: usize,
}

impl SimulatedUsage {
    /// Free bytes.
    pub fn free(&self) -> usize {
        self.capacity - self.used
    }

    /// `1 - largest free range / free bytes`: 0 when the free space is one range, near 1 when
    /// it is shattered.
    pub fn fragmentation(&self) -> f64 {
        match self.free() {
            0 => 0.0,
            free => 1.0 - self.largest_free as f64 / free as f64,
        }
    }
}

impl Arena {
    fn insert_free(&mut self, start: usize, len: usize) {
        if len > 0 {
            self.by_addr.insert(start, len);
            self.by_size.insert((len, start));
        }
    }

    fn remove_free(&mut self, start: usize, len: usize) {
        self.by_addr.remove(&start);
        self.by_size.remove(&(len, start));
    }

    fn largest_free(&self) -> usize {
        self.by_size.last().map_or(0, |&(len, _)| len)
    }
}

impl SimulatedMemoryResource {
    /// `capacity` bytes of fake memory (rounded down to 256).
    pub fn new(capacity: usize) -> Result<Self> {
        let capacity = capacity & !(DEFAULT_ALIGNMENT - 1);
        if capacity == 0 || capacity > isize::MAX as usize - BASE {
            return Err(Error::InvalidArgument(format!(
                "simulated capacity must be between 256 bytes and {} bytes, not {capacity}",
                isize::MAX as usize - BASE
            )));
        }
        let mut arena = Arena::default();
        arena.insert_free(BASE, capacity);
        Ok(Self {
            inner: Arc::new(Mutex::new(arena)),
            capacity,
        })
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Occupancy now.
    pub fn usage(&self) -> SimulatedUsage {
        let a = lock(&self.inner);
        SimulatedUsage {
            capacity: self.capacity,
            used: a.used,
            peak: a.peak,
            largest_free: a.largest_free(),
            live_blocks: a.live.len(),
        }
    }
}

// SAFETY: the address ranges handed out are disjoint sub-ranges of [BASE, BASE + capacity),
// aligned as asked. They are never dereferenceable, which `properties()` states; callers that
// honour properties (and suballocators, which only do address arithmetic) never touch them.
unsafe impl MemoryResource for SimulatedMemoryResource {
    fn allocate(&self, _stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, DEFAULT_ALIGNMENT)?;
        let len = align_up(bytes, DEFAULT_ALIGNMENT).ok_or(Error::SizeOverflow { bytes, align })?;
        // Any free range this long has an `align`-aligned start with `len` bytes after it.
        let need = len
            .checked_add(align - DEFAULT_ALIGNMENT)
            .ok_or(Error::SizeOverflow { bytes, align })?;
        let mut a = lock(&self.inner);
        let Some(&(free_len, start)) = a.by_size.range((need, 0)..).next() else {
            return Err(Error::OutOfMemory {
                bytes,
                resource: NAME,
                detail: format!(
                    "simulated capacity {} bytes, {} in use, largest free range {} bytes",
                    self.capacity,
                    a.used,
                    a.largest_free()
                ),
            });
        };
        a.remove_free(start, free_len);
        let addr = align_up(start, align).expect("inside the simulated range");
        a.insert_free(start, addr - start);
        a.insert_free(addr + len, start + free_len - (addr + len));
        a.live.insert(addr, (bytes, len));
        a.used += len;
        a.peak = a.peak.max(a.used);
        // The address is never dereferenced, so it needs no provenance.
        Ok(NonNull::new(std::ptr::without_provenance_mut(addr)).expect("BASE is non-zero"))
    }

    unsafe fn deallocate(
        &self,
        _stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        let addr = ptr.as_ptr() as usize;
        let mut a = lock(&self.inner);
        let &(requested, len) = a.live.get(&addr).ok_or(Error::UnknownPointer {
            resource: NAME,
            ptr: addr,
        })?;
        if requested != bytes {
            return Err(Error::SizeMismatch {
                resource: NAME,
                ptr: addr,
                allocated: requested,
                freed: bytes,
            });
        }
        a.live.remove(&addr);
        a.used -= len;
        let (mut start, mut end) = (addr, addr + len);
        if let Some((&prev, &prev_len)) = a.by_addr.range(..addr).next_back() {
            if prev + prev_len == addr {
                a.remove_free(prev, prev_len);
                start = prev;
            }
        }
        if let Some(&next_len) = a.by_addr.get(&end) {
            a.remove_free(end, next_len);
            end += next_len;
        }
        a.insert_free(start, end - start);
        Ok(())
    }

    fn properties(&self) -> Properties {
        Properties {
            device_accessible: false,
            host_accessible: false,
        }
    }
    fn device(&self) -> Option<crate::driver::Device> {
        None
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let u = self.usage();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: u.used,
            bytes_reserved: None,
            peak_bytes: Some(u.peak),
            live_blocks: Some(u.live_blocks),
            detail: vec![
                (c"capacity", n(u.capacity)),
                (c"used", n(u.used)),
                (c"peak", n(u.peak)),
                (c"largest_free", n(u.largest_free)),
                (c"live_blocks", n(u.live_blocks)),
            ],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: StreamRef<'static> = StreamRef::DEFAULT;

    #[test]
    fn fills_to_capacity_and_refuses_past_it() {
        let mr = SimulatedMemoryResource::new(4096).unwrap();
        let blocks: Vec<_> = (0..16).map(|_| mr.allocate(S, 200, 8).unwrap()).collect();
        let mut addrs: Vec<_> = blocks.iter().map(|p| p.as_ptr() as usize).collect();
        addrs.sort();
        addrs.dedup();
        assert_eq!(addrs.len(), 16);
        assert!(addrs
            .iter()
            .all(|a| a % 256 == 0 && (BASE..BASE + 4096).contains(a)));
        assert!(mr.allocate(S, 1, 1).unwrap_err().is_out_of_memory());
        for p in blocks {
            // SAFETY: from `mr`, freed once (address-only memory).
            unsafe { mr.deallocate(S, p, 200, 8) }.unwrap();
        }
        let u = mr.usage();
        assert_eq!(
            (u.used, u.peak, u.largest_free, u.live_blocks),
            (0, 4096, 4096, 0)
        );
    }

    #[test]
    fn frees_coalesce_and_fragmentation_is_measured() {
        let mr = SimulatedMemoryResource::new(4 * 256).unwrap();
        let p: Vec<_> = (0..4).map(|_| mr.allocate(S, 256, 256).unwrap()).collect();
        // Free blocks 0 and 2: two separate 256-byte holes.
        // SAFETY: from `mr`, each freed once.
        unsafe {
            mr.deallocate(S, p[0], 256, 256).unwrap();
            mr.deallocate(S, p[2], 256, 256).unwrap();
        }
        let u = mr.usage();
        assert_eq!((u.free(), u.largest_free), (512, 256));
        assert!((u.fragmentation() - 0.5).abs() < 1e-9);
        assert!(mr.allocate(S, 512, 256).unwrap_err().is_out_of_memory());
        // Freeing block 1 joins 0..3 into one range.
        // SAFETY: from `mr`, freed once.
        unsafe { mr.deallocate(S, p[1], 256, 256).unwrap() };
        assert_eq!(mr.usage().largest_free, 768);
        let big = mr.allocate(S, 768, 256).unwrap();
        assert_eq!(big.as_ptr() as usize, BASE);
    }

    #[test]
    fn honours_large_alignment() {
        let mr = SimulatedMemoryResource::new(1 << 20).unwrap();
        let _small = mr.allocate(S, 256, 256).unwrap();
        let big = mr.allocate(S, 1000, 65536).unwrap();
        assert_eq!(big.as_ptr() as usize % 65536, 0);
        // The hole before the aligned block went back to the free list.
        assert_eq!(mr.usage().used, 256 + 1024);
        assert!(mr.usage().largest_free >= (1 << 20) - 65536 - 1024);
    }

    #[test]
    fn refuses_bad_frees_without_changing_state() {
        let mr = SimulatedMemoryResource::new(1 << 16).unwrap();
        let p = mr.allocate(S, 300, 8).unwrap();
        let before = mr.usage();
        // SAFETY: deliberately wrong frees; the resource validates before acting.
        unsafe {
            assert!(matches!(
                mr.deallocate(S, p, 299, 8),
                Err(Error::SizeMismatch {
                    allocated: 300,
                    freed: 299,
                    ..
                })
            ));
            let foreign = NonNull::new(0x1000 as *mut u8).unwrap();
            assert!(matches!(
                mr.deallocate(S, foreign, 300, 8),
                Err(Error::UnknownPointer { .. })
            ));
            mr.deallocate(S, p, 300, 8).unwrap();
            assert!(matches!(
                mr.deallocate(S, p, 300, 8),
                Err(Error::UnknownPointer { .. })
            ));
        }
        assert_eq!(before.used, 512);
        assert_eq!(mr.usage().used, 0);
        assert!(SimulatedMemoryResource::new(0).is_err());
        assert!(SimulatedMemoryResource::new(usize::MAX).is_err());
    }
}
