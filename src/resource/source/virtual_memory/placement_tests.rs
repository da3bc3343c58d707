//! Where blocks go: free space on mapped pages before address space whose pages are unmapped,
//! so chunks move only when no mapped spot can hold a block.

use std::sync::Arc;

use super::*;
use crate::resource::engine::stream_order::{OrderEvent, RecordingOrder};

const MIB: usize = 1 << 20;
const PAGE: usize = 2 * MIB;
const A: StreamRef<'static> = StreamRef::simulated(1);
const B: StreamRef<'static> = StreamRef::simulated(2);

type Sim = VirtualMemoryResource<Arc<SimulatedBacking>>;

fn expandable(order: Option<Arc<RecordingOrder>>) -> Sim {
    let backing = Arc::new(SimulatedBacking::new(64 * MIB, PAGE).unwrap());
    let mut o = VirtualOptions::expandable().maximum(64 * MIB);
    if let Some(order) = order {
        o = o.order(order);
    }
    VirtualMemoryResource::new(backing, o).unwrap()
}

fn alloc(r: &Sim, s: StreamRef<'_>, bytes: usize) -> usize {
    r.allocate(s, bytes, 256).unwrap().as_ptr() as usize
}

fn free(r: &Sim, s: StreamRef<'_>, p: usize, bytes: usize) {
    // SAFETY: simulated memory is never touched; the block came from `r` with `bytes`.
    unsafe { r.deallocate(s, NonNull::new(p as *mut u8).unwrap(), bytes, 256) }.unwrap()
}

/// Pages 0-2: a freed 6 MiB block (mapped); 3: live; 4-5: a freed 4 MiB block whose pages were
/// trimmed; 6: live. Returns the 6 MiB block's address. `a_on` frees the 6 MiB block.
fn two_holes(r: &Sim, a_on: StreamRef<'_>) -> usize {
    let a = alloc(r, A, 3 * PAGE);
    let _b = alloc(r, A, PAGE);
    let c = alloc(r, A, 2 * PAGE);
    let _d = alloc(r, A, PAGE);
    assert_eq!(c, a + 4 * PAGE, "placed one after another");
    free(r, A, c, 2 * PAGE);
    assert_eq!(r.trim().unwrap(), 2 * PAGE);
    free(r, a_on, a, 3 * PAGE);
    let s = r.stats();
    assert_eq!((s.mapped, s.free_mapped), (5 * PAGE, 3 * PAGE), "{s:?}");
    r.check_invariants().unwrap();
    a
}

/// The best fit (the 4 MiB hole) would map two pages by moving two free chunks; the larger
/// hole on mapped pages costs no driver call at all.
#[test]
fn a_block_goes_to_mapped_free_pages_before_the_best_fit() {
    let r = expandable(None);
    let a = two_holes(&r, A);
    let before = r.backing().counters();
    let x = alloc(&r, A, 2 * PAGE);
    assert_eq!(x, a, "placed on the mapped pages");
    let s = r.stats();
    assert_eq!((s.chunks_created, s.chunks_moved), (7, 0), "{s:?}");
    assert_eq!(r.backing().counters(), before, "no driver call");
    r.check_invariants().unwrap();
}

/// The mapped hole was freed on another stream: the synchronisation a move would need comes
/// first, opens that hole to the stream, and then nothing moves.
#[test]
fn a_due_synchronisation_opens_other_streams_mapped_holes() {
    let order = Arc::new(RecordingOrder::new());
    let r = expandable(Some(order.clone()));
    let a = two_holes(&r, B);
    let seen = order.events().len();
    let x = alloc(&r, A, 2 * PAGE);
    assert_eq!(x, a);
    assert_eq!(
        order.events()[seen..],
        [OrderEvent::SyncAll],
        "one synchronisation"
    );
    let s = r.stats();
    assert_eq!((s.chunks_created, s.chunks_moved), (7, 0), "{s:?}");
    r.check_invariants().unwrap();
    // The tail of the hole (page 2) stays free to any stream and mapped.
    let y = alloc(&r, B, PAGE);
    assert_eq!(y, a + 2 * PAGE);
    assert_eq!(r.stats().chunks_moved, 0);
    r.check_invariants().unwrap();
}

/// One free block over pages 0-3, with 0-1 unmapped and 2-3 mapped: a 4 MiB block goes to its
/// end, not its start, and the start stays free.
#[test]
fn a_block_lands_inside_a_free_block_where_its_pages_are_mapped() {
    let r = expandable(None);
    let a = alloc(&r, A, 2 * PAGE);
    let b = alloc(&r, A, 2 * PAGE);
    let _guard = alloc(&r, A, PAGE);
    free(&r, A, a, 2 * PAGE);
    r.trim().unwrap();
    free(&r, A, b, 2 * PAGE);
    assert_eq!(
        r.stats().largest_free_block,
        64 * MIB - 5 * PAGE,
        "the tail"
    );
    let x = alloc(&r, A, 2 * PAGE);
    assert_eq!(x, b, "the mapped end of the hole");
    let s = r.stats();
    assert_eq!((s.chunks_created, s.chunks_moved), (5, 0), "{s:?}");
    r.check_invariants().unwrap();
    // The unmapped start is still a free block: a block there maps its pages again.
    let y = alloc(&r, A, 2 * PAGE);
    assert_eq!(y, a);
    assert_eq!(r.stats().chunks_created, 7);
    r.check_invariants().unwrap();
}

/// When no mapped spot can hold a block, free chunks still move to the best fit: a large
/// request never fails for want of a hole while free memory exists.
#[test]
fn without_a_mapped_spot_chunks_still_move() {
    let backing = Arc::new(SimulatedBacking::new(8 * PAGE, PAGE).unwrap());
    let r = VirtualMemoryResource::new(backing, VirtualOptions::expandable().maximum(8 * PAGE))
        .unwrap();
    let blocks: Vec<usize> = (0..8).map(|_| alloc(&r, A, PAGE)).collect();
    for &p in blocks.iter().step_by(2) {
        free(&r, A, p, PAGE);
    }
    let big = alloc(&r, A, 4 * PAGE);
    assert!(big >= blocks[7] + PAGE);
    let s = r.stats();
    assert_eq!(
        (s.chunks_created, s.chunks_moved, s.mapped),
        (8, 4, 8 * PAGE)
    );
    // One synchronisation (of stream A, the only one to have freed blocks), four unmaps and
    // maps, one access grant for the run of four pages.
    assert_eq!((s.synchronizations, s.stream_synchronizations), (0, 1));
    assert_eq!((s.unmaps, s.maps), (4, 12));
    assert_eq!(s.access_grants, r.backing().counters().access_grants);
    r.check_invariants().unwrap();
}
