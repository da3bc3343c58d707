//! The C ABI under hostile use: forged handles, destroy while blocks are out, double destroy,
//! null pointers, huge counts, and panics inside carve. Nothing may crash, abort or unwind into
//! the caller; every misuse is a typed error code. Over host memory (no GPU needed).
//!
//! Tests that would abort the process on a regression run in a child process (this binary,
//! filtered to the one test), so the abort shows as that test's failure.

use std::ffi::{c_int, c_void, CStr};
use std::process::Command;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use carve::{MemoryResource, Properties, StreamRef};
use carve_capi::ffi::*;
use carve_capi::frameworks::*;
use carve_capi::registry::{self, Entry};
use proptest::prelude::*;

#[path = "c/harness.rs"]
mod harness;

const OK: c_int = 0;
const INVALID_HANDLE: c_int = 1;
const INVALID_ARGUMENT: c_int = 2;
const OUT_OF_MEMORY: c_int = 3;
const BAD_POINTER: c_int = 6;
const UNSUPPORTED: c_int = 7;
const PANIC: c_int = 9;

/// Tests here count live handles, so they run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

const CHILD: &str = "CARVE_HOSTILE_CHILD";

/// Runs `body` in a child process that runs only the test `name`, so that an abort fails that
/// test instead of killing the whole binary. Under Miri (no processes) it runs in place.
fn in_child(name: &str, body: impl FnOnce()) {
    if cfg!(miri) || std::env::var_os(CHILD).is_some() {
        body();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} in a child process: {}\n{stdout}\n{stderr}",
        out.status
    );
}

fn last() -> String {
    // SAFETY: carve_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(carve_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn host() -> carve_resource_t {
    let mut h = ptr::null_mut();
    // SAFETY: `h` is writable.
    assert_eq!(unsafe { carve_host_resource_create(&mut h) }, OK);
    h
}

fn destroy(r: carve_resource_t) -> c_int {
    carve_resource_destroy(r)
}

fn alloc(r: carve_resource_t, bytes: usize) -> (c_int, *mut c_void) {
    let mut p = ptr::null_mut();
    // SAFETY: `p` is writable; the null stream is the legacy default stream.
    let code = unsafe { carve_allocate(r, bytes, 256, ptr::null_mut(), &mut p) };
    (code, p)
}

/// # Safety
/// `p` is null, foreign, or a block of `bytes` bytes from `r` that nothing uses any more.
unsafe fn free(r: carve_resource_t, p: *mut c_void, bytes: usize) -> c_int {
    // SAFETY: forwarded caller contract.
    unsafe { carve_deallocate(r, p, bytes, 256, ptr::null_mut()) }
}

fn stat(r: carve_resource_t, name: &str) -> f64 {
    let mut v = [carve_stat_t {
        name: ptr::null(),
        value: 0.0,
    }; 16];
    let mut n = 0;
    // SAFETY: `v` has 16 writable entries, `n` is writable.
    let code = unsafe { carve_resource_stats(r, v.as_mut_ptr(), v.len(), &mut n) };
    assert_eq!(code, OK, "{}", last());
    v[..n.min(16)]
        .iter()
        // SAFETY: statistic names are static C strings.
        .find(|s| unsafe { CStr::from_ptr(s.name) }.to_str() == Ok(name))
        .unwrap_or_else(|| panic!("no statistic {name}"))
        .value
}

fn as_handle(h: u64) -> carve_resource_t {
    h as usize as carve_resource_t
}

/// Every handle-taking C function refuses `h` with a typed error and changes nothing.
fn refuses(h: carve_resource_t, block: *mut c_void) -> Result<(), TestCaseError> {
    let (code, p) = alloc(h, 64);
    prop_assert_eq!(code, INVALID_HANDLE);
    prop_assert!(p.is_null());
    // SAFETY: the handle is refused before the pointer is looked at.
    prop_assert_eq!(unsafe { free(h, block, 64) }, INVALID_HANDLE);
    prop_assert_eq!(destroy(h), INVALID_HANDLE);
    prop_assert!(carve_resource_kind(h).is_null());
    let mut n = 0;
    // SAFETY: asking for the count only; `n` is writable.
    let code = unsafe { carve_resource_stats(h, ptr::null_mut(), 0, &mut n) };
    prop_assert_eq!(code, INVALID_HANDLE);
    prop_assert_eq!(
        // SAFETY: `released` may be null.
        unsafe { carve_resource_release(h, ptr::null_mut()) },
        INVALID_HANDLE
    );
    let mut out = ptr::null_mut();
    // SAFETY: `out` is writable.
    let code = unsafe { carve_pool_resource_create(h, 0, SIZE_NONE, &mut out) };
    prop_assert_eq!(code, INVALID_HANDLE);
    // SAFETY: `out` is writable.
    let code = unsafe { carve_statistics_adaptor_create(h, &mut out) };
    prop_assert_eq!(code, INVALID_HANDLE);
    prop_assert!(out.is_null());
    // SAFETY: `previous` may be null.
    let code = unsafe { carve_set_current_resource(0, h, ptr::null_mut()) };
    prop_assert_eq!(code, INVALID_HANDLE);
    if !h.is_null() {
        // Null means "unbind" / "the current resource" to these.
        prop_assert_eq!(carve_torch_bind_slot(15, h), INVALID_HANDLE);
        prop_assert_eq!(carve_ort_set_resource(h), INVALID_HANDLE);
        prop_assert_eq!(carve_cupy_malloc(h as isize, 64, 0), 0);
    }
    Ok(())
}

#[test]
fn forged_handles_are_refused_and_leave_live_ones_intact() {
    let _s = serial();
    let base = registry::live();
    // Slots that were used and freed, so forged handles also land on empty slots and on live
    // slots with another generation.
    let made: Vec<_> = (0..8).map(|_| host()).collect();
    for &h in &made[4..] {
        assert_eq!(destroy(h), OK);
    }
    let live: Vec<u64> = made[..4].iter().map(|&h| handle_of(h)).collect();
    let (code, block) = alloc(made[0], 64);
    assert_eq!(code, OK);

    let near = live.clone();
    let forged = prop_oneof![
        any::<u64>(),
        // One bit away from a live handle: another generation or another slot.
        (0..near.len(), 0u32..64).prop_map(move |(i, bit)| near[i] ^ (1 << bit)),
        // Small slots with any generation.
        (any::<u32>(), 0u64..16).prop_map(|(g, slot)| (u64::from(g) << 32) | slot),
        Just(0u64),
        Just(u64::MAX),
    ];
    let mut config = ProptestConfig::with_cases(if cfg!(miri) { 24 } else { 512 });
    if cfg!(miri) {
        // Miri's isolation has no working directory to keep failing cases in.
        config.failure_persistence = None;
    }
    proptest!(config, |(h in forged)| {
        prop_assume!(!live.contains(&h));
        refuses(as_handle(h), block)?;
    });

    assert_eq!(registry::live(), base + live.len());
    assert_eq!(stat(made[0], "allocation_count"), 1.0);
    // SAFETY: the block's one free, through the handle that allocated it.
    assert_eq!(unsafe { free(made[0], block, 64) }, OK);
    for &h in &made[..4] {
        let (code, p) = alloc(h, 64);
        assert_eq!(code, OK, "{}", last());
        // SAFETY: just allocated from `h`.
        assert_eq!(unsafe { free(h, p, 64) }, OK);
        assert_eq!(destroy(h), OK);
    }
    assert_eq!(registry::live(), base);
}

/// The same misuse from a C program (`capi/tests/c/hostile.c`).
#[test]
#[cfg_attr(miri, ignore = "runs a C compiler and a C program")]
fn c_program_survives_hostile_use() {
    let _s = serial();
    harness::run_c("hostile.c");
}

#[test]
fn a_double_destroy_never_reaches_the_handle_that_reuses_the_slot() {
    let _s = serial();
    let a = host();
    assert_eq!(destroy(a), OK);
    let b = host();
    assert_eq!(
        handle_of(a) & 0xFFFF_FFFF,
        handle_of(b) & 0xFFFF_FFFF,
        "b reuses a's slot"
    );
    assert_eq!(destroy(a), INVALID_HANDLE);
    assert!(last().contains("not live"), "{}", last());
    // SAFETY: a static string.
    assert_eq!(unsafe { CStr::from_ptr(carve_resource_kind(b)) }, c"host");
    let (code, p) = alloc(b, 64);
    assert_eq!(code, OK);
    // SAFETY: just allocated from `b`.
    assert_eq!(unsafe { free(b, p, 64) }, OK);
    assert_eq!(destroy(b), OK);
    assert_eq!(destroy(b), INVALID_HANDLE);
    assert_eq!(destroy(a), INVALID_HANDLE);
}

#[test]
fn destroying_a_handle_with_blocks_out_leaves_them_freeable_or_refused() {
    let _s = serial();
    let h = host();
    let mut pool = ptr::null_mut();
    let mut st = ptr::null_mut();
    // SAFETY: `pool` and `st` are writable.
    unsafe {
        assert_eq!(carve_pool_resource_create(h, 0, SIZE_NONE, &mut pool), OK);
        assert_eq!(carve_statistics_adaptor_create(pool, &mut st), OK);
    }
    // A block through the adaptor outlives its upstream handles: the adaptor holds them.
    let (code, a) = alloc(st, 1000);
    assert_eq!(code, OK);
    assert_eq!(destroy(pool), OK);
    // SAFETY: writes inside the live 1000-byte host block.
    unsafe { a.cast::<u8>().write_bytes(0x5A, 1000) };
    // SAFETY: the block's one free, through the handle that allocated it.
    assert_eq!(unsafe { free(st, a, 1000) }, OK);
    assert_eq!(stat(st, "current_bytes"), 0.0);

    // A block through a destroyed handle cannot be freed through it: a typed error, and the
    // resource's memory goes back upstream when its last holder goes.
    let (code, b) = alloc(st, 1000);
    assert_eq!(code, OK);
    assert_eq!(destroy(st), OK);
    // SAFETY: the handle is refused before the pointer is looked at.
    assert_eq!(unsafe { free(st, b, 1000) }, INVALID_HANDLE);
    assert_eq!(
        stat(h, "allocation_count"),
        0.0,
        "the pool returned its chunk"
    );

    // A framework block keeps its resource alive through destroy and unbind.
    assert_eq!(carve_torch_bind_slot(7, h), OK);
    // SAFETY: the null stream; host resources ignore streams.
    let t = unsafe { carve_torch_alloc_7(4096, 0, ptr::null_mut()) };
    assert!(!t.is_null(), "{}", last());
    let host_before = stat(h, "allocated_bytes");
    assert_eq!(destroy(h), OK);
    assert_eq!(carve_torch_bind_slot(7, ptr::null_mut()), OK);
    // SAFETY: `t` came from carve_torch_alloc_7 and nothing uses it.
    unsafe { carve_torch_free_7(t, 4096, 0, ptr::null_mut()) };
    assert_eq!(host_before, 4096.0);
    assert_eq!(carve_framework_outstanding(), 0, "{}", last());
}

#[test]
fn destroy_racing_allocations_on_other_threads_loses_nothing() {
    let _s = serial();
    let h = host();
    let mut st = ptr::null_mut();
    // SAFETY: `st` is writable.
    assert_eq!(unsafe { carve_statistics_adaptor_create(h, &mut st) }, OK);
    let st_addr = st as usize;
    let progress = Arc::new(AtomicUsize::new(0));
    let refused = Arc::new(Mutex::new(Vec::new()));
    // Each thread allocates and frees until it sees the handle destroyed.
    let threads: Vec<_> = (0..3)
        .map(|_| {
            let (progress, refused) = (progress.clone(), refused.clone());
            std::thread::spawn(move || {
                let st = st_addr as carve_resource_t;
                loop {
                    let (code, p) = alloc(st, 512);
                    if code == INVALID_HANDLE {
                        return;
                    }
                    assert_eq!(code, OK, "{}", last());
                    progress.fetch_add(1, Ordering::Relaxed);
                    // SAFETY: just allocated from `st`; nothing else uses it.
                    match unsafe { free(st, p, 512) } {
                        OK => {}
                        INVALID_HANDLE => {
                            refused.lock().unwrap().push(p as usize);
                            return;
                        }
                        other => panic!("free returned {other}: {}", last()),
                    }
                }
            })
        })
        .collect();
    while progress.load(Ordering::Relaxed) < 300 {
        std::thread::yield_now();
    }
    assert_eq!(destroy(st), OK);
    for t in threads {
        t.join().unwrap();
    }
    // Blocks whose free came after the destroy stay with the host resource, counted, and free
    // through its handle.
    let refused = refused.lock().unwrap();
    assert_eq!(stat(h, "allocation_count") as usize, refused.len());
    for &p in refused.iter() {
        // SAFETY: a 512-byte block of `h` (through the adaptor), freed once.
        assert_eq!(unsafe { free(h, p as *mut c_void, 512) }, OK);
    }
    assert_eq!(destroy(h), OK);
}

#[test]
fn null_outputs_and_pointers_are_typed_errors_and_create_nothing() {
    let _s = serial();
    let h = host();
    let base = registry::live();
    let null = ptr::null_mut();
    // SAFETY: null outputs on purpose; each is refused before anything is written.
    unsafe {
        assert_eq!(carve_host_resource_create(null), INVALID_ARGUMENT);
        assert_eq!(carve_cuda_resource_create(0, null), INVALID_ARGUMENT);
        assert_eq!(carve_managed_resource_create(0, null), INVALID_ARGUMENT);
        assert_eq!(carve_pinned_resource_create(0, 0, null), INVALID_ARGUMENT);
        assert_eq!(
            carve_async_resource_create(0, 0, SIZE_NONE, SIZE_NONE, null),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_pool_resource_create(h, 0, SIZE_NONE, null),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_binning_resource_create(h, 8, 12, null),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_arena_resource_create(h, 0, 1, SIZE_NONE, null),
            INVALID_ARGUMENT
        );
        assert_eq!(
            carve_fixed_size_resource_create(h, 256, 4, null),
            INVALID_ARGUMENT
        );
        assert_eq!(carve_limiting_adaptor_create(h, 1, null), INVALID_ARGUMENT);
        assert_eq!(carve_statistics_adaptor_create(h, null), INVALID_ARGUMENT);
        assert_eq!(carve_tracking_adaptor_create(h, 0, null), INVALID_ARGUMENT);
        assert_eq!(
            carve_logging_adaptor_create(h, c"/dev/null".as_ptr(), 0, null),
            INVALID_ARGUMENT
        );
        assert_eq!(carve_get_current_resource(0, null), INVALID_ARGUMENT);
        assert_eq!(
            carve_allocate(h, 64, 256, ptr::null_mut(), null.cast()),
            INVALID_ARGUMENT
        );
        let mut out = ptr::null_mut();
        assert_eq!(
            carve_logging_adaptor_create(h, ptr::null(), 0, &mut out),
            INVALID_ARGUMENT
        );
        assert!(out.is_null());
        assert_eq!(
            carve_resource_stats(h, ptr::null_mut(), 0, ptr::null_mut()),
            INVALID_ARGUMENT
        );
        assert_eq!(free(h, ptr::null_mut(), 64), BAD_POINTER);
        assert_eq!(carve_resource_release(h, ptr::null_mut()), UNSUPPORTED);
        carve_torch_free(ptr::null_mut(), 0, 0, ptr::null_mut());
        carve_cupy_free(0, 0, 0);
        carve_ort_free(ptr::null_mut());
    }
    assert_eq!(
        registry::live(),
        base,
        "a refused create registered nothing"
    );
    assert_eq!(stat(h, "allocation_count"), 0.0);
    assert_eq!(destroy(h), OK);
}

#[test]
fn huge_counts_and_sizes_are_typed_errors_not_aborts() {
    in_child("huge_counts_and_sizes_are_typed_errors_not_aborts", || {
        let _s = serial();
        let h = host();
        let base = registry::live();
        let mut out = ptr::null_mut();
        for arenas in [usize::MAX, 1 << 40, usize::MAX / 128, 1 << 30] {
            // SAFETY: `out` is writable.
            let code = unsafe { carve_arena_resource_create(h, 0, arenas, SIZE_NONE, &mut out) };
            assert_eq!(code, INVALID_ARGUMENT, "arenas = {arenas}: {}", last());
            assert!(last().contains("arenas"), "{}", last());
        }
        // SAFETY: `out` is writable.
        unsafe {
            assert_eq!(
                carve_arena_resource_create(h, usize::MAX, 1, SIZE_NONE, &mut out),
                INVALID_ARGUMENT
            );
            assert_eq!(
                carve_pool_resource_create(h, usize::MAX, SIZE_NONE, &mut out),
                INVALID_ARGUMENT
            );
            assert_eq!(
                carve_fixed_size_resource_create(h, usize::MAX, 1, &mut out),
                INVALID_ARGUMENT
            );
            assert_eq!(
                carve_fixed_size_resource_create(h, 256, u32::MAX, &mut out),
                INVALID_ARGUMENT
            );
            assert_eq!(
                carve_binning_resource_create(h, 0, u32::MAX, &mut out),
                INVALID_ARGUMENT
            );
        }
        assert!(out.is_null());
        assert_eq!(registry::live(), base);
        assert_eq!(destroy(h), OK);
        if cfg!(miri) {
            return; // Miri stops at an allocation it cannot hold instead of failing it.
        }
        // Sizes that are valid but that no upstream can serve are out of memory.
        let h = host();
        // SAFETY: `out` is writable.
        let code = unsafe { carve_pool_resource_create(h, 1 << 60, SIZE_NONE, &mut out) };
        assert_eq!(code, OUT_OF_MEMORY, "{}", last());
        let mut fixed = ptr::null_mut();
        // SAFETY: `fixed` is writable.
        let code = unsafe { carve_fixed_size_resource_create(h, 256, u32::MAX - 1, &mut fixed) };
        assert_eq!(code, OK, "{}", last());
        assert_eq!(alloc(fixed, 256).0, OUT_OF_MEMORY, "{}", last());
        assert_eq!(alloc(h, 1 << 60).0, OUT_OF_MEMORY, "{}", last());
        assert_eq!(destroy(fixed), OK);
        assert_eq!(destroy(h), OK);
    });
}

/// A resource that panics in every call, as a bug inside carve would.
#[derive(Debug)]
struct Panicking {
    /// Panic with a payload whose drop panics too.
    bomb: bool,
}

/// A panic payload that panics again when dropped.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panicked");
    }
}

impl Panicking {
    fn boom(&self) -> ! {
        if self.bomb {
            std::panic::panic_any(Bomb)
        }
        panic!("a bug inside the resource")
    }
}

// SAFETY: it never returns a block.
unsafe impl MemoryResource for Panicking {
    fn allocate(&self, _: StreamRef<'_>, _: usize, _: usize) -> carve::Result<NonNull<u8>> {
        self.boom()
    }
    unsafe fn deallocate(
        &self,
        _: StreamRef<'_>,
        _: NonNull<u8>,
        _: usize,
        _: usize,
    ) -> carve::Result<()> {
        self.boom()
    }
    fn properties(&self) -> Properties {
        Properties::HOST
    }
    fn device(&self) -> Option<carve::Device> {
        None
    }
}

fn panicking(bomb: bool) -> carve_resource_t {
    let entry = Entry::new(c"host", Arc::new(Panicking { bomb }));
    to_c(registry::insert(entry).unwrap())
}

#[test]
fn a_panic_inside_a_resource_is_a_panic_code_at_every_entry_point() {
    let _s = serial();
    let r = panicking(false);
    let (code, p) = alloc(r, 64);
    assert_eq!(code, PANIC);
    assert!(p.is_null());
    assert!(last().contains("a bug inside the resource"), "{}", last());
    let mut x = 0u64;
    // SAFETY: the resource panics before it looks at the pointer.
    assert_eq!(unsafe { free(r, (&mut x as *mut u64).cast(), 64) }, PANIC);
    assert_eq!(carve_cupy_malloc(r as isize, 64, 0), 0);
    assert!(last().contains("carve panicked"), "{}", last());
    assert_eq!(carve_torch_bind_slot(9, r), OK);
    // SAFETY: the null stream.
    assert!(unsafe { carve_torch_alloc_9(64, 0, ptr::null_mut()) }.is_null());
    assert_eq!(carve_torch_bind_slot(9, ptr::null_mut()), OK);
    assert_eq!(destroy(r), OK);
}

#[test]
fn a_panic_whose_payload_panics_on_drop_does_not_unwind() {
    in_child(
        "a_panic_whose_payload_panics_on_drop_does_not_unwind",
        || {
            let _s = serial();
            let r = panicking(true);
            let (code, p) = alloc(r, 64);
            assert_eq!(code, PANIC);
            assert!(p.is_null());
            assert_eq!(destroy(r), OK);
        },
    );
}

#[test]
fn calls_from_a_thread_local_destructor_do_not_abort() {
    in_child("calls_from_a_thread_local_destructor_do_not_abort", || {
        struct CallsOnDrop;
        impl Drop for CallsOnDrop {
            fn drop(&mut self) {
                // carve's own thread-locals are gone by now (destroyed in reverse order).
                let (code, _) = alloc(ptr::null_mut(), 64);
                assert_eq!(code, INVALID_HANDLE);
                // SAFETY: carve_last_error returns a valid NUL-terminated string.
                let _ = unsafe { CStr::from_ptr(carve_last_error()) };
                DONE.fetch_add(1, Ordering::Relaxed);
            }
        }
        thread_local! {
            static LATE: CallsOnDrop = const { CallsOnDrop };
        }
        static DONE: AtomicUsize = AtomicUsize::new(0);
        std::thread::spawn(|| {
            LATE.with(|_| {});
            // Registers carve's last-error thread-local after LATE.
            assert_eq!(alloc(ptr::null_mut(), 64).0, INVALID_HANDLE);
        })
        .join()
        .unwrap();
        assert_eq!(DONE.load(Ordering::Relaxed), 1);
    });
}
