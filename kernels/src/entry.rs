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
