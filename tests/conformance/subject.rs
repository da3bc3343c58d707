//! What a check is given: the environment it runs in, and the resource with what it promises.

use std::io::Write;
use std::sync::Arc;

use carve::resource::RecordingOrder;
use carve::{MemoryResource, StreamRef};

/// Where the checks run: the streams they use and how the stream-order check is done.
pub trait Env: Sync {
    /// Stream `i`, for `i` in `0..STREAMS`. Distinct `i` give distinct streams.
    fn stream(&self, i: usize) -> StreamRef<'_>;

    /// Waits until every stream's queued work is done.
    fn synchronize(&self);

    /// Checks that a block freed on one stream reaches another only after the first stream's
    /// work up to the free (see [`recorded_stream_order`] for the CPU form).
    fn stream_order<R: MemoryResource>(&self, name: &str, make: &dyn Fn() -> Subject<R>);

    /// Runs after a check, once every resource it built is dropped: what the environment can
    /// see of its upstreams must be back where it started (nothing leaked).
    fn finish(&self, _name: &str) {}
}

/// Streams an [`Env`] provides.
pub const STREAMS: usize = 4;

/// How much a resource says is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Bytes in live blocks, as the resource counts them (it may round up).
    pub bytes: usize,
    /// Live blocks, where the resource counts them.
    pub blocks: Option<usize>,
}

impl Usage {
    /// `bytes` in `blocks` live blocks.
    pub fn new(bytes: usize, blocks: usize) -> Self {
        Usage {
            bytes,
            blocks: Some(blocks),
        }
    }

    /// `bytes` in use, blocks not counted.
    pub fn bytes(bytes: usize) -> Self {
        Usage {
            bytes,
            blocks: None,
        }
    }
}

/// Whether a resource refuses a kind of bad free with a typed error.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Detect {
    /// Refused with a typed error, state untouched.
    Refused,
    /// Accepted by design, for the documented reason: the check asserts that the free succeeds
    /// (a sibling's block; a size smaller than the block's).
    Accepted(&'static str),
    /// Cannot be detected, for the documented reason; the check does not attempt it (it would be
    /// undefined behaviour or free someone's block) and prints the reason.
    Unchecked(&'static str),
}

/// How a resource orders a block freed on one stream before another stream gets it.
#[derive(Clone, Debug)]
pub enum Order {
    /// Not stated: the CPU stream-order check fails and asks for a statement. (The GPU check
    /// needs none: it watches what real streams do to the memory.)
    Unstated,
    /// Its ordering goes through this [`RecordingOrder`]: every cross-stream reuse is checked
    /// against the log.
    Recorded(Arc<RecordingOrder>),
    /// Frees take effect at once, for the documented reason (host memory: no stream work).
    AtOnce(&'static str),
}

/// Reads a resource's statistics.
pub type Probe<R> = fn(&R) -> Usage;

/// Checks a resource's internal consistency.
pub type Check<R> = fn(&R) -> Result<(), String>;

/// What the suite needs to know about one resource: the resource itself and what it promises.
pub struct Subject<R> {
    /// The resource under test.
    pub mr: R,
    /// Largest alignment it honours; above it, [`carve::Error::Unsupported`].
    pub max_align: usize,
    /// Largest request it serves; above it, [`carve::Error::InvalidArgument`].
    pub max_bytes: usize,
    /// A pointer it never handed out (a stack address, an interior pointer).
    pub foreign: Detect,
    /// A block freed twice.
    pub double_free: Detect,
    /// A block freed with another size.
    pub size_mismatch: Detect,
    /// A block of another instance built the same way.
    pub sibling: Detect,
    /// Its statistics, or why it has none.
    pub usage: Result<Probe<R>, &'static str>,
    /// Its internal consistency check, if it has one.
    pub invariants: Option<Check<R>>,
    /// How it orders frees between streams.
    pub order: Order,
}

impl<R: MemoryResource> Subject<R> {
    /// A resource that promises everything: any alignment and size, every bad free refused.
    /// Statistics and stream order must be stated with the builder methods.
    pub fn new(mr: R) -> Self {
        Subject {
            mr,
            max_align: usize::MAX,
            max_bytes: usize::MAX,
            foreign: Detect::Refused,
            double_free: Detect::Refused,
            size_mismatch: Detect::Refused,
            sibling: Detect::Refused,
            usage: Err("no statistics stated in the list entry"),
            invariants: None,
            order: Order::Unstated,
        }
    }

    /// Alignments above `n` are refused with `Unsupported`.
    pub fn max_align(mut self, n: usize) -> Self {
        self.max_align = n;
        self
    }

    /// Requests above `n` bytes are refused with `InvalidArgument`.
    pub fn max_bytes(mut self, n: usize) -> Self {
        self.max_bytes = n;
        self
    }

    /// How to read its statistics.
    pub fn usage(mut self, f: fn(&R) -> Usage) -> Self {
        self.usage = Ok(f);
        self
    }

    /// It keeps no statistics, for this reason.
    pub fn no_usage(mut self, why: &'static str) -> Self {
        self.usage = Err(why);
        self
    }

    /// Its consistency check.
    pub fn invariants(mut self, f: Check<R>) -> Self {
        self.invariants = Some(f);
        self
    }

    /// It orders streams through `order`.
    pub fn recorded(mut self, order: &Arc<RecordingOrder>) -> Self {
        self.order = Order::Recorded(order.clone());
        self
    }

    /// Its frees take effect at once, for this reason.
    pub fn frees_at_once(mut self, why: &'static str) -> Self {
        self.order = Order::AtOnce(why);
        self
    }

    /// It cannot detect a foreign pointer.
    pub fn foreign_unchecked(mut self, why: &'static str) -> Self {
        self.foreign = Detect::Unchecked(why);
        self
    }

    /// It cannot detect a double free.
    pub fn double_free_unchecked(mut self, why: &'static str) -> Self {
        self.double_free = Detect::Unchecked(why);
        self
    }

    /// It cannot detect a free with the wrong size.
    pub fn size_mismatch_unchecked(mut self, why: &'static str) -> Self {
        self.size_mismatch = Detect::Unchecked(why);
        self
    }

    /// It frees a block freed with a smaller size, by design.
    pub fn size_mismatch_accepted(mut self, why: &'static str) -> Self {
        self.size_mismatch = Detect::Accepted(why);
        self
    }

    /// It frees a sibling instance's blocks, by design.
    pub fn sibling_accepted(mut self, why: &'static str) -> Self {
        self.sibling = Detect::Accepted(why);
        self
    }

    /// It cannot tell its blocks from a sibling instance's.
    pub fn sibling_unchecked(mut self, why: &'static str) -> Self {
        self.sibling = Detect::Unchecked(why);
        self
    }

    /// Its statistics now, if it keeps any.
    pub fn usage_now(&self) -> Option<Usage> {
        self.usage.ok().map(|f| f(&self.mr))
    }

    /// Runs its consistency check, if any, panicking with `when` on failure.
    pub fn assert_invariants(&self, name: &str, when: &str) {
        if let Some(f) = self.invariants {
            if let Err(e) = f(&self.mr) {
                panic!("{name}: invariants broken {when}: {e}");
            }
        }
    }
}

/// Prints a note past the test harness's capture, so that what a check could not assert is
/// always visible.
pub fn note(name: &str, what: &str) {
    let _ = writeln!(std::io::stderr(), "NOTE {name}: {what}");
}
