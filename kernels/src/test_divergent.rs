//! A test kernel whose lanes call the device heap each with its own heap and argument
//! (`kernels/carve_heap.h` allows any): null heaps, heaps of another kind, two heaps in one
//! warp, interior, misaligned and foreign pointers, double frees (`tests/divergent_warps_gpu.rs`).

use crate::heap_entry::{
    carve_bump_alloc, carve_free, carve_malloc, carve_slab_alloc, carve_slab_free,
};
use crate::heap_layout::{GeneralHeader, HeapHandle};
use crate::nvptx;

/// `op` of [`carve_test_heap_per_lane`]: `carve_slab_alloc(heap)`.
pub const OP_SLAB_ALLOC: u32 = 0;
/// `carve_slab_free(heap, arg)`.
pub const OP_SLAB_FREE: u32 = 1;
/// `carve_bump_alloc(heap, arg, 16)`.
pub const OP_BUMP_ALLOC: u32 = 2;
/// `carve_malloc(heap, arg)`.
pub const OP_MALLOC: u32 = 3;
/// `carve_free(heap, arg)`.
pub const OP_FREE: u32 = 4;

/// Thread `i < n` makes call `op` with heap `heaps[i]` and argument `args[i]` (a size or a
/// pointer); an allocation's result goes to `out[i]`, and its first 8 bytes get `i`. Threads
/// past `n` do nothing; the others of a warp call together.
///
/// # Safety
/// `heaps`, `args` and `out` hold `n` `u64`s; each heap is 0 or a live heap region; `out` is
/// writable.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_test_heap_per_lane(
    op: u32,
    heaps: *const u64,
    args: *const u64,
    out: *mut u64,
    n: u64,
) {
    let i = nvptx::global_thread_index();
    if i >= n {
        return;
    }
    let i = i as usize;
    // SAFETY: i < n, and the caller's contract.
    let (heap, arg) = unsafe { (heaps.add(i).read(), args.add(i).read()) };
    // SAFETY: the caller's contract: 0 or a live heap of any kind (a wrong kind is refused).
    let p = unsafe {
        match op {
            OP_SLAB_ALLOC => carve_slab_alloc(heap as *const HeapHandle),
            OP_SLAB_FREE => {
                carve_slab_free(heap as *const HeapHandle, arg as *mut u8);
                core::ptr::null_mut()
            }
            OP_BUMP_ALLOC => carve_bump_alloc(heap as *const HeapHandle, arg, 16),
            OP_MALLOC => carve_malloc(heap as *const GeneralHeader, arg),
            OP_FREE => {
                carve_free(heap as *const GeneralHeader, arg as *mut u8);
                core::ptr::null_mut()
            }
            _ => core::ptr::null_mut(),
        }
    };
    if !p.is_null() {
        // SAFETY: a block of at least 16 bytes, this thread's.
        unsafe { (p as *mut u64).write_volatile(i as u64) };
    }
    // SAFETY: i < n.
    unsafe { out.add(i).write(p as u64) };
}
