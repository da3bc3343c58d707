//! [`FixedSizeMemoryResource`]: blocks of one size, carved from slabs the upstream supplies,
//! kept on lock-free Treiber stacks ([`stack`]).
//!
//! Each stream gets its own stacks (one of a fixed set of slots), so a block freed on stream A
//! is reused on A at once and no free records an event. Frees go to A's *fresh* stack; while
//! some stream runs short, every [`MARK_EVERY`] frees A is marked and its fresh blocks move to
//! its *sealed* stack. A stream whose stacks run dry refills from the upstream (under a lock
//! that only refills take), so streams on different threads never share blocks while memory
//! lasts; once refills fail, it takes another stream's whole sealed stack (one wait on that
//! stream's last mark), then, after one device-wide synchronisation, the other streams' fresh
//! blocks. No
//! stream but the caller's is ever named to the driver, so streams may die while blocks freed on
//! them sit here. All bookkeeping (links, live bits, slab table) is host memory, never the
//! blocks themselves.

mod lookup;
#[cfg(all(test, carve_loom))]
mod loom_tests;
mod stack;
#[cfg(all(test, not(carve_loom)))]
mod tests;

use std::fmt;
use std::ptr::NonNull;

use self::lookup::SlabLookup;
use self::stack::{chain_tail, Links, TaggedStack, NIL};
use super::stream_order::default_order;
use super::{align_up, check_request, MemoryResource, Properties, StreamOrder, DEFAULT_ALIGNMENT};
use crate::error::{Error, Result};
use crate::stream::{StreamId, StreamRef};
use crate::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::sync::{spin_loop, Mutex};

const NAME: &str = "FixedSizeMemoryResource";
const GRAIN: usize = DEFAULT_ALIGNMENT;

/// Frees per mark: loom models use 2, so that sealing races with stealing in a small model.
#[cfg(not(carve_loom))]
const FREES_PER_MARK: u32 = super::stream_order::MARK_EVERY;
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

/// One stream's stacks, on their own cache lines so streams on different threads do not share.
/// (The slot's stream key lives apart, in `Inner::keys`, so that finding a slot reads only
/// lines nobody writes once streams have their slots.)
#[repr(align(128))]
struct Slot {
    /// Freed since the stream's last mark.
    fresh: TaggedStack,
    /// Covered by the stream's last mark.
    sealed: TaggedStack,
    frees: AtomicU32,
    /// `Inner::demand` at the stream's last mark.
    demand_seen: AtomicUsize,
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
    /// Per slot: `StreamRef::id() + 1`, or 0 while unclaimed. Written once per slot.
    keys: Box<[AtomicUsize]>,
    slots: Box<[Slot]>,
    /// Blocks whose frees are known complete (from streams without a slot).
    ready: TaggedStack,
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

    /// The stream's slot, claimed on first use: open addressing from a hash of the stream, so
    /// finding it costs about one probe however many streams there are. Keys are never cleared,
    /// so a probe that meets an unclaimed slot knows the stream has none before it.
    fn slot_of(&self, stream: StreamRef<'_>) -> Option<&Slot> {
        let key = stream.id().get().wrapping_add(1);
        let n = self.keys.len();
        let start = ((key as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize % n;
        for i in (start..n).chain(0..start) {
            let k = &self.keys[i];
            let now = match k.load(Ordering::Acquire) {
                0 => match k.compare_exchange(0, key, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return Some(&self.slots[i]),
                    Err(now) => now,
                },
                now => now,
            };
            if now == key {
                return Some(&self.slots[i]);
            }
        }
        None
    }

    /// The stream a claimed slot belongs to.
    fn stream_of(&self, slot: usize) -> StreamId {
        let key = self.keys[slot].load(Ordering::Acquire);
        StreamId::from_usize(key.wrapping_sub(1))
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

    /// A free block for `stream`, ordered after any other stream it came from.
    fn pop_for(&self, stream: StreamRef<'_>) -> Result<u32> {
        let slot = self.slot_of(stream);
        loop {
            let epoch = self.seal_epoch.load(Ordering::Acquire);
            if let Some(s) = slot {
                if let Some(i) = s.fresh.pop(self).or_else(|| s.sealed.pop(self)) {
                    return Ok(i);
                }
            }
            if let Some(i) = self.ready.pop(self) {
                return Ok(i);
            }
            let short = match self.refill(stream, slot) {
                Err(e) if e.is_out_of_memory() => e,
                done => return done,
            };
            self.demand.fetch_add(1, Ordering::Relaxed);
            if let Some(mine) = slot {
                if let Some(i) = self.steal(stream, mine)? {
                    return Ok(i);
                }
            }
            if let Some(i) = self.gather_fresh(slot)? {
                return Ok(i);
            }
            // Blocks being sealed are on no stack for a moment, and a seal that ran during the
            // scan may have moved blocks behind it: look again before giving up.
            let now = self.seal_epoch.load(Ordering::Acquire);
            if now == epoch && now % 2 == 0 {
                return Err(short);
            }
            spin_loop();
        }
    }

    /// Takes another stream's whole sealed stack: detach first, then wait on that stream's last
    /// mark, which was recorded after every block in the chain was sealed.
    fn steal(&self, stream: StreamRef<'_>, mine: &Slot) -> Result<Option<u32>> {
        for (i, other) in self.slots.iter().enumerate() {
            if std::ptr::eq(other, mine) || other.sealed.is_empty() {
                continue;
            }
            let Some(first) = other.sealed.take_all() else {
                continue;
            };
            if let Err(e) = self.order.wait_for_mark(stream, self.stream_of(i)) {
                other
                    .sealed
                    .push_chain(self, first, chain_tail(self, first));
                return Err(e);
            }
            let rest = self.next(first).load(Ordering::Relaxed);
            if rest != NIL {
                mine.fresh.push_chain(self, rest, chain_tail(self, rest));
            }
            return Ok(Some(first));
        }
        Ok(None)
    }

    /// Once refills fail: detaches every other stream's fresh blocks, waits for all device
    /// work, and makes them free to any stream.
    fn gather_fresh(&self, mine: Option<&Slot>) -> Result<Option<u32>> {
        let others = || {
            self.slots
                .iter()
                .filter(move |s| !mine.is_some_and(|m| std::ptr::eq(*s, m)))
        };
        if others().all(|s| s.fresh.is_empty()) {
            return Ok(None);
        }
        let chains: Vec<u32> = others().filter_map(|s| s.fresh.take_all()).collect();
        let synced = self.order.synchronize_all();
        for &first in &chains {
            self.ready.push_chain(self, first, chain_tail(self, first));
        }
        synced?;
        Ok(self.ready.pop(self))
    }

    /// Records a free on `slot`; every `FREES_PER_MARK` frees, marks the stream and seals its
    /// fresh blocks (detached before the mark, so the mark covers them all).
    fn push_free(&self, stream: StreamRef<'_>, slot: &Slot, index: u32) {
        slot.fresh.push(self, index);
        let n = slot.frees.fetch_add(1, Ordering::Relaxed).wrapping_add(1);
        if n % FREES_PER_MARK != 0 {
            return;
        }
        let demand = self.demand.load(Ordering::Relaxed);
        if slot.demand_seen.swap(demand, Ordering::Relaxed) == demand {
            return;
        }
        self.seal_epoch.fetch_add(1, Ordering::AcqRel);
        if let Some(first) = slot.fresh.take_all() {
            let last = chain_tail(self, first);
            // A failed mark leaves the blocks fresh (reachable after a synchronisation).
            match self.order.mark(stream) {
                Ok(()) => slot.sealed.push_chain(self, first, last),
                Err(_) => slot.fresh.push_chain(self, first, last),
            }
        }
        self.seal_epoch.fetch_add(1, Ordering::AcqRel);
    }

    fn refill(&self, stream: StreamRef<'_>, slot: Option<&Slot>) -> Result<u32> {
        let _guard = self.refill.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = slot.and_then(|s| s.fresh.pop(self)) {
            return Ok(i);
        }
        if let Some(i) = self.ready.pop(self) {
            return Ok(i);
        }
        let n = self.slab_count.load(Ordering::Relaxed);
        let span = self.per_slab as usize * self.stride;
        if n >= self.max_slabs {
            return Err(self.oom(format!("all {} refills are spent", self.max_slabs)));
        }
        let base = match self.upstream.allocate(stream, span, GRAIN) {
            Ok(p) => p.as_ptr() as usize,
            Err(e) if e.is_out_of_memory() => {
                return Err(self.oom(format!("the upstream could not supply {span} bytes: {e}")))
            }
            Err(e) => return Err(e),
        };
        let first = n as u32 * self.per_slab;
        let per = self.per_slab;
        let slab = Box::new(Slab {
            base,
            next: (0..per)
                .map(|i| AtomicU32::new(if i + 1 < per { first + i + 1 } else { NIL }))
                .collect(),
            live: (0..per.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        });
        self.slabs[n].store(Box::into_raw(slab).expose_provenance(), Ordering::Release);
        self.slab_count.store(n + 1, Ordering::Release);
        self.lookup.insert(base, n as u32);
        if per > 1 {
            let (head, last) = (first + 1, first + per - 1);
            match slot {
                Some(s) => s.fresh.push_chain(self, head, last),
                None => {
                    self.order.synchronize(stream)?;
                    self.ready.push_chain(self, head, last);
                }
            }
        }
        Ok(first)
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
            n => super::limits::count(NAME, "max_refills", n, FixedSizeOptions::MAX_REFILLS)?,
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
                slots: (0..STREAM_SLOTS)
                    .map(|_| Slot {
                        fresh: TaggedStack::new(),
                        sealed: TaggedStack::new(),
                        frees: AtomicU32::new(0),
                        demand_seen: AtomicUsize::new(0),
                    })
                    .collect(),
                ready: TaggedStack::new(),
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
            .chain([&inner.ready]);
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
        match inner.slot_of(stream) {
            Some(slot) => inner.push_free(stream, slot, index),
            None => {
                if let Err(e) = inner.order.synchronize(stream) {
                    slab.live[b / 64].fetch_or(bit, Ordering::Relaxed);
                    return Err(e);
                }
                inner.ready.push(inner, index);
            }
        }
        Ok(())
    }

    fn properties(&self) -> Properties {
        self.inner.upstream.properties()
    }
    fn device(&self) -> Option<crate::driver::Device> {
        self.inner.upstream.device()
    }
}

impl<R: MemoryResource> Drop for Inner<R> {
    fn drop(&mut self) {
        // Queued work on any stream may still use blocks; the upstream may reuse slabs at once.
        crate::deferred::record(
            "FixedSizeMemoryResource drop: waiting for streams",
            self.order.synchronize_all(),
        );
        let span = self.per_slab as usize * self.stride;
        for n in 0..self.slab_count.load(Ordering::Acquire) {
            let raw = self.slabs[n].load(Ordering::Acquire);
            // SAFETY: published by `refill` from `Box::into_raw`, reclaimed once, here.
            let slab = unsafe { Box::from_raw(std::ptr::with_exposed_provenance_mut::<Slab>(raw)) };
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
