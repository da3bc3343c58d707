//! [`CarveAlloc`]: a [`GlobalAlloc`] over carve's device heap, so that Rust kernels can use the
//! `alloc` crate (`Box`, `Vec`, `String`, ...).
//!
//! # Opting in
//!
//! carve-kernels declares no global allocator: a program has at most one, and carve's shipped
//! PTX module uses no `alloc`. The kernel crate (the one built into the PTX module) declares it,
//! and builds with `-Zbuild-std=core,alloc`:
//!
//! ```ignore
//! extern crate alloc;
//! use carve_kernels::global_alloc::CarveAlloc;
//! use carve_kernels::heap_layout::HeapHandle;
//!
//! #[global_allocator]
//! static ALLOC: CarveAlloc = CarveAlloc::new();
//!
//! #[no_mangle]
//! pub unsafe extern "ptx-kernel" fn my_kernel(heap: *const HeapHandle, n: usize) {
//!     // SAFETY: `heap` is a formatted heap that outlives the launch, the same for every thread.
//!     unsafe { ALLOC.set_heap(heap) };
//!     let mut v = alloc::vec::Vec::<u32>::new();
//!     if v.try_reserve(n).is_err() {
//!         return; // the heap is exhausted, or `n` does not fit a slab block
//!     }
//!     // ...
//! }
//! ```
//!
//! # The heap, per launch
//!
//! `GlobalAlloc` gets no argument to say which heap, so the allocator keeps the heap's address
//! in the `static` itself, a device global of the PTX module: every kernel that allocates calls
//! [`CarveAlloc::set_heap`] at its entry, in every thread, with the heap it was passed. The
//! stores are atomic and store one value, so the threads of a launch never race. The rule that
//! follows:
//! - **all threads of one launch use the same heap**;
//! - **launches of one loaded module that may run at the same time use the same heap.** Launches
//!   with different heaps must be ordered (one stream, or events), or use modules loaded
//!   separately (each has its own global, per context).
//!
//! Memory outlives the launch until it is freed: a slab block can be freed by a later launch
//! that set the same heap (a `Box` passed by pointer), a bump range lives until the host resets
//! the arena. Dealloc must run with the heap the memory came from.
//!
//! # What each heap serves
//!
//! - **Slab**: requests of at most the block size, aligned to at most the blocks' alignment
//!   ([`slab_block_align`]); anything larger is refused (null) without touching the heap, so it
//!   is not counted in the heap's failed allocations. `dealloc` frees the block; `realloc`
//!   within the block size keeps the block.
//! - **Bump**: any size, aligned up to 4096; `dealloc` does nothing (the host resets the arena);
//!   `realloc` shrinks in place and grows by copying.
//!
//! Failure is a null pointer, never a panic: fallible APIs (`Vec::try_reserve`,
//! `Vec::try_with_capacity`) return an error, while infallible ones (`Box::new`, `Vec::push`
//! past capacity) call `handle_alloc_error`, which panics, which traps: the launch fails.
//!
//! Any set of lanes may call: lanes that allocate together share the heap's atomics (the device
//! entry points' warp-wide paths), and any subset of a warp takes their generic paths.

use core::alloc::{GlobalAlloc, Layout};
// core's atomic, not the `sync` shim: the slot holds no allocator state for loom to check, and
// `CarveAlloc::new` must be `const` for a `static`.
use core::sync::atomic::{AtomicU64, Ordering};

use crate::heap_layout::{slab_block_align, HeapHandle, HEAP_MAGIC, KIND_BUMP, KIND_SLAB};

#[cfg(target_arch = "nvptx64")]
use crate::heap_entry::{carve_bump_alloc, carve_slab_alloc, carve_slab_free};
#[cfg(not(target_arch = "nvptx64"))]
use host::{carve_bump_alloc, carve_slab_alloc, carve_slab_free};

/// The largest alignment a bump arena serves (`crate::bump`'s limit).
pub const MAX_BUMP_ALIGN: usize = 4096;

/// Where [`CarveAlloc`] sends one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// One block of the slab.
    Slab,
    /// A range of the bump arena.
    Bump,
    /// Null: no heap, an unformatted one, or a request the slab's blocks cannot hold.
    Refuse,
}

/// The route of a request of `size` bytes aligned to `align` on the heap whose handle is `h`.
pub fn route(h: &HeapHandle, size: usize, align: usize) -> Route {
    if h.magic != HEAP_MAGIC {
        return Route::Refuse;
    }
    match h.kind {
        KIND_SLAB
            if size as u64 <= h.block_size && align as u64 <= slab_block_align(h.block_size) =>
        {
            Route::Slab
        }
        KIND_BUMP if align <= MAX_BUMP_ALIGN => Route::Bump,
        _ => Route::Refuse,
    }
}

/// True when a block or range of `layout` on the heap at `h` can serve `new_size` bytes as it
/// is: a slab block that still holds them, or a bump range that shrinks.
pub fn resizes_in_place(h: &HeapHandle, layout: Layout, new_size: usize) -> bool {
    match route(h, layout.size(), layout.align()) {
        Route::Slab => route(h, new_size, layout.align()) == Route::Slab,
        Route::Bump => new_size <= layout.size(),
        Route::Refuse => false,
    }
}

/// A [`GlobalAlloc`] over the device heap whose address the running kernel set: see the
/// [module documentation](self) for the per-launch model.
#[derive(Debug)]
pub struct CarveAlloc {
    /// The heap's address (its handle's), or 0 before any kernel set one.
    heap: AtomicU64,
}

impl Default for CarveAlloc {
    fn default() -> Self {
        Self::new()
    }
}

impl CarveAlloc {
    /// An allocator with no heap yet: it returns null until [`set_heap`](Self::set_heap).
    pub const fn new() -> Self {
        CarveAlloc {
            heap: AtomicU64::new(0),
        }
    }

    /// Makes `heap` the heap that allocations from now on use. Call it at the entry of every
    /// kernel that allocates, in every thread, with the launch's heap.
    ///
    /// # Safety
    /// `heap` is null or the address of a heap region that carve formatted and keeps alive while
    /// any allocation or free through this allocator may use it; every thread that may allocate
    /// or free through it concurrently sets the same value (see the module documentation).
    #[inline(always)]
    pub unsafe fn set_heap(&self, heap: *const HeapHandle) {
        // Relaxed: every thread stores the same address, and reads only its own store or one of
        // the same value (per-location coherence); the heap's memory is the host's, written
        // before the launch.
        self.heap.store(heap as u64, Ordering::Relaxed);
    }

    /// The heap set last (null if none).
    #[inline(always)]
    pub fn heap(&self) -> *const HeapHandle {
        self.heap.load(Ordering::Relaxed) as *const HeapHandle
    }

    /// The heap and the route of a request, `Refuse` without a heap.
    #[inline(always)]
    fn route(&self, size: usize, align: usize) -> (*const HeapHandle, Route) {
        let heap = self.heap();
        if heap.is_null() {
            return (heap, Route::Refuse);
        }
        // SAFETY: `set_heap`'s contract: a live heap region, whose handle the host writes only
        // between launches.
        (heap, route(unsafe { &*heap }, size, align))
    }
}

// SAFETY: `alloc` returns null or memory that nothing else holds until it is freed, of at least
// `layout.size()` bytes aligned to `layout.align()`: a slab block only when `route` found the
// request within the block size and the blocks' alignment, a bump range of at least the request
// at its alignment (the arena's contract). The heap's own atomics make calls from any threads at once safe, and
// no path panics (failure is null).
unsafe impl GlobalAlloc for CarveAlloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        match self.route(layout.size(), layout.align()) {
            // SAFETY: `set_heap`'s contract; `route` read a formatted slab handle.
            (heap, Route::Slab) => unsafe { carve_slab_alloc(heap) },
            // SAFETY: as above, a bump handle.
            (heap, Route::Bump) => unsafe {
                carve_bump_alloc(heap, layout.size() as u64, layout.align() as u64)
            },
            (_, Route::Refuse) => core::ptr::null_mut(),
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if let (heap, Route::Slab) = self.route(layout.size(), layout.align()) {
            // SAFETY: `GlobalAlloc`'s contract: `ptr` is a live block this allocator gave for
            // `layout`, so of this slab (`set_heap`'s contract), and is not used after this.
            unsafe { carve_slab_free(heap, ptr) }
        }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let heap = self.heap();
        // SAFETY: `set_heap`'s contract, as in `route`.
        if !heap.is_null() && resizes_in_place(unsafe { &*heap }, layout, new_size) {
            return ptr;
        }
        let Ok(new_layout) = Layout::from_size_align(new_size, layout.align()) else {
            return core::ptr::null_mut();
        };
        // SAFETY: `GlobalAlloc`'s contract: `new_size` is not zero.
        let new = unsafe { self.alloc(new_layout) };
        if !new.is_null() {
            // SAFETY: `ptr` holds `layout.size()` bytes and `new` `new_size`; they are distinct
            // live allocations. The old one is freed once copied, as `realloc` promises.
            unsafe {
                core::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
        }
        new
    }
}

/// The host build's stand-ins for the device entry points: the same chain functions over a warp
/// of one lane, so that CPU tests run [`CarveAlloc`] against heaps in host memory.
#[cfg(not(target_arch = "nvptx64"))]
mod host {
    use crate::heap_layout::HeapHandle;
    use crate::warp::SoloLane;
    use crate::{bump, slab};

    /// # Safety
    /// `heap` is a formatted slab chain, live for the call.
    pub unsafe fn carve_slab_alloc(heap: *const HeapHandle) -> *mut u8 {
        // SAFETY: the caller's contract.
        unsafe { slab::chain_alloc(&*heap, &SoloLane::default(), 0) }
    }

    /// # Safety
    /// As for [`carve_slab_alloc`]; `ptr` is not used after this call.
    pub unsafe fn carve_slab_free(heap: *const HeapHandle, ptr: *mut u8) {
        // SAFETY: the caller's contract.
        unsafe { slab::chain_free(&*heap, &SoloLane::default(), ptr) }
    }

    /// # Safety
    /// `heap` is a formatted bump chain, live for the call.
    pub unsafe fn carve_bump_alloc(heap: *const HeapHandle, bytes: u64, align: u64) -> *mut u8 {
        // SAFETY: the caller's contract.
        unsafe { bump::chain_alloc(&*heap, &SoloLane::default(), bytes, align) }
    }
}

#[cfg(all(test, not(carve_loom)))]
mod tests {
    use super::*;
    use crate::heap_layout::{slab_geometry, MAX_BLOCK_ALIGN};

    fn slab(block_size: u64) -> HeapHandle {
        HeapHandle::slab(slab_geometry(64).unwrap(), 64, block_size, 0)
    }

    fn bump() -> HeapHandle {
        HeapHandle {
            magic: HEAP_MAGIC,
            kind: KIND_BUMP,
            capacity: 1 << 20,
            ..bytemuck::Zeroable::zeroed()
        }
    }

    #[test]
    fn slab_serves_what_a_block_holds() {
        let h = slab(256);
        assert_eq!(route(&h, 1, 1), Route::Slab);
        assert_eq!(route(&h, 256, 256), Route::Slab);
        assert_eq!(route(&h, 257, 4), Route::Refuse, "larger than a block");
        assert_eq!(
            route(&h, 16, 512),
            Route::Refuse,
            "more aligned than a block"
        );
        let h = slab(48);
        assert_eq!(route(&h, 48, 16), Route::Slab);
        assert_eq!(
            route(&h, 32, 32),
            Route::Refuse,
            "48-byte blocks are 16-aligned"
        );
        let h = slab(1 << 16);
        assert_eq!(route(&h, 1 << 16, MAX_BLOCK_ALIGN as usize), Route::Slab);
        assert_eq!(route(&h, 8, 2 * MAX_BLOCK_ALIGN as usize), Route::Refuse);
    }

    #[test]
    fn bump_serves_any_size_up_to_its_alignment() {
        let h = bump();
        assert_eq!(route(&h, 1 << 30, 8), Route::Bump);
        assert_eq!(route(&h, 8, MAX_BUMP_ALIGN), Route::Bump);
        assert_eq!(route(&h, 8, 2 * MAX_BUMP_ALIGN), Route::Refuse);
    }

    #[test]
    fn unformatted_handles_are_refused() {
        let zero: HeapHandle = bytemuck::Zeroable::zeroed();
        assert_eq!(route(&zero, 8, 8), Route::Refuse);
        let other_kind = HeapHandle { kind: 7, ..bump() };
        assert_eq!(route(&other_kind, 8, 8), Route::Refuse);
    }

    #[test]
    fn in_place_within_a_block_or_when_shrinking() {
        let l = |size| Layout::from_size_align(size, 4).unwrap();
        let h = slab(256);
        assert!(resizes_in_place(&h, l(128), 256));
        assert!(resizes_in_place(&h, l(128), 16));
        assert!(!resizes_in_place(&h, l(128), 257));
        let h = bump();
        assert!(resizes_in_place(&h, l(128), 64));
        assert!(!resizes_in_place(&h, l(128), 129));
    }

    #[test]
    fn no_heap_is_null() {
        let a = CarveAlloc::new();
        let layout = Layout::from_size_align(64, 8).unwrap();
        // SAFETY: a non-zero size; no heap is set, so nothing is allocated.
        assert!(unsafe { a.alloc(layout) }.is_null());
    }
}
