//! [`Pages::check`]: the page table against the live blocks, for `check_invariants`.

use super::{Pages, NOT_FREE};

impl Pages {
    /// Checks the table against `live` (start, end) ranges: reference counts, the free list,
    /// and the mapped count.
    pub fn check(&self, live: &[(usize, usize)]) -> std::result::Result<(), String> {
        let mut refs = vec![0u32; self.pages.len()];
        for &(s, e) in live {
            for i in self.span(s, e) {
                *refs
                    .get_mut(i)
                    .ok_or(format!("live block {s:#x} beyond the page table"))? += 1;
            }
        }
        let mut mapped = 0;
        for (i, p) in self.pages.iter().enumerate() {
            if p.refs != refs[i] {
                return Err(format!(
                    "page {i}: {} refs, {} live blocks",
                    p.refs, refs[i]
                ));
            }
            if p.refs > 0 && p.handle.is_none() {
                return Err(format!("page {i} holds a live block but is not mapped"));
            }
            let is_free = p.handle.is_some() && p.refs == 0;
            if is_free != (p.free_at != NOT_FREE)
                || (is_free && self.free.get(p.free_at as usize) != Some(&(i as u32)))
            {
                return Err(format!("page {i}: free list disagrees"));
            }
            mapped += usize::from(p.handle.is_some());
        }
        if !self.stale.get() {
            // It may end before the table: pages appended since are unmapped, as it assumes.
            let m = self.mapped_before.borrow();
            let mut run = 0;
            let fresh = m.len() <= self.pages.len() + 1
                && self.pages.iter().enumerate().all(|(i, p)| {
                    run += u32::from(p.handle.is_some());
                    m.get(i + 1).map_or(p.handle.is_none(), |&k| k == run)
                });
            if !fresh {
                return Err("the prefix count of mapped pages is out of date".into());
            }
        }
        if mapped != self.counters.mapped || mapped + self.unreleased.len() > self.max_pages {
            return Err(format!(
                "{mapped} pages mapped, counted {}, {} chunks unreleased (max {})",
                self.counters.mapped,
                self.unreleased.len(),
                self.max_pages
            ));
        }
        Ok(())
    }
}
