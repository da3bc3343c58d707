//! The device heap under Numba's calling convention, for `cuda.declare_device` (which can only
//! call foreign functions that take a pointer to their result first and return a status `int`).
//! Each is a thin wrapper over its C-ABI twin in [`crate::heap_entry`]; see
//! `examples/numba_heap.py` for the declarations.

use crate::heap_entry::{
    carve_bump_alloc, carve_bump_alloc_block, carve_free, carve_malloc, carve_slab_alloc,
    carve_slab_free,
};
use crate::heap_layout::{GeneralHeader, HeapHandle};

/// Numba's "no exception" status.
const OK: i32 = 0;

/// `uint64(uint64)`: [`carve_slab_alloc`], the block's address (0 when exhausted) into `*ret`.
///
/// # Safety
/// `ret` is Numba's result slot; `heap` as for [`carve_slab_alloc`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_slab_alloc(ret: *mut u64, heap: *const HeapHandle) -> i32 {
    // SAFETY: forwarded contract; Numba passes a writable slot for the result.
    unsafe { ret.write(carve_slab_alloc(heap) as u64) };
    OK
}

/// `void(uint64, uint64)`: [`carve_slab_free`]. Numba passes a result slot even for `void`;
/// it is left untouched.
///
/// # Safety
/// As for [`carve_slab_free`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_slab_free(
    _ret: *mut u64,
    heap: *const HeapHandle,
    ptr: *mut u8,
) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { carve_slab_free(heap, ptr) };
    OK
}

/// `uint64(uint64, uint64, uint64)`: [`carve_bump_alloc`], the address (0 on failure) into
/// `*ret`.
///
/// # Safety
/// `ret` is Numba's result slot; `heap` as for [`carve_bump_alloc`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_bump_alloc(
    ret: *mut u64,
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
) -> i32 {
    // SAFETY: forwarded contract; Numba passes a writable slot for the result.
    unsafe { ret.write(carve_bump_alloc(heap, bytes, align) as u64) };
    OK
}

/// `uint64(uint64, uint64, uint64)`: [`carve_bump_alloc_block`], the address (0 on failure)
/// into `*ret`; every thread of the block calls.
///
/// # Safety
/// `ret` is Numba's result slot; `heap` as for [`carve_bump_alloc_block`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_bump_alloc_block(
    ret: *mut u64,
    heap: *const HeapHandle,
    bytes: u64,
    align: u64,
) -> i32 {
    // SAFETY: forwarded contract; Numba passes a writable slot for the result.
    unsafe { ret.write(carve_bump_alloc_block(heap, bytes, align) as u64) };
    OK
}

/// `uint64(uint64, uint64)`: [`carve_malloc`], the block's address (0 on failure) into `*ret`.
///
/// # Safety
/// `ret` is Numba's result slot; `heap` as for [`carve_malloc`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_malloc(
    ret: *mut u64,
    heap: *const GeneralHeader,
    bytes: u64,
) -> i32 {
    // SAFETY: forwarded contract; Numba passes a writable slot for the result.
    unsafe { ret.write(carve_malloc(heap, bytes) as u64) };
    OK
}

/// `void(uint64, uint64)`: [`carve_free`]; the result slot is left untouched.
///
/// # Safety
/// As for [`carve_free`].
#[no_mangle]
pub unsafe extern "C" fn carve_numba_free(
    _ret: *mut u64,
    heap: *const GeneralHeader,
    ptr: *mut u8,
) -> i32 {
    // SAFETY: forwarded contract.
    unsafe { carve_free(heap, ptr) };
    OK
}
