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
/// The calling warp, through `activemask`, `shfl.sync`, `match.sync` and `vote.sync`: the GPU
/// implementation of [`crate::warp::Warp`].
#[derive(Clone, Copy, Debug)]
pub struct NvptxWarp;

impl crate::warp::Warp for NvptxWarp {
    #[inline(always)]
    fn active(&self) -> u32 {
        let m: u32;
        // SAFETY: reads which lanes execute this instruction; no memory effects.
        unsafe { core::arch::asm!("activemask.b32 {m};", m = out(reg32) m) };
        m
    }

    #[inline(always)]
    fn lane(&self) -> u32 {
        let l: u32;
        // SAFETY: reads a special register.
        unsafe { core::arch::asm!("mov.u32 {l}, %laneid;", l = out(reg32) l) };
        l
    }

    #[inline(always)]
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
        let r: u32;
        // SAFETY: every lane of `mask` executes this call (the trait's contract); 31 clamps the
        // source to the warp.
        unsafe {
            core::arch::asm!(
                "shfl.sync.idx.b32 {r}, {v}, {src}, 31, {mask};",
                r = out(reg32) r, v = in(reg32) v, src = in(reg32) src, mask = in(reg32) mask,
            )
        };
        r
    }

    #[inline(always)]
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        let r: u32;
        // SAFETY: as for `shfl` (sm_70+).
        unsafe {
            core::arch::asm!(
                "match.any.sync.b64 {r}, {v}, {mask};",
                r = out(reg32) r, v = in(reg64) v, mask = in(reg32) mask,
            )
        };
        r
    }

    #[inline(always)]
    fn match_all(&self, mask: u32, v: u64) -> bool {
        let r: u32;
        // SAFETY: as for `shfl` (sm_70+); the predicate stays inside the asm block.
        unsafe {
            core::arch::asm!(
                "{{ .reg .pred p; match.all.sync.b64 {r}|p, {v}, {mask}; selp.u32 {r}, 1, 0, p; }}",
                r = out(reg32) r, v = in(reg64) v, mask = in(reg32) mask,
            )
        };
        r != 0
    }

    #[inline(always)]
    fn ballot(&self, mask: u32, pred: bool) -> u32 {
        let r: u32;
        // SAFETY: as for `shfl`.
        unsafe {
            core::arch::asm!(
                "{{ .reg .pred p; setp.ne.u32 p, {x}, 0; vote.sync.ballot.b32 {r}, p, {mask}; }}",
                r = out(reg32) r, x = in(reg32) pred as u32, mask = in(reg32) mask,
            )
        };
        r
    }

    #[inline(always)]
    fn fence(&self) {
        // SAFETY: a memory fence at GPU scope; no operands.
        unsafe { core::arch::asm!("fence.acq_rel.gpu;") };
    }

    #[inline(always)]
    fn slot_hint(&self) -> u32 {
        let s: u32;
        // SAFETY: reads a special register.
        unsafe { core::arch::asm!("mov.u32 {s}, %smid;", s = out(reg32) s) };
        s
    }
}

/// Threads in the launch's grid (1-D).
#[inline(always)]
pub fn grid_threads() -> u64 {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe { nvptx::_grid_dim_x() as u64 * nvptx::_block_dim_x() as u64 }
}
