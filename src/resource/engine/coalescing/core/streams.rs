//! Which stream may take which free block: the per-stream tags and bins, sealing a stream's
//! blocks after a mark, and handing them to other streams once the order allows.

use super::{footprint, PoolCore, QUERY_EVERY};
use crate::resource::engine::coalescing::node::{
    fresh_bin, sealed_bin, tag_of_bin, Tag, ANY, GRAIN,
};
use crate::resource::engine::coalescing::tlsf::Tlsf;
use crate::stream::StreamId;

impl PoolCore {
    /// The best fit among other streams' sealed blocks: (that stream, the block).
    pub fn sealed_fit_elsewhere(
        &mut self,
        stream: StreamId,
        bytes: usize,
        align: usize,
    ) -> Option<(StreamId, u32)> {
        let (_, search) = footprint(bytes, align)?;
        let bins: Vec<u32> = (0..self.tags.len())
            .filter(|&t| {
                self.tags[t].stream != stream && !self.bins[sealed_bin(t) as usize].is_empty()
            })
            .map(sealed_bin)
            .collect();
        let node = self.fit(&bins, search / GRAIN)?;
        let t = tag_of_bin(self.nodes[node as usize].bin).expect("a sealed bin");
        Some((self.tags[t].stream, node))
    }

    /// Hands another stream's free block to `stream`, coalescing (the caller has ordered
    /// `stream` after the block's last use).
    pub fn adopt(&mut self, node: u32, stream: StreamId) {
        let t = self.tag(stream);
        self.unfile(node);
        self.coalesce_into(node, fresh_bin(t));
    }

    /// True when streams other than `stream` hold free blocks.
    pub fn others_hold_free(&self, stream: StreamId) -> bool {
        self.tags.iter().enumerate().any(|(t, tag)| {
            tag.stream != stream
                && !(self.bins[fresh_bin(t) as usize].is_empty()
                    && self.bins[sealed_bin(t) as usize].is_empty())
        })
    }

    /// After a device-wide synchronisation: every free block becomes free to any stream, and
    /// neighbours merge.
    pub fn merge_all(&mut self) {
        for bin in 1..self.bins.len() as u32 {
            while let Some(n) = self.bins[bin as usize].find(1) {
                self.unfile(n);
                self.coalesce_into(n, ANY);
            }
        }
        for tag in &mut self.tags {
            tag.frees_since_mark = 0;
            tag.unconfirmed = false;
        }
        self.unconfirmed = false;
    }

    /// After a mark on `stream`: its fresh blocks become sealed.
    pub fn seal(&mut self, stream: StreamId) {
        let t = self.tag(stream);
        let (fresh, sealed) = (fresh_bin(t), sealed_bin(t));
        while let Some(n) = self.bins[fresh as usize].find(1) {
            self.unfile(n);
            self.file(n, sealed);
        }
        let tag = &mut self.tags[t];
        tag.frees_since_mark = 0;
        tag.demand_seen = self.demand;
        if self.mark_every_free && !self.bins[sealed as usize].is_empty() {
            tag.unconfirmed = true;
            self.unconfirmed = true;
        }
    }

    /// Hands to every stream the sealed blocks of each stream but `stream` whose last mark
    /// `done` confirms (a driver query each, at most once per [`QUERY_EVERY`] allocations per
    /// stream while the answer is no). Their neighbours merge.
    pub(super) fn release_confirmed(
        &mut self,
        stream: StreamId,
        mut done: impl FnMut(StreamId) -> bool,
    ) {
        let mut left = false;
        for t in 0..self.tags.len() {
            let tag = self.tags[t];
            if !tag.unconfirmed {
                continue;
            }
            let sealed = sealed_bin(t);
            if self.bins[sealed as usize].is_empty() {
                self.tags[t].unconfirmed = false;
                continue;
            }
            if tag.stream == stream || self.allocs < tag.query_at {
                left = true;
                continue;
            }
            if !done(tag.stream) {
                self.tags[t].query_at = self.allocs + QUERY_EVERY;
                left = true;
                continue;
            }
            while let Some(n) = self.bins[sealed as usize].find(1) {
                self.unfile(n);
                self.coalesce_into(n, ANY);
            }
            self.tags[t].unconfirmed = false;
        }
        self.unconfirmed = left;
    }

    /// Records that a stream found too few blocks of its own (see [`Freed::mark_due`]).
    pub fn note_demand(&mut self) {
        self.demand += 1;
    }

    #[inline]
    pub(super) fn tag(&mut self, stream: StreamId) -> usize {
        if self
            .tags
            .get(self.last_tag)
            .is_some_and(|t| t.stream == stream)
        {
            return self.last_tag;
        }
        let t = match self.tags.iter().position(|t| t.stream == stream) {
            Some(t) => t,
            None => self.new_tag(stream),
        };
        self.last_tag = t;
        t
    }

    #[cold]
    pub(super) fn new_tag(&mut self, stream: StreamId) -> usize {
        let tag = Tag {
            stream,
            frees_since_mark: 0,
            demand_seen: self.demand,
            last_alloc: 0,
            unconfirmed: false,
            query_at: 0,
        };
        if self.tags.len() >= 16 {
            let idle = (0..self.tags.len()).find(|&t| {
                self.bins[fresh_bin(t) as usize].is_empty()
                    && self.bins[sealed_bin(t) as usize].is_empty()
            });
            if let Some(t) = idle {
                self.tags[t] = tag;
                return t;
            }
        }
        self.tags.push(tag);
        self.bins.push(Tlsf::default());
        self.bins.push(Tlsf::default());
        self.tags.len() - 1
    }
}
