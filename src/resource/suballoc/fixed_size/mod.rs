//! [`FixedSizeMemoryResource`]: blocks of one size, carved from slabs the upstream supplies,
//! kept on lock-free Treiber stacks ([`stack`]).
//!
//! **Streams.** Each stream gets its own stacks (one of a fixed set of slots), so a block freed
//! on stream A is reused on A at once and no free records an event. Frees go to A's *fresh*
//! stack; while some stream runs short, every [`MARK_EVERY`](crate::resource::MARK_EVERY) frees A is
//! marked and its fresh blocks move to its *sealed* stack. A stream whose stacks run dry takes,
//! under a lock that only this slow path takes: the shared ready stack; else another stream's
//! whole sealed stack (one wait on that stream's last mark); else, if the blocks free elsewhere
//! number at least the blocks in use and at least one refill, all of them after one
//! device-wide synchronisation; else a new slab from the upstream; and once refills fail,
//! whatever is free, after that synchronisation. No stream but the caller's is ever named to
//! the driver, so streams may die while blocks freed on them sit here.
//!
//! **Bounded memory.** A slab is taken only while fewer than `max(in use, blocks per refill)`
//! blocks are free, so, whichever streams free what, the bytes held from the upstream never
//! exceed `(2 × peak + 2 × blocks_per_refill) × stride`, where `peak` is the most blocks ever
//! allocated at once (counting allocations in progress) and `stride` the block size rounded up
//! to 256 bytes.
//!
//! **Slots.** Once every slot is claimed, a stream without one takes over the slot of a stream
//! whose stacks hold no block (closing them while the slot changes stream, so that an operation
//! still under way for the old stream touches nothing). A free on a stream that finds no slot
//! is *parked*: it reaches any stream after the next device-wide synchronisation, so no free
//! ever waits for the device.
//!
//! **Failures.** An ordering call that fails or panics leaves the blocks it concerned where
//! they were (or parked), never handed to another stream. An `allocate` that fails or unwinds
//! hands out nothing; a `deallocate` that returns an error did not free the block, and one that
//! unwinds (from a panicking mark in the seal that follows a free) did. If the device cannot
//! be waited for at teardown, the slabs are leaked and the error is deferred
//! ([`take_deferred_error`](crate::take_deferred_error)). All bookkeeping (links, live bits,
//! slab table, counters) is host memory, never the blocks themselves.

mod lookup;
#[cfg(all(test, carve_loom))]
mod loom_tests;
mod reclaim;
mod slots;
mod stack;
#[cfg(all(test, not(carve_loom)))]
mod tests;

use std::fmt;
use std::ptr::NonNull;

use self::lookup::SlabLookup;
use self::slots::Slot;
use self::stack::{Links, TaggedStack, NIL};
use crate::error::{Error, Result};
use crate::resource::engine::stream_order::default_order;
use crate::resource::engine::stream_order::StreamOrder;
use crate::resource::memory_resource::{
    align_up, check_request, MemoryResource, Properties, DEFAULT_ALIGNMENT,
};
use crate::stream::StreamRef;
use crate::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::sync::Mutex;

const NAME: &str = "FixedSizeMemoryResource";
const GRAIN: usize = DEFAULT_ALIGNMENT;

/// Frees per mark: loom models use 2, so that sealing races with stealing in a small model.
#[cfg(not(carve_loom))]
const FREES_PER_MARK: u32 = crate::resource::engine::stream_order::MARK_EVERY;
#[cfg(carve_loom)]
const FREES_PER_MARK: u32 = 2;

#[cfg(not(carve_loom))]
const STREAM_SLOTS: usize = 64;
#[cfg(carve_loom)]
const STREAM_SLOTS: usize = 2;

/// How a fixed-size resource is shaped.
#[derive(Clone)]
pub struct FixedSizeOptions {
    /// Usable bytes per block (blocks are 256-byte aligned, strided by a multiple of 256).
    pub block_size: usize,
    /// Blocks fetched from the upstream per refill (0: about 4 MiB worth, 1 to 1024 blocks).
    pub blocks_per_refill: u32,
    /// Most refills ever made (bounds the slab table; 0: 16384; at most [`Self::MAX_REFILLS`]).
    pub max_refills: usize,
    /// How streams are ordered; `None` picks by the upstream's properties.
    pub order: Option<Arc<dyn StreamOrder>>,
}

impl FixedSizeOptions {
    /// The largest `max_refills` (above this is [`Error::InvalidArgument`]): the slab table
    /// is allocated up front, one entry per refill.
    pub const MAX_REFILLS: usize = 1 << 20;

    /// Blocks of `block_size` bytes, other settings by default.
    pub fn new(block_size: usize) -> Self {
        FixedSizeOptions {
            block_size,
            blocks_per_refill: 0,
            max_refills: 0,
            order: None,
        }
    }
    /// Blocks per refill.
    pub fn blocks_per_refill(mut self, n: u32) -> Self {
        self.blocks_per_refill = n;
        self
    }
    /// Bounds the number of refills.
    pub fn max_refills(mut self, n: usize) -> Self {
        self.max_refills = n;
        self
    }
    /// Uses `order` between streams.
    pub fn order(mut self, order: Arc<dyn StreamOrder>) -> Self {
        self.order = Some(order);
        self
    }
}

impl fmt::Debug for FixedSizeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FixedSizeOptions")
            .field("block_size", &self.block_size)
            .field("blocks_per_refill", &self.blocks_per_refill)
            .field("max_refills", &self.max_refills)
            .finish()
    }
}

/// A snapshot of a fixed-size resource.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedSizeStats {
    /// The size of every block.
    pub block_size: usize,
    /// Refills made so far.
    pub slabs: usize,
    /// Blocks fetched so far.
    pub total_blocks: usize,
    /// Blocks handed out and not yet freed.
    pub blocks_in_use: usize,
    /// Bytes held from the upstream.
    pub upstream_bytes: usize,
}

/// Fixed-size blocks over any upstream `R`. Cheap to clone (clones share the blocks).
pub struct FixedSizeMemoryResource<R: MemoryResource> {
    inner: Arc<Inner<R>>,
}

impl<R: MemoryResource> Clone for FixedSizeMemoryResource<R> {
    fn clone(&self) -> Self {
        FixedSizeMemoryResource {
            inner: self.inner.clone(),
        }
    }
}

struct Slab {
    base: usize,
    next: Box<[AtomicU32]>,
    live: Box<[AtomicU64]>,
}

struct Inner<R: MemoryResource> {
    upstream: R,
    block_size: usize,
    stride: usize,
    per_slab: u32,
    max_slabs: usize,
    order: Arc<dyn StreamOrder>,
    /// Per slot: `StreamRef::id() + 1`, or 0 while unclaimed. Changed from one stream to
    /// another only under the refill lock, while the slot's stacks are closed.
    keys: Box<[AtomicUsize]>,
    slots: Box<[Slot]>,
    /// Blocks whose frees are known complete: free to any stream.
    ready: TaggedStack,
    /// Blocks freed on streams without a slot: free to any stream after a device-wide
    /// synchronisation.
    parked: TaggedStack,
    /// Allocations and frees counted on no slot.
    loose_allocs: AtomicUsize,
    loose_frees: AtomicUsize,
    /// Bumped whenever a stream runs dry: marks are worth their driver call only then.
    demand: AtomicUsize,
    /// Bumped as each seal starts and ends (odd while blocks are on no stack). Concurrent
    /// seals may pair oddly, but any seal during a scan changes it.
    seal_epoch: AtomicUsize,
    /// `Box<Slab>` pointers, published once and freed only on drop.
    slabs: Box<[AtomicUsize]>,
    slab_count: AtomicUsize,
    lookup: SlabLookup,
    refill: Mutex<()>,
}

/// Runs its closure when dropped unless disarmed: puts blocks back when a `StreamOrder` call
/// fails (an early return) or panics (unwinding).
struct Undo<F: FnOnce()>(Option<F>);

impl<F: FnOnce()> Undo<F> {
    fn new(f: F) -> Self {
        Undo(Some(f))
    }
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl<F: FnOnce()> Drop for Undo<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
}

impl<R: MemoryResource> Links for Inner<R> {
    #[inline]
    fn next(&self, index: u32) -> &AtomicU32 {
        let slab = self.slab(index / self.per_slab);
        &slab.next[(index % self.per_slab) as usize]
    }
}

impl<R: MemoryResource> Inner<R> {
    #[inline]
    fn slab(&self, n: u32) -> &Slab {
        let raw = self.slabs[n as usize].load(Ordering::Acquire);
        debug_assert!(raw != 0, "index of an unpublished slab");
        // SAFETY: indices reach stacks and callers only after their slab was published here
        // (Release, read with Acquire), and slabs are freed only when `Inner` drops.
        unsafe { &*(std::ptr::with_exposed_provenance::<Slab>(raw)) }
    }

    fn address(&self, index: u32) -> usize {
        self.slab(index / self.per_slab).base + (index % self.per_slab) as usize * self.stride
    }

    fn mark_live(&self, index: u32) {
        let slab = self.slab(index / self.per_slab);
        let i = (index % self.per_slab) as usize;
        let old = slab.live[i / 64].fetch_or(1 << (i % 64), Ordering::Relaxed);
        debug_assert!(old & (1 << (i % 64)) == 0, "block {index} handed out twice");
    }

    fn oom(&self, why: String) -> Error {
        Error::OutOfMemory {
            bytes: self.block_size,
            resource: NAME,
            detail: format!(
                "{why}; {} slabs of {} blocks of {} bytes held",
                self.slab_count.load(Ordering::Relaxed),
                self.per_slab,
                self.stride
            ),
        }
    }
}

impl<R: MemoryResource> FixedSizeMemoryResource<R> {
    /// A resource handing out `options.block_size`-byte blocks from `upstream`. Nothing is
    /// fetched until the first request.
    pub fn new(upstream: R, options: FixedSizeOptions) -> Result<Self> {
        let block_size = options.block_size;
        if block_size == 0 {
            return Err(Error::ZeroSize);
        }
        let stride = align_up(block_size, GRAIN)
            .filter(|&s| s <= isize::MAX as usize / 2)
            .ok_or(Error::SizeOverflow {
                bytes: block_size,
                align: GRAIN,
            })?;
        let per_slab = match options.blocks_per_refill {
            0 => ((4 << 20) / stride).clamp(1, 1024) as u32,
            n => n,
        };
        if per_slab == NIL || (per_slab as usize).checked_mul(stride).is_none() {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: {per_slab} blocks of {stride} bytes per refill overflow"
            )));
        }
        let index_limit = (NIL as usize - 1) / per_slab as usize;
        let max_slabs = match options.max_refills {
            0 => 16384,
            n => crate::resource::suballoc::limits::count(
                NAME,
                "max_refills",
                n,
                FixedSizeOptions::MAX_REFILLS,
            )?,
        }
        .min(index_limit);
        let order = match options.order {
            Some(o) => o,
            None => default_order(&upstream)?,
        };
        Ok(FixedSizeMemoryResource {
            inner: Arc::new(Inner {
                upstream,
                block_size,
                stride,
                per_slab,
                max_slabs,
                order,
                keys: (0..STREAM_SLOTS).map(|_| AtomicUsize::new(0)).collect(),
                slots: (0..STREAM_SLOTS).map(|_| Slot::new()).collect(),
                ready: TaggedStack::new(),
                parked: TaggedStack::new(),
                loose_allocs: AtomicUsize::new(0),
                loose_frees: AtomicUsize::new(0),
                demand: AtomicUsize::new(0),
                seal_epoch: AtomicUsize::new(0),
                slabs: (0..max_slabs).map(|_| AtomicUsize::new(0)).collect(),
                slab_count: AtomicUsize::new(0),
                lookup: SlabLookup::with_capacity(max_slabs),
                refill: Mutex::new(()),
            }),
        })
    }

    /// Usable bytes per block.
    pub fn block_size(&self) -> usize {
        self.inner.block_size
    }

    /// Blocks, slabs and bytes now. Counts live bits, so it is O(blocks / 64).
    pub fn stats(&self) -> FixedSizeStats {
        let inner = &*self.inner;
        let slabs = inner.slab_count.load(Ordering::Acquire);
        let in_use = (0..slabs as u32)
            .map(|n| {
                inner
                    .slab(n)
                    .live
                    .iter()
                    .map(|w| w.load(Ordering::Relaxed).count_ones() as usize)
                    .sum::<usize>()
            })
            .sum();
        FixedSizeStats {
            block_size: inner.block_size,
            slabs,
            total_blocks: slabs * inner.per_slab as usize,
            blocks_in_use: in_use,
            upstream_bytes: slabs * inner.per_slab as usize * inner.stride,
        }
    }

    /// Checks that every block is either live or on exactly one stack. Call it only while no
    /// other thread uses the resource.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        let inner = &*self.inner;
        let stats = self.stats();
        let total = stats.total_blocks;
        let mut seen = vec![false; total];
        let stacks = inner
            .slots
            .iter()
            .flat_map(|s| [&s.fresh, &s.sealed])
            .chain([&inner.ready, &inner.parked]);
        for stack in stacks {
            for i in stack.snapshot(inner, total) {
                let Some(flag) = seen.get_mut(i as usize) else {
                    return Err(format!("stack holds index {i} beyond {total} blocks"));
                };
                if std::mem::replace(flag, true) {
                    return Err(format!("block {i} is free twice (or a stack cycles)"));
                }
                let slab = inner.slab(i / inner.per_slab);
                let b = (i % inner.per_slab) as usize;
                if slab.live[b / 64].load(Ordering::Relaxed) & (1 << (b % 64)) != 0 {
                    return Err(format!("block {i} is both free and live"));
                }
            }
        }
        let free = seen.iter().filter(|&&f| f).count();
        if free + stats.blocks_in_use != total {
            return Err(format!(
                "{free} free + {} live != {total} blocks: a block was lost",
                stats.blocks_in_use
            ));
        }
        Ok(())
    }
}

// SAFETY: blocks are disjoint `stride`-sized pieces of upstream slabs, each 256-byte aligned
// (the slab is, and the stride is a multiple of 256); a block is handed out only when popped from
// a stack, which holds each index at most once (checked by `check_invariants`, loom models), and
// crosses streams only after a wait on the freeing stream's mark or a device-wide sync.
unsafe impl<R: MemoryResource> MemoryResource for FixedSizeMemoryResource<R> {
    fn allocate(&self, stream: StreamRef<'_>, bytes: usize, align: usize) -> Result<NonNull<u8>> {
        let align = check_request(bytes, align, 1)?;
        let inner = &*self.inner;
        if bytes > inner.block_size {
            return Err(Error::InvalidArgument(format!(
                "{NAME}: {bytes} bytes requested from {}-byte blocks",
                inner.block_size
            )));
        }
        if align > GRAIN {
            return Err(Error::Unsupported(format!(
                "{NAME}: blocks are {GRAIN}-byte aligned, not {align}"
            )));
        }
        let index = inner.pop_for(stream)?;
        inner.mark_live(index);
        NonNull::new(inner.address(index) as *mut u8)
            .ok_or_else(|| Error::Unsupported("the upstream returned a null slab".into()))
    }

    unsafe fn deallocate(
        &self,
        stream: StreamRef<'_>,
        ptr: NonNull<u8>,
        bytes: usize,
        _align: usize,
    ) -> Result<()> {
        let inner = &*self.inner;
        let addr = ptr.as_ptr() as usize;
        let unknown = Error::UnknownPointer {
            resource: NAME,
            ptr: addr,
        };
        let Some((base, n)) = inner.lookup.find(addr) else {
            return Err(unknown);
        };
        let offset = addr - base;
        let b = offset / inner.stride;
        if offset % inner.stride != 0 || b >= inner.per_slab as usize {
            return Err(unknown);
        }
        if bytes == 0 || bytes > inner.block_size {
            return Err(Error::SizeMismatch {
                resource: NAME,
                ptr: addr,
                allocated: inner.block_size,
                freed: bytes,
            });
        }
        let slab = inner.slab(n);
        let bit = 1u64 << (b % 64);
        if slab.live[b / 64].fetch_and(!bit, Ordering::Relaxed) & bit == 0 {
            return Err(Error::DoubleFree {
                resource: NAME,
                ptr: addr,
            });
        }
        let index = n * inner.per_slab + b as u32;
        loop {
            match inner
                .slot_of(stream)
                .or_else(|| inner.try_take_over_slot(stream))
            {
                Some(c) => {
                    if inner.push_free(stream, c, index).is_ok() {
                        return Ok(());
                    }
                    // The slot is changing stream: wait for the change, then look again.
                    crate::sync::spin_loop();
                }
                None => {
                    // Parked until a device-wide synchronisation: this free waits for nothing.
                    inner.loose_frees.fetch_add(1, Ordering::Relaxed);
                    inner.parked.push(inner, index);
                    return Ok(());
                }
            }
        }
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
    fn memory_stats(&self) -> crate::error::Result<Option<crate::resource::MemoryStats>> {
        let s = self.stats();
        let n = |v: usize| v as f64;
        Ok(Some(crate::resource::MemoryStats {
            bytes_in_use: s.blocks_in_use * s.block_size,
            bytes_reserved: Some(s.upstream_bytes),
            peak_bytes: None,
            live_blocks: Some(s.blocks_in_use),
            detail: vec![
                (c"block_size", n(s.block_size)),
                (c"slabs", n(s.slabs)),
                (c"total_blocks", n(s.total_blocks)),
                (c"blocks_in_use", n(s.blocks_in_use)),
                (c"upstream_bytes", n(s.upstream_bytes)),
            ],
        }))
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        // Queued work on any stream may still use blocks, and the upstream may reuse slabs at
        // once: if the device cannot be waited for, the slabs are leaked, not returned.
        let synced = self.order.synchronize_all();
        let leak = synced.is_err();
        crate::deferred::record(
            "FixedSizeMemoryResource drop: waiting for streams (slabs leaked)",
            synced,
        );
        let span = self.per_slab as usize * self.stride;
        for n in 0..self.slab_count.load(Ordering::Acquire) {
            let raw = self.slabs[n].load(Ordering::Acquire);
            // SAFETY: published by `refill` from `Box::into_raw`, reclaimed once, here.
            let slab = unsafe { Box::from_raw(std::ptr::with_exposed_provenance_mut::<Slab>(raw)) };
            if leak {
                continue;
            }
            if let Some(ptr) = NonNull::new(slab.base as *mut u8) {
                // SAFETY: the slab came from the upstream with this size and alignment; the
                // last handle is going away.
                let r = unsafe {
                    self.upstream
                        .deallocate(StreamRef::DEFAULT, ptr, span, GRAIN)
                };
                crate::deferred::record("FixedSizeMemoryResource drop: returning a slab", r);
            }
        }
    }
}

impl<R: MemoryResource> fmt::Debug for FixedSizeMemoryResource<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct(NAME)
            .field("block_size", &self.inner.block_size)
            .field("blocks_per_refill", &self.inner.per_slab)
            .field("upstream", &self.inner.upstream)
            .finish()
    }
}
