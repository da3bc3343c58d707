//! Kernel entry points (`extern "ptx-kernel"`), thin wrappers over the portable algorithms.

use crate::nvptx;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo<'_>) -> ! {
    nvptx::trap()
}

/// Smoke test: thread `i < n` writes [`crate::smoke::pattern`]`(i)` to `out[i]`.
///
/// # Safety
/// `out` must point to `n` writable `u32`s in device-accessible memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_smoke_fill(out: *mut u32, n: u32) {
    let i = nvptx::global_thread_index();
    if i < n as u64 {
        // SAFETY: i < n, and the caller gave n elements.
        unsafe { out.add(i as usize).write(crate::smoke::pattern(i as u32)) };
    }
}

/// Fills block `b = blockIdx.x < n` (at `ptrs[b]`, `words[b]` `u32`s) with
/// [`crate::blocks::word`]`(b, i)`.
///
/// # Safety
/// `ptrs` and `words` hold `n` entries; each block is writable device memory of its length.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_fill_blocks(ptrs: *const u64, words: *const u32, n: u32) {
    let (b, t, dim) = nvptx::block_thread_dim();
    if b >= n {
        return;
    }
    // SAFETY: b < n entries; the caller vouches for each block's memory.
    unsafe {
        let p = *ptrs.add(b as usize) as *mut u32;
        let len = *words.add(b as usize);
        let mut i = t;
        while i < len {
            p.add(i as usize).write_volatile(crate::blocks::word(b, i));
            i += dim;
        }
    }
}

/// Counts into `bad[0]` the words of each block that differ from [`carve_fill_blocks`]'s.
///
/// # Safety
/// As [`carve_fill_blocks`]; `bad` points to one `u32`.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_check_blocks(
    ptrs: *const u64,
    words: *const u32,
    n: u32,
    bad: *mut u32,
) {
    let (b, t, dim) = nvptx::block_thread_dim();
    if b >= n {
        return;
    }
    let mut wrong = 0u32;
    // SAFETY: as in `carve_fill_blocks`; reads only.
    unsafe {
        let p = *ptrs.add(b as usize) as *const u32;
        let len = *words.add(b as usize);
        let mut i = t;
        while i < len {
            if p.add(i as usize).read_volatile() != crate::blocks::word(b, i) {
                wrong += 1;
            }
            i += dim;
        }
    }
    if wrong > 0 {
        // SAFETY: `bad` is a valid, aligned u32 that only atomics touch during the launch.
        let counter = unsafe { crate::sync::atomic::AtomicU32::from_ptr(bad) };
        counter.fetch_add(wrong, crate::sync::atomic::Ordering::Relaxed);
    }
}
/// Smoke test that reads and writes: thread `i < n` adds `delta` to `data[i]` (wrapping).
///
/// # Safety
/// `data` must point to `n` readable and writable `u32`s in device-accessible memory.
#[no_mangle]
pub unsafe extern "ptx-kernel" fn carve_smoke_add(data: *mut u32, n: u32, delta: u32) {
    let i = nvptx::global_thread_index();
    if i < n as u64 {
        // SAFETY: i < n, and the caller gave n elements.
        unsafe {
            let p = data.add(i as usize);
            p.write(p.read().wrapping_add(delta));
        }
    }
}
