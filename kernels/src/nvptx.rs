//! nvptx intrinsics and inline asm for threads, warps and blocks, and the general heap's header
//! loads: with [`global_mem`](crate::global_mem), the only `unsafe` device-specific code in the
//! crate.

use core::arch::nvptx;

use crate::general::GeneralFront;
use crate::global_mem::global_address;
use crate::heap_layout::{GeneralHeader, GENERAL_CLASS_SLOTS};
use crate::sync::atomic::AtomicU64;
use crate::warp::Warp;

/// Global index of the calling thread in a 1-D launch.
#[cfg(feature = "test-kernels")]
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

// Device code cannot unwind or print; a panic ends the kernel and the host sees a launch failure.
#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    trap()
}

/// (block index, thread index in the block, block size) in a 1-D launch.
#[cfg(feature = "test-kernels")]
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
    const TRACKS_ACTIVE: bool = true;
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
            if mask == u32::MAX {
                core::arch::asm!(
                    "{{ .reg .pred p; match.all.sync.b64 {r}|p, {v}, -1; selp.u32 {r}, 1, 0, p; }}",
                    r = out(reg32) r, v = in(reg64) v,
                )
            } else {
                core::arch::asm!(
                    "{{ .reg .pred p; match.all.sync.b64 {r}|p, {v}, {mask}; selp.u32 {r}, 1, 0, p; }}",
                    r = out(reg32) r, v = in(reg64) v, mask = in(reg32) mask,
                )
            }
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
        // SAFETY: `a` is a live, aligned atomic in global memory (every heap array is: the region
        // comes from a device allocation); the asm is an atomic RMW on it and nothing else. The
        // global state space spares ptxas's test for a shared-memory address before each atom.
        unsafe {
            core::arch::asm!(
                "{{ .reg .b64 g; cvta.to.global.u64 g, {a}; atom.acquire.gpu.global.or.b64 {old}, [g], {v}; }}",
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
                "{{ .reg .b64 g; cvta.to.global.u64 g, {a}; atom.release.gpu.global.and.b64 {old}, [g], {v}; }}",
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

/// The collectives that neither the mask's constness nor the atomics' ordering changes: the
/// variants below take them from [`NvptxWarp`].
macro_rules! delegate_collectives {
    () => {
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
    };
}

/// [`NvptxWarp`] (or, with `FULL`, [`FullWarp`]) with relaxed bitmap atomics (`core`'s, which
/// drop the ordering on nvptx): only for the benchmark that measures what the Acquire/Release
/// orderings cost. Not a correct heap for blocks reused within one launch.
#[cfg(feature = "test-kernels")]
#[derive(Clone, Copy, Debug)]
pub struct RelaxedWarp<const FULL: bool>;

#[cfg(feature = "test-kernels")]
impl<const FULL: bool> Warp for RelaxedWarp<FULL> {
    const TRACKS_ACTIVE: bool = !FULL;
    #[inline(always)]
    fn active(&self) -> u32 {
        if FULL {
            u32::MAX
        } else {
            NvptxWarp.active()
        }
    }
    delegate_collectives!();
}

/// [`NvptxWarp`] for a call that all 32 lanes make together (`activemask` read all ones): the
/// mask is a constant, so every collective gets a literal full mask and every "which lanes"
/// computation folds away.
#[derive(Clone, Copy, Debug)]
pub struct FullWarp;

impl Warp for FullWarp {
    #[inline(always)]
    fn active(&self) -> u32 {
        u32::MAX
    }
    delegate_collectives!();
    #[inline(always)]
    fn fetch_or_acquire(&self, a: &AtomicU64, v: u64) -> u64 {
        NvptxWarp.fetch_or_acquire(a, v)
    }
    #[inline(always)]
    fn fetch_and_release(&self, a: &AtomicU64, v: u64) -> u64 {
        NvptxWarp.fetch_and_release(a, v)
    }
}

/// The hardware warp slot the calling warp runs in: `%smid << 6 | %warpid`. A resident warp
/// owns its slot, but `%warpid` may change after a preemption, so the slot names a place to
/// look first, not a lock.
#[inline(always)]
pub fn hw_warp_slot() -> u32 {
    let (sm, w): (u32, u32);
    // SAFETY: reads special registers.
    unsafe {
        core::arch::asm!(
            "mov.u32 {s}, %smid; mov.u32 {w}, %warpid;",
            s = out(reg32) sm, w = out(reg32) w,
        )
    };
    sm << 6 | (w & 63)
}

/// The calling warp's index in the grid, wrapping at 2^32 (it only seeds a hint), the same for
/// every lane whatever the block's shape (a warp never spans two blocks).
#[inline(always)]
pub fn warp_index() -> u32 {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        let (bx, by) = (nvptx::_block_dim_x() as u32, nvptx::_block_dim_y() as u32);
        let threads = bx
            .wrapping_mul(by)
            .wrapping_mul(nvptx::_block_dim_z() as u32);
        let t = (nvptx::_thread_idx_x() as u32).wrapping_add(
            bx.wrapping_mul(
                (nvptx::_thread_idx_y() as u32)
                    .wrapping_add(by.wrapping_mul(nvptx::_thread_idx_z() as u32)),
            ),
        );
        let gx = nvptx::_grid_dim_x() as u32;
        let b = (nvptx::_block_idx_x() as u32).wrapping_add(gx.wrapping_mul(
            (nvptx::_block_idx_y() as u32).wrapping_add(
                (nvptx::_grid_dim_y() as u32).wrapping_mul(nvptx::_block_idx_z() as u32),
            ),
        ));
        b.wrapping_mul(threads.div_ceil(32)).wrapping_add(t / 32)
    }
}

/// The front of the general header at `heap`, if it is one, and its class pointer `slot`
/// (`< GENERAL_CLASS_SLOTS`): three read-only loads in flight together, where reading the tag
/// first and the fields after its test took two or three round trips.
///
/// The slot is read before the tag is known. That stays inside the region whatever kind it
/// is: every heap region carve formats is longer than a general header (a slab or bump
/// handle and its counters alone take 896 bytes).
///
/// # Safety
/// `heap` is null or the device address of a heap region (global memory, 128-byte aligned)
/// whose first [`GENERAL_HEADER_BYTES`](crate::heap_layout::GENERAL_HEADER_BYTES) the host writes only between launches.
#[inline(always)]
pub unsafe fn load_general(heap: *const GeneralHeader, slot: u32) -> Option<(GeneralFront, u64)> {
    if heap.is_null() {
        return None;
    }
    debug_assert!((slot as usize) < GENERAL_CLASS_SLOTS);
    let g = global_address(heap as u64);
    let at = g + (core::mem::offset_of!(GeneralHeader, classes) as u64) + 8 * slot as u64;
    let (tag, w8, base, _counters, head): (u64, u64, u64, u64, u64);
    // SAFETY: the caller's contract and the lengths above: all three loads fall inside the
    // region's first GENERAL_HEADER_BYTES. Not `pure`, as in
    // `global_mem::ld_nc_handle`.
    unsafe {
        core::arch::asm!(
            "ld.global.nc.v2.u64 {{{t}, {w}}}, [{g}];",
            "ld.global.nc.v2.u64 {{{b}, {c}}}, [{g}+16];",
            "ld.global.nc.u64 {h}, [{at}];",
            t = out(reg64) tag, w = out(reg64) w8,
            b = out(reg64) base, c = out(reg64) _counters,
            h = out(reg64) head,
            g = in(reg64) g, at = in(reg64) at,
            options(readonly, nostack),
        )
    };
    if tag != crate::general::GENERAL_TAG {
        return None;
    }
    let front = GeneralFront {
        nclasses: w8 as u32,
        stride_log2: (w8 >> 32) as u32,
        base,
    };
    Some((front, head))
}

/// The calling thread's index in its block and the block's thread count, whatever its shape.
#[inline(always)]
fn thread_in_block() -> (u32, u32) {
    // SAFETY: reading special registers has no preconditions inside a kernel.
    unsafe {
        let (bx, by) = (nvptx::_block_dim_x() as u32, nvptx::_block_dim_y() as u32);
        let threads = bx * by * nvptx::_block_dim_z() as u32;
        let t = nvptx::_thread_idx_x() as u32
            + bx * (nvptx::_thread_idx_y() as u32 + by * nvptx::_thread_idx_z() as u32);
        (t, threads)
    }
}

/// The calling thread block: the GPU implementation of [`crate::bump_block::Block`], over
/// `bar.sync` and a scratch array in shared memory.
#[derive(Clone, Copy, Debug)]
pub struct NvptxBlock {
    scratch: *const AtomicU64,
    warp: u32,
    warps: u32,
}

impl NvptxBlock {
    /// The calling block, with this function's own scratch in shared memory: one array per
    /// inlined copy (the declaration sits in a scope of its own), so two call sites never share
    /// words, and calls from one site are kept apart by the protocol's barriers.
    #[inline(always)]
    pub fn here() -> Self {
        let p: u64;
        // SAFETY: declares a block-shared array (a static of this scope, as PTX allows) and
        // converts its address to a generic one; no other memory is touched.
        unsafe {
            core::arch::asm!(
                "{{",
                ".shared .align 8 .b64 carve_block_scratch[33];",
                "cvta.shared.u64 {p}, carve_block_scratch;",
                "}}",
                p = out(reg64) p,
            )
        };
        let (t, threads) = thread_in_block();
        NvptxBlock {
            scratch: p as *const AtomicU64,
            warp: t / 32,
            warps: threads.div_ceil(32),
        }
    }
}

const _: () = assert!(crate::bump_block::BLOCK_SCRATCH_WORDS == 33);

impl crate::bump_block::Block for NvptxBlock {
    type W = NvptxWarp;
    #[inline(always)]
    fn warp(&self) -> &NvptxWarp {
        &NvptxWarp
    }
    #[inline(always)]
    fn warp_index(&self) -> u32 {
        self.warp
    }
    #[inline(always)]
    fn warps(&self) -> u32 {
        self.warps
    }
    #[inline(always)]
    fn scratch(&self, i: u32) -> &AtomicU64 {
        debug_assert!((i as usize) < crate::bump_block::BLOCK_SCRATCH_WORDS);
        // SAFETY: `here` gave 33 shared words, alive for the whole launch, touched only
        // atomically.
        unsafe { &*self.scratch.add(i as usize) }
    }
    #[inline(always)]
    fn sync(&self) {
        // SAFETY: the caller of the block protocol guarantees every thread of the block
        // reaches each barrier.
        unsafe { nvptx::_syncthreads() }
    }
}
