//! nvptx intrinsics and inline asm: the only `unsafe` device-specific code in the crate.

use core::arch::nvptx;

/// Global index of the calling thread in a 1-D launch.
#[inline(always)]
pub fn global_thread_index() -> u64 {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        nvptx::_block_idx_x() as u64 * nvptx::_block_dim_x() as u64 + nvptx::_thread_idx_x() as u64
    }
}

/// Aborts the kernel (`trap`); the host sees a launch failure.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` ends the thread; it has no other effect on memory.
    unsafe { nvptx::trap() }
}

/// (block index, thread index in the block, block size) in a 1-D launch.
#[inline(always)]
pub fn block_thread_dim() -> (u32, u32, u32) {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        (
            nvptx::_block_idx_x() as u32,
            nvptx::_thread_idx_x() as u32,
            nvptx::_block_dim_x() as u32,
        )
    }
}
