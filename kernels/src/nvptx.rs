//! nvptx intrinsics and inline asm: the only `unsafe` device-specific code in the crate.

use core::arch::nvptx;

use crate::sync::atomic::AtomicU64;
use crate::warp::Warp;

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

impl Warp for NvptxWarp {
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
        // source to the warp. A literal full mask spares ptxas's run-time convergence check
        // (match + redux + vote before every shuffle with a register mask).
        unsafe {
            if mask == u32::MAX {
                core::arch::asm!(
                    "shfl.sync.idx.b32 {r}, {v}, {src}, 31, -1;",
                    r = out(reg32) r, v = in(reg32) v, src = in(reg32) src,
                )
            } else {
                core::arch::asm!(
                    "shfl.sync.idx.b32 {r}, {v}, {src}, 31, {mask};",
                    r = out(reg32) r, v = in(reg32) v, src = in(reg32) src, mask = in(reg32) mask,
                )
            }
        };
        r
    }

    #[inline(always)]
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        let r: u32;
        // SAFETY: as for `shfl` (sm_70+).
        unsafe {
            if mask == u32::MAX {
                core::arch::asm!(
                    "match.any.sync.b64 {r}, {v}, -1;",
                    r = out(reg32) r, v = in(reg64) v,
                )
            } else {
                core::arch::asm!(
                    "match.any.sync.b64 {r}, {v}, {mask};",
                    r = out(reg32) r, v = in(reg64) v, mask = in(reg32) mask,
                )
            }
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
            if mask == u32::MAX {
                core::arch::asm!(
                    "{{ .reg .pred p; setp.ne.u32 p, {x}, 0; vote.sync.ballot.b32 {r}, p, -1; }}",
                    r = out(reg32) r, x = in(reg32) pred as u32,
                )
            } else {
                core::arch::asm!(
                    "{{ .reg .pred p; setp.ne.u32 p, {x}, 0; vote.sync.ballot.b32 {r}, p, {mask}; }}",
                    r = out(reg32) r, x = in(reg32) pred as u32, mask = in(reg32) mask,
                )
            }
        };
        r
    }

    #[inline(always)]
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        let old: u64;
        // SAFETY: `a` is a live, aligned atomic; the asm is an atomic RMW on it and nothing else.
        unsafe {
            core::arch::asm!(
                "atom.acquire.gpu.or.b64 {old}, [{a}], {v};",
                old = out(reg64) old, a = in(reg64) a.as_ptr(), v = in(reg64) v,
            )
        };
        old
    }

    #[inline(always)]
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        let old: u64;
        // SAFETY: as for `fetch_or_acquire`.
        unsafe {
            core::arch::asm!(
                "atom.release.gpu.and.b64 {old}, [{a}], {v};",
                old = out(reg64) old, a = in(reg64) a.as_ptr(), v = in(reg64) v,
            )
        };
        old
    }

    #[inline(always)]
    fn slot_hint(&self) -> u32 {
        let s: u32;
        // SAFETY: reads a special register.
        unsafe { core::arch::asm!("mov.u32 {s}, %smid;", s = out(reg32) s) };
        s
    }
}

/// [`NvptxWarp`] with relaxed bitmap atomics (`core`'s, which drop the ordering on nvptx): only
/// for the benchmark that measures what the Acquire/Release orderings cost. Not a correct heap
/// for blocks reused within one launch.
#[derive(Clone, Copy, Debug)]
pub struct RelaxedWarp;

impl Warp for RelaxedWarp {
    #[inline(always)]
    fn active(&self) -> u32 {
        NvptxWarp.active()
    }
    #[inline(always)]
    fn lane(&self) -> u32 {
        NvptxWarp.lane()
    }
    #[inline(always)]
    fn shfl(&self, mask: u32, v: u32, src: u32) -> u32 {
        NvptxWarp.shfl(mask, v, src)
    }
    #[inline(always)]
    fn match_any(&self, mask: u32, v: u64) -> u32 {
        NvptxWarp.match_any(mask, v)
    }
    #[inline(always)]
    fn match_all(&self, mask: u32, v: u64) -> bool {
        NvptxWarp.match_all(mask, v)
    }
    #[inline(always)]
    fn ballot(&self, mask: u32, pred: bool) -> u32 {
        NvptxWarp.ballot(mask, pred)
    }
    #[inline(always)]
    fn slot_hint(&self) -> u32 {
        NvptxWarp.slot_hint()
    }
}

/// (this warp's index in the grid, warps in the grid), the same for every lane of a warp
/// whatever the block's shape (a warp never spans two blocks).
#[inline(always)]
pub fn warp_in_grid() -> (u64, u64) {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        let (bx, by) = (nvptx::_block_dim_x() as u64, nvptx::_block_dim_y() as u64);
        let threads = bx * by * nvptx::_block_dim_z() as u64;
        let t = nvptx::_thread_idx_x() as u64
            + bx * (nvptx::_thread_idx_y() as u64 + by * nvptx::_thread_idx_z() as u64);
        let (gx, gy) = (nvptx::_grid_dim_x() as u64, nvptx::_grid_dim_y() as u64);
        let blocks = gx * gy * nvptx::_grid_dim_z() as u64;
        let b = nvptx::_block_idx_x() as u64
            + gx * (nvptx::_block_idx_y() as u64 + gy * nvptx::_block_idx_z() as u64);
        let per_block = threads.div_ceil(32);
        (b * per_block + t / 32, blocks * per_block)
    }
}
