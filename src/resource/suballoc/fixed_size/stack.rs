//! A lock-free Treiber stack of block indices. The head packs `(generation << 32) | index` into
//! one `AtomicU64`; every successful update bumps the generation, so a head that was popped and
//! pushed back (ABA) no longer compares equal and a stale `next` is never installed.
//!
//! Links live outside the stack (one `AtomicU32` per block, in host memory), so several stacks
//! can share them: a block is in at most one stack at a time.
//!
//! A stack that changes owner is [closed](TaggedStack::close_if_empty) while its owner's key
//! changes: [`pop_if`](TaggedStack::pop_if) and [`push_if`](TaggedStack::push_if) check the
//! owner between reading the head and swapping it, so an operation that began for the old owner
//! either lands before the close or sees the new owner and touches nothing.

use crate::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The empty link.
pub(crate) const NIL: u32 = u32::MAX;
/// The head of a closed stack (never a block index: indices stay below `NIL - 1`).
const CLOSED: u32 = u32::MAX - 1;

/// The stack changed owner (or is changing it) under the caller, who touched nothing.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Moved;

/// Where the `next` link of each block index lives.
pub(crate) trait Links {
    fn next(&self, index: u32) -> &AtomicU32;
}

#[inline]
fn pack(generation: u32, index: u32) -> u64 {
    ((generation as u64) << 32) | index as u64
}
#[inline]
fn index(head: u64) -> u32 {
    head as u32
}
#[inline]
fn generation(head: u64) -> u32 {
    (head >> 32) as u32
}

#[derive(Debug)]
pub(crate) struct TaggedStack {
    head: AtomicU64,
}

impl TaggedStack {
    pub fn new() -> Self {
        TaggedStack {
            head: AtomicU64::new(pack(0, NIL)),
        }
    }

    /// Acquire, so that a caller who sees a stack emptied by `take_all` also sees what the
    /// taker did before (the fixed-size resource's seal epoch relies on it).
    pub fn is_empty(&self) -> bool {
        matches!(index(self.head.load(Ordering::Acquire)), NIL | CLOSED)
    }

    /// Pops one index (none from a closed stack).
    pub fn pop(&self, links: &impl Links) -> Option<u32> {
        self.pop_if(links, || true).unwrap_or(None)
    }

    /// Pops one index while `owned()` holds, checked after each read of the head. Acquire on
    /// the head, so a head written after a change of owner shows the new owner to `owned`.
    pub fn pop_if(
        &self,
        links: &impl Links,
        owned: impl Fn() -> bool,
    ) -> Result<Option<u32>, Moved> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            let top = index(head);
            if top == CLOSED || !owned() {
                return Err(Moved);
            }
            if top == NIL {
                return Ok(None);
            }
            // May be stale if `top` was popped meanwhile; then the generation moved on and the
            // exchange below fails.
            let next = links.next(top).load(Ordering::Relaxed);
            let new = pack(generation(head).wrapping_add(1), next);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Acquire, Ordering::Acquire)
            {
                Ok(_) => return Ok(Some(top)),
                Err(now) => head = now,
            }
        }
    }

    /// Pushes the chain `first -> ... -> last` (already linked, owned by the caller) onto a
    /// stack that no one closes meanwhile.
    pub fn push_chain(&self, links: &impl Links, first: u32, last: u32) {
        let pushed = self.push_if(links, first, last, || true);
        debug_assert!(pushed.is_ok(), "push onto a closed stack");
    }

    /// Pushes the chain while `owned()` holds, checked as in [`pop_if`](Self::pop_if).
    pub fn push_if(
        &self,
        links: &impl Links,
        first: u32,
        last: u32,
        owned: impl Fn() -> bool,
    ) -> Result<(), Moved> {
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            if index(head) == CLOSED || !owned() {
                return Err(Moved);
            }
            links.next(last).store(index(head), Ordering::Relaxed);
            let new = pack(generation(head).wrapping_add(1), first);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::Release, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => head = now,
            }
        }
    }

    pub fn push(&self, links: &impl Links, index: u32) {
        self.push_chain(links, index, index);
    }

    /// Closes the stack if it is empty: until [`reopen`](Self::reopen), every push and pop
    /// fails (`pop_if`, `push_if`) or finds nothing (`pop`, `take_all`).
    pub fn close_if_empty(&self) -> bool {
        let head = self.head.load(Ordering::Acquire);
        index(head) == NIL
            && self
                .head
                .compare_exchange(
                    head,
                    pack(generation(head).wrapping_add(1), CLOSED),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Reopens a stack the caller closed, empty. Release: an operation that reads the reopened
    /// head sees what the closer did before (the new owner's key).
    pub fn reopen(&self) {
        let head = self.head.load(Ordering::Relaxed);
        debug_assert_eq!(index(head), CLOSED, "reopening a stack that is not closed");
        // Nothing else writes a closed head, so a plain store cannot lose an update.
        self.head.store(
            pack(generation(head).wrapping_add(1), NIL),
            Ordering::Release,
        );
    }

    /// Detaches the whole stack; returns the first index of the chain (ending in [`NIL`]).
    pub fn take_all(&self) -> Option<u32> {
        // Acquire even when it finds the stack empty (see `is_empty`).
        let mut head = self.head.load(Ordering::Acquire);
        loop {
            if matches!(index(head), NIL | CLOSED) {
                return None;
            }
            let new = pack(generation(head).wrapping_add(1), NIL);
            match self
                .head
                .compare_exchange_weak(head, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(index(head)),
                Err(now) => head = now,
            }
        }
    }

    /// The indices on the stack, top first. Only meaningful while no thread modifies it.
    pub fn snapshot(&self, links: &impl Links, limit: usize) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = index(self.head.load(Ordering::Acquire));
        while at != NIL && at != CLOSED && out.len() <= limit {
            out.push(at);
            at = links.next(at).load(Ordering::Relaxed);
        }
        out
    }
}

/// The last index of a detached chain that starts at `first`.
pub(crate) fn chain_tail(links: &impl Links, first: u32) -> u32 {
    let mut at = first;
    loop {
        let next = links.next(at).load(Ordering::Relaxed);
        if next == NIL {
            return at;
        }
        at = next;
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;

    struct Vec32(Vec<AtomicU32>);
    impl Links for Vec32 {
        fn next(&self, i: u32) -> &AtomicU32 {
            &self.0[i as usize]
        }
    }

    #[test]
    fn lifo_order_chains_and_take_all() {
        let links = Vec32((0..8).map(|_| AtomicU32::new(NIL)).collect());
        let s = TaggedStack::new();
        assert_eq!(s.pop(&links), None);
        s.push(&links, 3);
        s.push(&links, 5);
        links.next(0).store(1, Ordering::Relaxed);
        links.next(1).store(2, Ordering::Relaxed);
        s.push_chain(&links, 0, 2);
        assert_eq!(s.snapshot(&links, 10), vec![0, 1, 2, 5, 3]);
        assert_eq!(s.pop(&links), Some(0));
        let chain = s.take_all().unwrap();
        assert!(s.is_empty());
        assert_eq!(chain, 1);
        assert_eq!(chain_tail(&links, chain), 3);
    }

    #[test]
    fn a_closed_stack_refuses_checked_pushes_and_pops_until_reopened() {
        let links = Vec32((0..4).map(|_| AtomicU32::new(NIL)).collect());
        let s = TaggedStack::new();
        s.push(&links, 1);
        assert!(!s.close_if_empty(), "not empty");
        assert_eq!(s.pop_if(&links, || true), Ok(Some(1)));
        assert_eq!(s.pop_if(&links, || false), Err(Moved));
        assert!(s.close_if_empty());
        assert!(s.is_empty());
        assert_eq!(s.pop(&links), None);
        assert_eq!(s.take_all(), None);
        assert_eq!(s.pop_if(&links, || true), Err(Moved));
        assert_eq!(s.push_if(&links, 2, 2, || true), Err(Moved));
        s.reopen();
        assert_eq!(s.push_if(&links, 2, 2, || false), Err(Moved));
        assert_eq!(s.push_if(&links, 2, 2, || true), Ok(()));
        assert_eq!(s.snapshot(&links, 4), vec![2]);
    }

    #[test]
    fn threads_never_pop_the_same_index_twice() {
        const N: u32 = 64;
        let links = Vec32((0..N).map(|_| AtomicU32::new(NIL)).collect());
        let s = TaggedStack::new();
        for i in 0..N {
            s.push(&links, i);
        }
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..20_000 {
                        let mut mine = Vec::new();
                        while mine.len() < 8 {
                            if let Some(i) = s.pop(&links) {
                                mine.push(i);
                            }
                        }
                        for i in mine {
                            s.push(&links, i);
                        }
                    }
                });
            }
        });
        let mut all = s.snapshot(&links, N as usize);
        all.sort_unstable();
        assert_eq!(all, (0..N).collect::<Vec<_>>());
    }
}
