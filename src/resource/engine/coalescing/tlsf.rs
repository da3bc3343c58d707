//! A two-level segregated fit index (TLSF) of free blocks: size classes of a power of two split
//! into 32 linear steps, an intrusive doubly linked list per class, and two bitmap levels, so
//! insert, remove and "a block of at least this size" are O(1) with a few bit operations.
//!
//! Sizes are in grains (256 bytes); nodes live in the core's node array, which supplies links.

pub(crate) const NIL: u32 = u32::MAX;

const SL_BITS: u32 = 5;
const SL: usize = 1 << SL_BITS;
/// Classes: one linear class below `SL` grains, then one per power of two up to 2^63 grains.
const FL: usize = 64 - SL_BITS as usize + 1;

/// Free-list links, stored in the caller's nodes.
pub(crate) trait FreeLinks {
    fn units(&self, node: u32) -> usize;
    fn link(&mut self, node: u32) -> &mut (u32, u32);
}

/// The class `(fl, sl)` a block of `units` grains is filed under.
#[inline]
fn class_of(units: usize) -> (usize, usize) {
    if units < SL {
        (0, units)
    } else {
        let f = usize::BITS - 1 - units.leading_zeros();
        (
            (f - SL_BITS + 1) as usize,
            (units >> (f - SL_BITS)) & (SL - 1),
        )
    }
}

/// The first class whose every block holds `units` grains.
#[inline]
fn class_at_least(units: usize) -> Option<(usize, usize)> {
    if units < SL {
        return Some((0, units));
    }
    let f = usize::BITS - 1 - units.leading_zeros();
    let rounded = units.checked_add((1usize << (f - SL_BITS)) - 1)?;
    Some(class_of(rounded))
}

#[derive(Clone, Debug)]
pub(crate) struct Tlsf {
    fl_map: u64,
    sl_map: [u32; FL],
    heads: Box<[u32]>,
    len: usize,
    units: usize,
}

impl Default for Tlsf {
    fn default() -> Self {
        Tlsf {
            fl_map: 0,
            sl_map: [0; FL],
            heads: vec![NIL; FL * SL].into_boxed_slice(),
            len: 0,
            units: 0,
        }
    }
}

impl Tlsf {
    /// Blocks filed.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn insert(&mut self, links: &mut impl FreeLinks, node: u32) {
        let u = links.units(node);
        let (f, s) = class_of(u);
        let i = f * SL + s;
        let head = self.heads[i];
        *links.link(node) = (NIL, head);
        if head != NIL {
            links.link(head).0 = node;
        }
        self.heads[i] = node;
        self.fl_map |= 1 << f;
        self.sl_map[f] |= 1 << s;
        self.len += 1;
        self.units += u;
    }

    /// Unfiles `node`, which must be filed here with its current size.
    pub fn remove(&mut self, links: &mut impl FreeLinks, node: u32) {
        let u = links.units(node);
        let (prev, next) = *links.link(node);
        if next != NIL {
            links.link(next).0 = prev;
        }
        if prev != NIL {
            links.link(prev).1 = next;
        } else {
            let (f, s) = class_of(u);
            let i = f * SL + s;
            debug_assert_eq!(self.heads[i], node);
            self.heads[i] = next;
            if next == NIL {
                self.sl_map[f] &= !(1 << s);
                if self.sl_map[f] == 0 {
                    self.fl_map &= !(1 << f);
                }
            }
        }
        self.len -= 1;
        self.units -= u;
    }

    /// A block of at least `units` grains in O(1), if one is filed in a class above the
    /// request's own (the own class may hold smaller blocks: see [`Tlsf::find_in_class`]).
    #[inline]
    pub fn find(&self, units: usize) -> Option<u32> {
        let (f, s) = class_at_least(units)?;
        if f >= FL {
            return None;
        }
        let sl = self.sl_map[f] & (!0u32).checked_shl(s as u32).unwrap_or(0);
        let (f, sl) = if sl != 0 {
            (f, sl)
        } else {
            let fl = self.fl_map & (!0u64).checked_shl(f as u32 + 1).unwrap_or(0);
            if fl == 0 {
                return None;
            }
            let f = fl.trailing_zeros() as usize;
            (f, self.sl_map[f])
        };
        Some(self.heads[f * SL + sl.trailing_zeros() as usize])
    }

    /// The smallest block of at least `units` grains in the request's own class (a list walk:
    /// only for when [`Tlsf::find`] came up empty, before anything costlier).
    pub fn find_in_class(&self, links: &mut impl FreeLinks, units: usize) -> Option<u32> {
        let (f, s) = class_of(units);
        let mut at = self.heads[f * SL + s];
        let mut best: Option<(usize, u32)> = None;
        while at != NIL {
            let u = links.units(at);
            if u >= units && best.is_none_or(|(b, _)| u < b) {
                best = Some((u, at));
            }
            at = links.link(at).1;
        }
        best.map(|(_, n)| n)
    }

    /// Appends to `out` up to `limit` filed blocks of at least `units` grains, smallest
    /// classes first (list walks: for searches that weigh more than size, off the hot path).
    pub fn fitting(
        &self,
        links: &mut impl FreeLinks,
        units: usize,
        limit: usize,
        out: &mut Vec<u32>,
    ) {
        let (f0, s0) = class_of(units);
        let mut taken = 0;
        // Only the first-level classes that hold blocks.
        let mut fl = self.fl_map & (!0u64).checked_shl(f0 as u32).unwrap_or(0);
        while fl != 0 {
            let f = fl.trailing_zeros() as usize;
            fl &= fl - 1;
            let mut map = self.sl_map[f];
            if f == f0 {
                map &= (!0u32).checked_shl(s0 as u32).unwrap_or(0);
            }
            while map != 0 {
                let s = map.trailing_zeros() as usize;
                map &= map - 1;
                let mut at = self.heads[f * SL + s];
                while at != NIL {
                    if taken == limit {
                        return;
                    }
                    if links.units(at) >= units {
                        out.push(at);
                        taken += 1;
                    }
                    at = links.link(at).1;
                }
            }
        }
    }

    /// The largest filed block's grains (walks the top class only).
    pub fn largest(&self, links: &mut impl FreeLinks) -> usize {
        if self.fl_map == 0 {
            return 0;
        }
        let f = 63 - self.fl_map.leading_zeros() as usize;
        let s = 31 - self.sl_map[f].leading_zeros() as usize;
        let mut at = self.heads[f * SL + s];
        let mut max = 0;
        while at != NIL {
            max = max.max(links.units(at));
            at = links.link(at).1;
        }
        max
    }

    /// Every filed node (for moving a whole index and for checks).
    pub fn nodes(&self, links: &mut impl FreeLinks) -> Vec<u32> {
        let mut out = Vec::with_capacity(self.len);
        for &h in self.heads.iter().filter(|&&h| h != NIL) {
            let mut at = h;
            while at != NIL {
                out.push(at);
                at = links.link(at).1;
            }
        }
        out
    }

    /// Checks lists against bitmaps, classes, back links and counters.
    pub fn check(&self, links: &mut impl FreeLinks) -> Result<(), String> {
        let (mut len, mut units) = (0, 0);
        for f in 0..FL {
            for s in 0..SL {
                let head = self.heads[f * SL + s];
                let bit = self.sl_map[f] & (1 << s) != 0;
                if bit != (head != NIL) {
                    return Err(format!("class ({f},{s}) bitmap disagrees with its list"));
                }
                let mut prev = NIL;
                let mut at = head;
                while at != NIL {
                    let u = links.units(at);
                    if class_of(u) != (f, s) {
                        return Err(format!("node {at} of {u} grains filed in ({f},{s})"));
                    }
                    let (p, n) = *links.link(at);
                    if p != prev {
                        return Err(format!("node {at} has a stale back link"));
                    }
                    len += 1;
                    units += u;
                    if len > self.len {
                        return Err("a free list cycles".into());
                    }
                    prev = at;
                    at = n;
                }
            }
            if (self.fl_map & (1 << f) != 0) != (self.sl_map[f] != 0) {
                return Err(format!("first-level bit {f} disagrees"));
            }
        }
        if len != self.len || units != self.units {
            return Err(format!(
                "index counts {}/{} but holds {len}/{units}",
                self.len, self.units
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nodes(Vec<(usize, (u32, u32))>);
    impl FreeLinks for Nodes {
        fn units(&self, n: u32) -> usize {
            self.0[n as usize].0
        }
        fn link(&mut self, n: u32) -> &mut (u32, u32) {
            &mut self.0[n as usize].1
        }
    }

    /// The smallest size filed in class `(f, s)`.
    fn lowest(f: usize, s: usize) -> usize {
        if f == 0 {
            s
        } else {
            (SL + s) << (f - 1)
        }
    }

    #[test]
    fn classes_are_ordered_and_find_never_returns_too_small() {
        let mut last = (0, 0);
        for u in (1..200_000usize).chain([usize::MAX >> 9, (1 << 40) + 12345]) {
            let c = class_of(u);
            assert!(c >= last || u > 200_000, "{u}");
            last = c;
            assert!(lowest(c.0, c.1) <= u, "{u} below its class");
            // Every size filed in the search class (or above) holds at least u.
            let (f, s) = class_at_least(u).unwrap();
            assert!(
                lowest(f, s) >= u,
                "{u}: class ({f},{s}) starts at {}",
                lowest(f, s)
            );
            // And the search class is the next one up at most: no needless skipping.
            assert!((f, s) == c || lowest(c.0, c.1) < u, "{u}");
        }
    }

    #[test]
    fn insert_find_remove() {
        let sizes = [1usize, 5, 31, 32, 33, 100, 1000, 1 << 20, 3 << 20];
        let mut nodes = Nodes(sizes.iter().map(|&s| (s, (NIL, NIL))).collect());
        let mut t = Tlsf::default();
        for i in 0..sizes.len() as u32 {
            t.insert(&mut nodes, i);
        }
        t.check(&mut nodes).unwrap();
        assert_eq!(t.largest(&mut nodes), 3 << 20);
        let n = t.find(34).unwrap();
        assert!(nodes.units(n) >= 34);
        assert_eq!(t.find(4 << 20), None);
        assert_eq!(t.find_in_class(&mut nodes, 1000), Some(6));
        let mut fit = vec![];
        t.fitting(&mut nodes, 33, usize::MAX, &mut fit);
        fit.sort_unstable();
        assert_eq!(
            fit,
            vec![4, 5, 6, 7, 8],
            "every block of at least 33 grains"
        );
        fit.clear();
        t.fitting(&mut nodes, 33, 2, &mut fit);
        assert_eq!(fit.len(), 2);
        assert!(fit.iter().all(|&n| nodes.units(n) >= 33));
        for i in 0..sizes.len() as u32 {
            t.remove(&mut nodes, i);
            t.check(&mut nodes).unwrap();
        }
        assert!(t.is_empty() && t.find(1).is_none());
    }
}
