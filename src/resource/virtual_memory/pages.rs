//! Which pages of the reserved range are mapped, and how many live blocks touch each.
//!
//! A page is mapped while a live block overlaps it; when its last block goes, it stays mapped
//! but *free* (in a list), so a block placed there later costs no driver call. A page that must
//! be mapped takes the physical chunk of a free page, wherever that lies (a synchronisation of
//! the device, or of the allocating stream when it alone holds free blocks; then unmap and
//! map), and creates a chunk only when no page is free. So the physical memory held never
//! exceeds the most pages live blocks have touched at once, except for the chunks a caller lets
//! it create instead of moving ([`Pages::set_spare`]: the expandable pool's headroom).
//!
//! With [`Pages::new`]'s `paired`, a block that needs several pages created at once gets them
//! in chunks of two pages ([`MAX_CHUNK_PAGES`]): half the creates and maps, and half the
//! mappings that the access grant (the costly call, whose cost follows the mappings rather than
//! the bytes) covers. The pages of such a chunk do not move one by one; they are *held* while
//! free, and the chunk is released whole once both are free: by [`Pages::trim`], or before a
//! commit would create pages past what the caller allows.

use std::cell::{Cell, RefCell};

use super::backing::{PhysicalBacking, PhysicalHandle};
use crate::error::{Error, Result};
#[cfg(doc)]
use crate::resource::coalescing::core::Placer;
use crate::resource::StreamOrder;
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

/// The most pages one chunk maps. Two halve the driver calls of a block that needs many pages
/// created, and leave at most one page held by a chunk that a block shares with free memory:
/// with chunks of 3 to 16 pages, a trace whose large blocks come and go between others held
/// free pages that could not move, and reserved 1.09–1.15× its logical peak against 1.06×
/// (BENCHMARKS.md, 2026-11-26).
const MAX_CHUNK_PAGES: usize = 2;

#[derive(Clone, Copy, Debug)]
struct Page {
    /// The chunk the page is mapped from (every page of a chunk names it).
    handle: Option<PhysicalHandle>,
    /// Live blocks overlapping the page.
    refs: u32,
    /// Index in `Pages::free` (a one-page chunk) or `Pages::held` while mapped with no live
    /// block.
    free_at: u32,
    /// While mapped: the first page of its chunk.
    chunk: u32,
    /// At a chunk's first page: the chunk's pages.
    len: u32,
    /// At the first page of a chunk of several pages: its free pages.
    idle: u32,
}

const UNMAPPED_PAGE: Page = Page {
    handle: None,
    refs: 0,
    free_at: NOT_FREE,
    chunk: 0,
    len: 0,
    idle: 0,
};

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
    /// Free pages of one-page chunks: these move.
    free: Vec<u32>,
    /// Free pages of chunks of several pages: these stay until their chunk is wholly free.
    held: Vec<u32>,
    /// Chunks of several pages that are wholly free.
    idle_chunks: usize,
    /// The most pages a chunk created for one block maps: 1, or [`MAX_CHUNK_PAGES`].
    chunk_pages: usize,
    counters: PageCounters,
    /// `mapped_before[i]`: mapped pages among `pages[..i]`, so that [`Placer`] prices any
    /// spot in O(1). Rebuilt on the next pricing after a page is mapped or unmapped (rare next
    /// to pricing: the driver calls of a map cost more than the rebuild).
    mapped_before: RefCell<Vec<u32>>,
    stale: Cell<bool>,
    /// Pages the next commits may create although free pages could move instead.
    spare: usize,
}

impl Pages {
    /// Pages of `page` bytes from `base`, at most `max_pages` mapped at once; with `paired`,
    /// pages created together come in chunks of two.
    pub fn new(base: usize, page: usize, max_pages: usize, paired: bool) -> Self {
        Pages {
            base,
            page,
            shift: page.trailing_zeros(),
            max_pages,
            pages: Vec::new(),
            free: Vec::new(),
            held: Vec::new(),
            idle_chunks: 0,
            chunk_pages: if paired { MAX_CHUNK_PAGES } else { 1 },
            counters: PageCounters::default(),
            mapped_before: RefCell::new(vec![0]),
            stale: Cell::new(false),
            spare: 0,
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
            free: self.free.len() + self.held.len(),
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
        (self.max_pages - self.counters.mapped + self.free.len()) * self.page
    }

    fn span(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        debug_assert!(start >= self.base && end > start);
        (start - self.base) >> self.shift..((end - 1 - self.base) >> self.shift) + 1
    }

    /// The chunk mapped at `addr`, when mapped: its start, handle and bytes.
    pub fn chunk_at(&self, addr: usize) -> Option<(usize, PhysicalHandle, usize)> {
        let i = addr.checked_sub(self.base)? / self.page;
        let h = self.pages.get(i)?.handle?;
        let first = self.pages[i].chunk as usize;
        let len = self.pages[first].len as usize;
        Some((self.base + first * self.page, h, len * self.page))
    }

    /// Whether mapped page `i` is a one-page chunk, which may move.
    fn movable(&self, i: usize) -> bool {
        self.pages[self.pages[i].chunk as usize].len == 1
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
            self.pages.resize(span.end, UNMAPPED_PAGE);
        }
        let mut missing = 0usize;
        for i in span.clone() {
            let p = self.pages[i];
            if p.handle.is_none() {
                missing += 1;
            } else if p.refs == 0 {
                self.take_free(i);
            }
            self.pages[i].refs += 1;
        }
        if missing == 0 {
            return Ok(());
        }
        let mut moves = self.moves_for(missing);
        let mut created = missing - moves;
        if created > self.spare && self.idle_chunks > 0 {
            // Past the headroom (or the most pages), chunks of several pages that are wholly
            // free give their memory back before any is created.
            let released = crate::driver::capture::relaxed(|| {
                wait_for_free_pages(order, settled)?;
                self.release_held(backing)
            });
            match released {
                Ok(bytes) => self.spare += bytes / self.page,
                Err(e) => {
                    self.decommit(start, end);
                    return Err(e);
                }
            }
            moves = self.moves_for(missing);
            created = missing - moves;
        }
        if self.counters.mapped + created > self.max_pages {
            self.decommit(start, end);
            return Err(Error::OutOfMemory {
                bytes: end - start,
                resource: super::NAME,
                detail: format!(
                    "{missing} more page(s) of {} bytes to map, {} free to move, {} of {} mapped",
                    self.page,
                    self.free.len(),
                    self.counters.mapped,
                    self.max_pages
                ),
            });
        }
        // Relaxed, as PyTorch does around cudaMalloc: the driver calls of a map or a move (and
        // a stream's synchronisation) do not invalidate another thread's graph capture.
        let mapped = crate::driver::capture::relaxed(|| {
            self.map_missing(backing, order, settled, moves, span.clone())
        });
        if let Err(e) = mapped {
            self.decommit(start, end);
            return Err(e);
        }
        Ok(())
    }

    fn map_missing<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        order: &dyn StreamOrder,
        settled: Settled<'_>,
        moves: usize,
        span: std::ops::Range<usize>,
    ) -> Result<()> {
        if moves > 0 {
            wait_for_free_pages(order, settled)?;
        }
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
            Ok(())
        });
        if granted.is_err() {
            // Pages mapped now without access must never be handed out: take them back, a
            // chunk at a time (each was mapped whole, now).
            for &i in &mapped_now {
                if self.pages[i].chunk as usize != i {
                    continue;
                }
                let bytes = self.pages[i].len as usize * self.page;
                let h = self.pages[i].handle.expect("mapped just now");
                // SAFETY: mapped just now by us, never handed out (no access yet).
                unsafe {
                    if backing.unmap(self.base + i * self.page, bytes).is_ok() {
                        self.counters.unmaps += 1;
                    }
                    let _ = backing.release(h, bytes);
                }
                self.counters.releases += 1;
            }
            for &i in &mapped_now {
                self.set_handle(i, None);
                self.counters.mapped -= 1;
            }
        }
        granted
    }

    /// Maps every unmapped page of `span`, creating chunks while [`Pages::set_spare`] allows,
    /// then moving free pages' chunks, then creating again, and notes each in `mapped_now`.
    /// Consecutive pages that are all to be created share one chunk. Stops at the first failure.
    fn map_each<B: PhysicalBacking>(
        &mut self,
        backing: &B,
        span: std::ops::Range<usize>,
        mapped_now: &mut Vec<usize>,
    ) -> Result<()> {
        let mut i = span.start;
        while i < span.end {
            if self.pages[i].handle.is_some() {
                i += 1;
                continue;
            }
            let take = if self.spare > 0 {
                None
            } else {
                self.free.pop()
            };
            let (handle, len, moved) = match take {
                Some(j) => {
                    let j = j as usize;
                    let h = self.set_handle(j, None).expect("free pages are mapped");
                    self.pages[j].free_at = NOT_FREE;
                    self.counters.mapped -= 1;
                    let va = self.base + j * self.page;
                    // SAFETY: page `j` is a one-page chunk mapped by us with exactly this
                    // range, has no live block, and the device is idle (synchronised above).
                    if let Err(e) = unsafe { backing.unmap(va, self.page) } {
                        // Leave the page mapped and free, as it was.
                        self.set_handle(j, Some(h));
                        self.put_free(j);
                        self.counters.mapped += 1;
                        return Err(e);
                    }
                    self.counters.unmaps += 1;
                    (h, 1, true)
                }
                None => {
                    // The pages after `i` that this commit would create too.
                    let mut len = 1;
                    while i + len < span.end
                        && len < self.chunk_pages
                        && self.pages[i + len].handle.is_none()
                        && (self.spare > len || self.free.is_empty())
                    {
                        len += 1;
                    }
                    let h = backing.create(len * self.page)?;
                    self.spare = self.spare.saturating_sub(len);
                    (h, len, false)
                }
            };
            let (va, bytes) = (self.base + i * self.page, len * self.page);
            // SAFETY: pages `i..i + len` lie in our reservation, are aligned and unmapped;
            // `handle` is a live chunk of `len` pages, mapped nowhere.
            if let Err(e) = unsafe { backing.map(va, bytes, handle) } {
                // SAFETY: the chunk is mapped nowhere and no longer referenced.
                let _ = unsafe { backing.release(handle, bytes) };
                if moved {
                    self.counters.releases += 1;
                }
                return Err(e);
            }
            self.counters.maps += 1;
            for k in i..i + len {
                self.set_handle(k, Some(handle));
                self.pages[k].chunk = i as u32;
                mapped_now.push(k);
            }
            self.pages[i].len = len as u32;
            self.counters.mapped += len;
            self.counters.peak_mapped = self.counters.peak_mapped.max(self.counters.mapped);
            if moved {
                self.counters.moves += 1;
            } else {
                self.counters.creates += 1;
            }
            i += len;
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

    /// The list free page `i` belongs in: `free` for a one-page chunk, else `held`.
    fn list_of(&mut self, i: usize) -> &mut Vec<u32> {
        if self.movable(i) {
            &mut self.free
        } else {
            &mut self.held
        }
    }

    fn put_free(&mut self, i: usize) {
        if !self.movable(i) {
            let first = self.pages[i].chunk as usize;
            let f = &mut self.pages[first];
            f.idle += 1;
            if f.idle == f.len {
                self.idle_chunks += 1;
            }
        }
        let list = self.list_of(i);
        let at = list.len() as u32;
        list.push(i as u32);
        self.pages[i].free_at = at;
    }

    fn take_free(&mut self, i: usize) {
        if !self.movable(i) {
            let first = self.pages[i].chunk as usize;
            let f = &mut self.pages[first];
            if f.idle == f.len {
                self.idle_chunks -= 1;
            }
            f.idle -= 1;
        }
        let at = self.pages[i].free_at as usize;
        let list = self.list_of(i);
        debug_assert_eq!(list[at] as usize, i);
        list.swap_remove(at);
        if let Some(&moved) = list.get(at) {
            self.pages[moved as usize].free_at = at as u32;
        }
        self.pages[i].free_at = NOT_FREE;
    }

    /// Unmaps and releases every chunk of several pages whose pages are all free (the caller
    /// has waited for the work that used them). Returns the bytes released; stops at the first
    /// driver error.
    fn release_held<B: PhysicalBacking>(&mut self, backing: &B) -> Result<usize> {
        if self.idle_chunks == 0 {
            return Ok(0);
        }
        let mut firsts: Vec<usize> = self
            .held
            .iter()
            .map(|&i| self.pages[i as usize].chunk as usize)
            .collect();
        firsts.sort_unstable();
        firsts.dedup();
        let mut released = 0;
        for f in firsts {
            if self.pages[f].idle == self.pages[f].len {
                released += self.release_chunk(backing, f)?;
            }
        }
        Ok(released)
    }

    /// Unmaps and releases the chunk at page `f`, every page of which is free (the caller
    /// waited for the work that used them), and returns its bytes.
    fn release_chunk<B: PhysicalBacking>(&mut self, backing: &B, f: usize) -> Result<usize> {
        let len = self.pages[f].len as usize;
        let h = self.pages[f].handle.expect("free pages are mapped");
        let bytes = len * self.page;
        // SAFETY: a chunk we mapped whole at this range, with no live block on any of its
        // pages; the caller waited for the work that used them.
        unsafe { backing.unmap(self.base + f * self.page, bytes)? };
        self.counters.unmaps += 1;
        for k in f..f + len {
            self.take_free(k);
            self.set_handle(k, None);
        }
        self.pages[f].len = 0;
        self.counters.mapped -= len;
        self.counters.releases += 1;
        // SAFETY: just unmapped, referenced nowhere.
        unsafe { backing.release(h, bytes)? };
        Ok(bytes)
    }

    /// Unmaps and releases every free page, and every chunk of several pages that is wholly
    /// free (the caller has synchronised the device). Returns the bytes released; stops at the
    /// first driver error.
    pub fn trim<B: PhysicalBacking>(&mut self, backing: &B) -> Result<usize> {
        let mut released = self.release_held(backing)?;
        while let Some(&j) = self.free.last() {
            released += self.release_chunk(backing, j as usize)?;
        }
        Ok(released)
    }

    /// Unmaps and releases every mapped page, for drop (errors ignored: drop cannot report).
    pub fn release_all<B: PhysicalBacking>(&mut self, backing: &B) {
        self.stale.set(true);
        for i in 0..self.pages.len() {
            let p = self.pages[i];
            if let (Some(h), true) = (p.handle, p.chunk as usize == i) {
                let bytes = p.len as usize * self.page;
                // SAFETY: the resource is being dropped after a device-wide synchronisation; no
                // block outlives it. Each chunk is unmapped whole, once, from its first page.
                unsafe {
                    let _ = backing.unmap(self.base + i * self.page, bytes);
                    let _ = backing.release(h, bytes);
                }
            }
        }
        self.pages.fill(UNMAPPED_PAGE);
        self.free.clear();
        self.held.clear();
        self.idle_chunks = 0;
        self.counters.mapped = 0;
    }
}

/// Waits for the work that may still use free pages (queued before their blocks were freed),
/// as `settled` says.
fn wait_for_free_pages(order: &dyn StreamOrder, settled: Settled<'_>) -> Result<()> {
    match settled {
        Settled::Device => Ok(()),
        Settled::ByStream(stream) => order.synchronize(stream),
        Settled::No => order.synchronize_all(),
    }
}

#[path = "pages_check.rs"]
mod check;
#[path = "pages_placer.rs"]
mod placer;

#[cfg(test)]
#[path = "pages_tests.rs"]
mod tests;
