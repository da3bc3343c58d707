//! Which pages of the reserved range are mapped, and how many live blocks touch each.
//!
//! A page is mapped while a live block overlaps it; when its last block goes, it stays mapped
//! but *free* (in a list), so a block placed there later costs no driver call. A page that must
//! be mapped takes the physical chunk of a free page, wherever that lies (a synchronisation of
//! the device, or of the allocating stream when it alone holds free blocks; then unmap and
//! map), and creates a chunk only when no page is free. So the physical memory held never
//! exceeds the most pages live blocks have touched at once, except for the chunks a caller lets
//! it create instead of moving ([`Pages::set_spare`]: the expandable pool's headroom).

use std::cell::{Cell, RefCell};

use super::backing::{PhysicalBacking, PhysicalHandle};
use super::segments::{SegmentChange, SegmentEvent};
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::resource::engine::coalescing::Placer;
use crate::resource::engine::stream_order::StreamOrder;
use crate::stream::StreamRef;

/// What a caller of [`Pages::commit`] knows of the work that may still use free pages.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Settled<'a> {
    /// The device was synchronised since the last free: nothing to wait for.
    Device,
    /// Every free block was freed on this stream, reached it through a wait on another
    /// stream's mark, or was opened to all by a device-wide synchronisation: waiting for this
    /// stream covers all work on them, and leaves another thread's graph capture alone (a
    /// device-wide synchronisation would break it).
    ByStream(StreamRef<'a>),
    /// Other streams hold free blocks: only the whole device will do.
    No,
}

const NOT_FREE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
struct Page {
    handle: Option<PhysicalHandle>,
    /// Live blocks overlapping the page.
    refs: u32,
    /// Index in `Pages::free` while mapped with no live block.
    free_at: u32,
}

/// Counters of the page table, for stats and tests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PageCounters {
    pub mapped: usize,
    pub peak_mapped: usize,
    pub free: usize,
    pub creates: u64,
    pub moves: u64,
    pub releases: u64,
    /// Successful driver calls: maps, unmaps, access grants (one per run of pages mapped).
    pub maps: u64,
    pub unmaps: u64,
    pub access_grants: u64,
}

#[derive(Debug)]
pub(crate) struct Pages {
    base: usize,
    page: usize,
    /// `page == 1 << shift`.
    shift: u32,
    max_pages: usize,
    pages: Vec<Page>,
    free: Vec<u32>,
    counters: PageCounters,
    /// `mapped_before[i]`: mapped pages among `pages[..i]`, so that [`Placer`] prices any
    /// spot in O(1). Rebuilt on the next pricing after a page is mapped or unmapped (rare next
    /// to pricing: the driver calls of a map cost more than the rebuild).
    mapped_before: RefCell<Vec<u32>>,
    stale: Cell<bool>,
    /// Pages the next commits may create although free pages could move instead.
    spare: usize,
    /// Chunks taken off their pages whose unmap or release the backing refused: still held,
    /// counted against `max_pages`, and tried again by the next trim and at drop.
    unreleased: Vec<Unreleased>,
    /// Pages mapped (with access) and unmapped since the owner last took them, in order, for
    /// its segment callback.
    pub events: Vec<SegmentEvent>,
}

/// A chunk no page holds any more that the backing did not take back.
#[derive(Clone, Copy, Debug)]
struct Unreleased {
    handle: PhysicalHandle,
    /// Where it is still mapped, when its unmap was refused (never handed out: no access).
    mapped_at: Option<usize>,
}

impl Pages {
    /// Pages of `page` bytes from `base`, at most `max_pages` mapped at once.
    pub fn new(base: usize, page: usize, max_pages: usize) -> Self {
        Pages {
            base,
            page,
            shift: page.trailing_zeros(),
            max_pages,
            pages: Vec::new(),
            free: Vec::new(),
            counters: PageCounters::default(),
            mapped_before: RefCell::new(vec![0]),
            stale: Cell::new(false),
            spare: 0,
            unreleased: Vec::new(),
            events: Vec::new(),
        }
    }

    /// Lets the next commits create up to `pages` chunks while free pages exist, instead of
    /// moving them (a move waits for the device and costs an unmap as well as a map).
    pub fn set_spare(&mut self, pages: usize) {
        self.spare = pages;
    }

    /// Pages a commit that must map `missing` would move rather than create.
    pub fn moves_for(&self, missing: usize) -> usize {
        missing.saturating_sub(self.spare).min(self.free.len())
    }

    pub fn counters(&self) -> PageCounters {
        PageCounters {
            free: self.free.len(),
            ..self.counters
        }
    }

    pub fn page_size(&self) -> usize {
        self.page
    }

    pub fn max_pages(&self) -> usize {
        self.max_pages
    }

    /// Bytes a request could still map: pages never created plus free pages.
    pub fn mappable_bytes(&self) -> usize {
        (self.max_pages - self.held() + self.free.len()) * self.page
    }

    /// Chunks whose unmap or release the backing refused, held until a retry succeeds.
    pub fn unreleased(&self) -> usize {
        self.unreleased.len()
    }

    /// Chunks held: mapped, or refused by the backing.
    fn held(&self) -> usize {
        self.counters.mapped + self.unreleased.len()
    }

    /// Bytes of chunks held: mapped, or refused by the backing.
    pub fn held_bytes(&self) -> usize {
        self.held() * self.page
    }

    /// Notes that page `i` was mapped (with access) or unmapped, for the segment callback.
    fn note(&mut self, i: usize, change: SegmentChange) {
        self.events.push(SegmentEvent {
            addr: self.base + i * self.page,
            size: self.page,
            change,
        });
    }

    /// Every page mapped now, as `change` events, in address order.
    pub fn mapped_segments(
        &self,
        change: SegmentChange,
    ) -> impl Iterator<Item = SegmentEvent> + '_ {
        self.pages
            .iter()
            .enumerate()
            .filter(|(_, p)| p.handle.is_some())
            .map(move |(i, _)| SegmentEvent {
                addr: self.base + i * self.page,
                size: self.page,
                change,
            })
    }

    fn span(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        debug_assert!(start >= self.base && end > start);
        (start - self.base) >> self.shift..((end - 1 - self.base) >> self.shift) + 1
    }

    /// The page holding `addr` and its chunk, when mapped.
    pub fn chunk_at(&self, addr: usize) -> Option<(usize, PhysicalHandle)> {
        let i = addr.checked_sub(self.base)? / self.page;
        let h = self.pages.get(i)?.handle?;
        Some((self.base + i * self.page, h))
    }

    /// Makes `[start, end)` mapped for a new live block. Before free pages move, the work that
    /// may still use them must be done: `settled` says how much to wait for (nothing, when the
    /// caller synchronised the device since the last free). On failure nothing changed.
    pub fn commit<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        order: &dyn StreamOrder,
        settled: Settled<'_>,
        start: usize,
        end: usize,
    ) -> Result<()> {
        let span = self.span(start, end);
        if self.pages.len() < span.end {
            self.pages.resize(
                span.end,
                Page {
                    handle: None,
                    refs: 0,
                    free_at: NOT_FREE,
                },
            );
        }
        // Read first: the wait below may fail or unwind, and must find the table unchanged.
        let (mut missing, mut own_free) = (0usize, 0usize);
        for p in &self.pages[span.clone()] {
            if p.handle.is_none() {
                missing += 1;
            } else if p.refs == 0 {
                own_free += 1;
            }
        }
        // The free pages left once this block's own leave the list.
        let free = self.free.len() - own_free;
        let moves = missing.saturating_sub(self.spare).min(free);
        let created = missing - moves;
        if missing > 0 && self.held() + created > self.max_pages {
            return Err(Error::OutOfMemory {
                bytes: end - start,
                resource: super::NAME,
                detail: format!(
                    "{missing} more page(s) of {} bytes to map, {free} free to move, {} of {} \
                     mapped",
                    self.page, self.counters.mapped, self.max_pages
                ),
            });
        }
        // Relaxed, as PyTorch does around cudaMalloc: the driver calls of a map or a move (and
        // a stream's synchronisation) do not invalidate another thread's graph capture.
        if moves > 0 {
            // Free pages may still be in use by work queued before their blocks were freed.
            crate::driver::capture::relaxed(|| match settled {
                Settled::Device => Ok(()),
                Settled::ByStream(stream) => order.synchronize(stream),
                Settled::No => order.synchronize_all(),
            })?;
        }
        for i in span.clone() {
            if self.pages[i].handle.is_some() && self.pages[i].refs == 0 {
                self.take_free(i);
            }
            self.pages[i].refs += 1;
        }
        if missing == 0 {
            return Ok(());
        }
        let mapped = crate::driver::capture::relaxed(|| self.map_missing(backing, span.clone()));
        if let Err(e) = mapped {
            self.decommit(start, end);
            return Err(e);
        }
        Ok(())
    }

    /// Maps the unmapped pages of `span` (the caller waited for the work on free pages) and
    /// grants access to them; on failure, takes back what it mapped.
    fn map_missing<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        span: std::ops::Range<usize>,
    ) -> Result<()> {
        let mut mapped_now: Vec<usize> = Vec::new();
        let result = self.map_each(backing, span, &mut mapped_now);
        // One access grant per run of pages mapped now (the expensive call on a GPU).
        let granted = result.and_then(|()| {
            let mut k = 0;
            while k < mapped_now.len() {
                let mut run = 1;
                while k + run < mapped_now.len() && mapped_now[k + run] == mapped_now[k] + run {
                    run += 1;
                }
                let va = self.base + mapped_now[k] * self.page;
                // SAFETY: pages `mapped_now[k..k + run]` are consecutive and were just mapped.
                unsafe { backing.set_access(va, run * self.page)? };
                self.counters.access_grants += 1;
                k += run;
            }
            for &i in &mapped_now {
                self.note(i, SegmentChange::Mapped);
            }
            Ok(())
        });
        if granted.is_err() {
            // Pages mapped now without access must never be handed out: take them back.
            for &i in &mapped_now {
                let h = self.set_handle(i, None).expect("mapped just now");
                self.counters.mapped -= 1;
                let va = self.base + i * self.page;
                // SAFETY: mapped just now by us at `va`, never handed out (no access yet). The
                // call's own error is the one to report; a refused chunk stays in the books.
                let _ = unsafe { self.drop_chunk(backing, h, Some(va)) };
            }
        }
        granted
    }

    /// Maps every unmapped page of `span`, creating chunks while [`Pages::set_spare`] allows,
    /// then moving free pages' chunks, then creating again, and notes each in `mapped_now`.
    /// Stops at the first failure.
    fn map_each<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        span: std::ops::Range<usize>,
        mapped_now: &mut Vec<usize>,
    ) -> Result<()> {
        for i in span {
            if self.pages[i].handle.is_some() {
                continue;
            }
            let take = if self.spare > 0 {
                None
            } else {
                self.free.pop()
            };
            let (handle, moved) = match take {
                Some(j) => {
                    let j = j as usize;
                    let h = self.set_handle(j, None).expect("free pages are mapped");
                    self.pages[j].free_at = NOT_FREE;
                    self.counters.mapped -= 1;
                    let va = self.base + j * self.page;
                    // SAFETY: page `j` was mapped by us with exactly this range, has no live
                    // block, and the device is idle (synchronised above).
                    if let Err(e) = unsafe { backing.unmap(va, self.page) } {
                        // Leave the page mapped and free, as it was.
                        self.set_handle(j, Some(h));
                        self.put_free(j);
                        self.counters.mapped += 1;
                        return Err(e);
                    }
                    self.counters.unmaps += 1;
                    self.note(j, SegmentChange::Unmapped);
                    (h, true)
                }
                None => {
                    let h = backing.create(self.page)?;
                    self.spare = self.spare.saturating_sub(1);
                    (h, false)
                }
            };
            let va = self.base + i * self.page;
            // SAFETY: page `i` lies in our reservation, is aligned and unmapped; `handle` is a
            // live chunk of one page, mapped nowhere.
            if let Err(e) = unsafe { backing.map(va, self.page, handle) } {
                let released = self.counters.releases;
                // SAFETY: the chunk is mapped nowhere and no longer referenced. The map's error
                // is the one to report; a refused chunk stays in the books.
                let _ = unsafe { self.drop_chunk(backing, handle, None) };
                if !moved {
                    // A chunk created for this map was never counted as created.
                    self.counters.releases = released;
                }
                return Err(e);
            }
            self.counters.maps += 1;
            self.set_handle(i, Some(handle));
            mapped_now.push(i);
            self.counters.mapped += 1;
            self.counters.peak_mapped = self.counters.peak_mapped.max(self.counters.mapped);
            if moved {
                self.counters.moves += 1;
            } else {
                self.counters.creates += 1;
            }
        }
        Ok(())
    }

    /// Drops a live block's hold on `[start, end)`.
    pub fn decommit(&mut self, start: usize, end: usize) {
        for i in self.span(start, end) {
            let p = &mut self.pages[i];
            p.refs -= 1;
            if p.refs == 0 && p.handle.is_some() {
                self.put_free(i);
            }
        }
    }

    /// Maps (`Some`) or unmaps (`None`) page `i` in the table; returns its chunk before.
    fn set_handle(&mut self, i: usize, h: Option<PhysicalHandle>) -> Option<PhysicalHandle> {
        self.stale.set(true);
        std::mem::replace(&mut self.pages[i].handle, h)
    }

    /// Unmapped pages of `span` (pages past the table are unmapped), by `mapped_before`.
    #[inline]
    fn unmapped_in(mapped_before: &[u32], span: std::ops::Range<usize>) -> usize {
        let n = mapped_before.len() - 1;
        let mapped = mapped_before[span.end.min(n)] - mapped_before[span.start.min(n)];
        span.len() - mapped as usize
    }

    /// `mapped_before`, rebuilt first if a page was mapped or unmapped since.
    #[inline]
    fn mapped_before(&self) -> std::cell::Ref<'_, Vec<u32>> {
        if self.stale.get() {
            self.rebuild_mapped_before();
        }
        self.mapped_before.borrow()
    }

    #[cold]
    fn rebuild_mapped_before(&self) {
        self.stale.set(false);
        let mut m = self.mapped_before.borrow_mut();
        m.clear();
        m.push(0);
        let mut mapped = 0;
        for p in &self.pages {
            mapped += u32::from(p.handle.is_some());
            m.push(mapped);
        }
    }

    fn put_free(&mut self, i: usize) {
        self.pages[i].free_at = self.free.len() as u32;
        self.free.push(i as u32);
    }

    fn take_free(&mut self, i: usize) {
        let at = self.pages[i].free_at as usize;
        debug_assert_eq!(self.free[at] as usize, i);
        self.free.swap_remove(at);
        if let Some(&moved) = self.free.get(at) {
            self.pages[moved as usize].free_at = at as u32;
        }
        self.pages[i].free_at = NOT_FREE;
    }

    /// Unmaps chunk `h` from `mapped_at` (when mapped) and releases it. Whatever the backing
    /// refuses stays in `unreleased` (still mapped, if the unmap was refused) for a retry.
    ///
    /// # Safety
    /// `mapped_at` is exactly one earlier map of `h` that no work and no live block uses; no
    /// page refers to `h` any more.
    unsafe fn drop_chunk<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        h: PhysicalHandle,
        mapped_at: Option<usize>,
    ) -> Result<()> {
        if let Some(va) = mapped_at {
            // SAFETY: the caller's contract.
            if let Err(e) = unsafe { backing.unmap(va, self.page) } {
                self.unreleased.push(Unreleased {
                    handle: h,
                    mapped_at,
                });
                return Err(e);
            }
            self.counters.unmaps += 1;
        }
        // SAFETY: unmapped (above, or by the caller) and referenced nowhere else.
        if let Err(e) = unsafe { backing.release(h, self.page) } {
            self.unreleased.push(Unreleased {
                handle: h,
                mapped_at: None,
            });
            return Err(e);
        }
        self.counters.releases += 1;
        Ok(())
    }

    /// Tries again to unmap and release the chunks the backing refused before (the caller has
    /// synchronised the device). Returns the bytes released, or the first refusal (every chunk
    /// is tried; those refused again stay).
    fn retry_unreleased<B: PhysicalBacking>(&mut self, backing: &B) -> Result<usize> {
        let (mut released, mut first) = (0, None);
        for u in std::mem::take(&mut self.unreleased) {
            // SAFETY: each was taken off its page with no live block on it, never handed out
            // again, and the device is idle.
            match unsafe { self.drop_chunk(backing, u.handle, u.mapped_at) } {
                Ok(()) => released += self.page,
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        first.map_or(Ok(released), Err)
    }

    /// Unmaps and releases every free page, and the chunks refused before (the caller has
    /// synchronised the device). Returns the bytes released; stops at the first refusal, which
    /// leaves the page mapped and free (a refused unmap) or its chunk in `unreleased` (a refused
    /// release), for the next trim.
    pub fn trim<B: PhysicalBacking>(&mut self, backing: &B) -> Result<usize> {
        let mut released = self.retry_unreleased(backing)?;
        while let Some(&j) = self.free.last() {
            let j = j as usize;
            let h = self.pages[j].handle.expect("free pages are mapped");
            // SAFETY: a page we mapped with this range, with no live block; the device is idle.
            unsafe { backing.unmap(self.base + j * self.page, self.page)? };
            self.counters.unmaps += 1;
            self.note(j, SegmentChange::Unmapped);
            self.free.pop();
            self.set_handle(j, None);
            self.pages[j].free_at = NOT_FREE;
            self.counters.mapped -= 1;
            // SAFETY: just unmapped, referenced nowhere.
            unsafe { self.drop_chunk(backing, h, None)? };
            released += self.page;
        }
        Ok(released)
    }

    /// Unmaps and releases every chunk, for drop after a successful device-wide
    /// synchronisation. Every refusal is recorded ([`crate::deferred`]) and its chunk leaked;
    /// returns whether nothing stays mapped, so that the reservation may go.
    pub fn release_all<B: PhysicalBacking>(&mut self, backing: &B) -> bool {
        let retried = self.retry_unreleased(backing);
        crate::deferred::record("VirtualMemoryResource drop: returning a chunk", retried);
        for i in 0..self.pages.len() {
            if let Some(h) = self.set_handle(i, None) {
                self.pages[i].free_at = NOT_FREE;
                self.counters.mapped -= 1;
                let va = self.base + i * self.page;
                // SAFETY: the resource is being dropped after a device-wide synchronisation; no
                // block outlives it.
                let r = unsafe { self.drop_chunk(backing, h, Some(va)) };
                crate::deferred::record("VirtualMemoryResource drop: returning a chunk", r);
            }
        }
        self.free.clear();
        self.unreleased.iter().all(|u| u.mapped_at.is_none())
    }
}

#[path = "pages_check.rs"]
mod check;
#[path = "pages_placer.rs"]
mod placer;

#[cfg(test)]
#[path = "pages_tests.rs"]
mod tests;
