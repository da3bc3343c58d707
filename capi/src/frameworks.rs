//! The allocator symbols frameworks call, with the exact signatures they expect:
//!
//! - PyTorch `CUDAPluggableAllocator`: `void* alloc(ssize_t, int, cudaStream_t)` and
//!   `void free(void*, ssize_t, int, cudaStream_t)`. [`carve_torch_alloc`] uses the device's
//!   current carve resource; `carve_torch_alloc_N` (N = 0..15) use the resource bound to slot N
//!   with [`carve_torch_bind_slot`], so several `torch.cuda.MemPool`s can each have their own.
//!   Optional hooks: [`carve_torch_reset`] (release) and [`carve_torch_set_memory_fraction`]
//!   (a [`LimitBudget`] per device that every torch allocation on it counts against).
//! - CuPy `CFunctionAllocator`: `intptr_t malloc(intptr_t param, size_t, int)` and
//!   `void free(intptr_t param, intptr_t, int)`; `param` is a resource handle (0: current).
//! - ONNX Runtime CUDA EP `gpu_external_alloc/free/empty_cache`: `void* (size_t)`,
//!   `void (void*)`, `void ()`; the resource is the one bound with [`carve_ort_set_resource`],
//!   else the current resource of the calling thread's device.
//!
//! Every block handed out here is recorded with its resource and size, so
//! a free goes to the resource that allocated (even if the binding changed since), CuPy's and
//! ONNX Runtime's size-less frees work, and a foreign or repeated free is refused. Failures
//! return null (allocations) or do nothing (frees) and set `carve_last_error()`.

use std::collections::HashMap;
use std::ffi::{c_double, c_int, c_void};
use std::ptr::NonNull;
use std::sync::{Arc, LazyLock, Mutex, PoisonError, RwLock};

use carve::adaptor::{LimitBudget, LimitingResourceAdaptor};
use carve::resource::DEFAULT_ALIGNMENT;
use carve::{Device, SharedResource, StreamRef};

use crate::error::{catch, Code, FfiError, FfiResult};
use crate::ffi::{carve_resource_t, handle_of};
use crate::make;
use crate::registry::{self, Entry};

/// Number of PyTorch slots (`carve_torch_alloc_0` .. `carve_torch_alloc_15`).
pub const TORCH_SLOTS: usize = 16;
const MAX_DEVICES: usize = 64;
const SHARDS: usize = 32;

/// A block handed to a framework, with the resource that frees it.
#[derive(Debug)]
struct Block {
    resource: SharedResource,
    size: usize,
}

/// Blocks handed to frameworks, by address (sharded to keep threads apart).
struct Outstanding {
    shards: Vec<Mutex<HashMap<usize, Block>>>,
}

static OUTSTANDING: LazyLock<Outstanding> = LazyLock::new(|| Outstanding {
    shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
});

impl Outstanding {
    fn shard(&self, addr: usize) -> std::sync::MutexGuard<'_, HashMap<usize, Block>> {
        // Blocks are at least 256-byte aligned; mix the bits above that.
        let i = (addr >> 8).wrapping_mul(0x9E37_79B9) % SHARDS;
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Allocates `size` bytes from `resource` on `stream` and records the block.
fn alloc_recorded(
    resource: SharedResource,
    size: usize,
    stream: StreamRef<'_>,
) -> FfiResult<*mut c_void> {
    let p = resource.allocate(stream, size, DEFAULT_ALIGNMENT)?;
    let addr = p.as_ptr() as usize;
    OUTSTANDING
        .shard(addr)
        .insert(addr, Block { resource, size });
    Ok(p.as_ptr().cast())
}

/// Frees a recorded block on `stream`; a pointer not recorded is refused untouched.
fn free_recorded(ptr: *mut c_void, stream: StreamRef<'_>) -> FfiResult<()> {
    let Some(p) = NonNull::new(ptr.cast::<u8>()) else {
        return Ok(()); // frameworks free null for zero-byte allocations
    };
    let addr = p.as_ptr() as usize;
    let block = OUTSTANDING.shard(addr).remove(&addr).ok_or_else(|| {
        FfiError::new(
            Code::BadPointer,
            format!("pointer {addr:#x} was not allocated through carve's framework allocators (or was freed already)"),
        )
    })?;
    // SAFETY: the block was allocated from this resource with this size and alignment, and
    // was just removed from the table, so it is freed once.
    let freed = unsafe {
        block
            .resource
            .deallocate(stream, p, block.size, DEFAULT_ALIGNMENT)
    };
    if let Err(e) = freed {
        // Keep the record: the resource still owns the block, so a later free may succeed.
        OUTSTANDING.shard(addr).insert(addr, block);
        return Err(e.into());
    }
    Ok(())
}

/// Blocks currently handed out through the framework symbols (for tests and leak checks).
pub fn outstanding_blocks() -> usize {
    OUTSTANDING
        .shards
        .iter()
        .map(|s| s.lock().unwrap_or_else(PoisonError::into_inner).len())
        .sum()
}

fn device(d: c_int) -> FfiResult<usize> {
    usize::try_from(d).map_err(|_| FfiError::new(Code::NoDevice, format!("device ordinal {d}")))
}

fn size_of(size: isize) -> FfiResult<usize> {
    usize::try_from(size).map_err(|_| FfiError::invalid(format!("negative size {size}")))
}

/// The framework's stream, as a handle that the caller uses only during the call into carve.
///
/// # Safety
/// `stream` must be valid for `'a` (frameworks pass a stream valid for the call).
unsafe fn stream_of<'a>(stream: *mut c_void) -> StreamRef<'a> {
    // SAFETY: forwarded caller contract.
    unsafe { StreamRef::from_raw(stream.cast()) }
}

// ---- PyTorch --------------------------------------------------------------------------------

static TORCH_SLOT: [RwLock<Option<Arc<Entry>>>; TORCH_SLOTS] =
    [const { RwLock::new(None) }; TORCH_SLOTS];
/// Per device, the budget every torch allocation counts against: unlimited until a memory
/// fraction is set. Counted in exact bytes, as PyTorch counts.
static TORCH_BUDGET: LazyLock<Vec<LimitBudget>> = LazyLock::new(|| {
    (0..MAX_DEVICES)
        .map(|_| LimitBudget::new(usize::MAX, 1).expect("1 is a power of two"))
        .collect()
});

fn torch_budget(device: usize) -> &'static LimitBudget {
    &TORCH_BUDGET[device % MAX_DEVICES]
}

/// Binds slot `slot` to `entry` (None: unbinds). Blocks already handed out keep freeing
/// through the resource that allocated them.
pub fn bind_torch_slot(slot: usize, entry: Option<Arc<Entry>>) -> FfiResult<()> {
    let s = TORCH_SLOT.get(slot).ok_or_else(|| {
        FfiError::invalid(format!("torch slot {slot} is not in 0..{TORCH_SLOTS}"))
    })?;
    *s.write().unwrap_or_else(PoisonError::into_inner) = entry;
    Ok(())
}

/// The entry bound to `slot`, if any.
pub fn torch_slot(slot: usize) -> Option<Arc<Entry>> {
    TORCH_SLOT
        .get(slot)?
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .clone()
}

/// A resource wrapped to count against a device's torch budget, with what it was built for.
struct Limited {
    /// The wrapped resource's address and the device.
    key: (usize, usize),
    limited: SharedResource,
}

/// The last budget-counting adaptor built per torch slot, then per device for the current
/// resource: PyTorch allocates through the same resource call after call, and building the
/// adaptor each time would cost two heap allocations on its allocation path. An entry keeps its
/// resource alive, so no other resource can take its address while it is cached.
static TORCH_LIMITED: LazyLock<Vec<RwLock<Option<Limited>>>> = LazyLock::new(|| {
    (0..TORCH_SLOTS + MAX_DEVICES)
        .map(|_| RwLock::new(None))
        .collect()
});

/// `resource` counting against `device`'s torch budget, from cache entry `cache` when it was
/// built for the same resource and device.
fn limited(cache: usize, resource: SharedResource, device: usize) -> SharedResource {
    let key = (Arc::as_ptr(&resource).cast::<()>() as usize, device);
    let cell = &TORCH_LIMITED[cache];
    if let Some(hit) = cell.read().unwrap_or_else(PoisonError::into_inner).as_ref() {
        if hit.key == key {
            return hit.limited.clone();
        }
    }
    let budget = torch_budget(device).clone();
    let limited: SharedResource = Arc::new(LimitingResourceAdaptor::with_budget(resource, budget));
    *cell.write().unwrap_or_else(PoisonError::into_inner) = Some(Limited {
        key,
        limited: limited.clone(),
    });
    limited
}

/// Allocates from `resource` (cached in entry `cache`) through `device`'s torch budget; a
/// refusal by the budget names the memory fraction.
fn torch_alloc_from(
    cache: usize,
    resource: SharedResource,
    size: usize,
    stream: StreamRef<'_>,
    device: usize,
) -> FfiResult<*mut c_void> {
    let budget = torch_budget(device);
    alloc_recorded(limited(cache, resource, device), size, stream).map_err(|e| {
        let (used, cap) = (budget.allocated_bytes(), budget.limit());
        if e.code == Code::OutOfMemory && used.saturating_add(size) > cap {
            FfiError::new(
                Code::OutOfMemory,
                format!("out of memory: {size} bytes requested on device {device}, {used} in use, memory fraction allows {cap}"),
            )
        } else {
            e
        }
    })
}

/// # Safety
/// `stream` must be null or a stream valid during the call.
unsafe fn torch_alloc(
    slot: Option<usize>,
    size: isize,
    dev: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    catch(|| {
        let size = size_of(size)?;
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        let device = device(dev)?;
        let (cache, resource) = match slot {
            None => (
                TORCH_SLOTS + device % MAX_DEVICES,
                carve::current::get(device)?,
            ),
            Some(s) => (
                s,
                torch_slot(s)
                    .ok_or_else(|| {
                        FfiError::new(
                            Code::InvalidHandle,
                            format!("torch slot {s} has no resource bound"),
                        )
                    })?
                    .resource
                    .clone(),
            ),
        };
        // SAFETY: the caller passes a stream valid for this call, which is all the handle is
        // used for.
        let stream = unsafe { stream_of(stream) };
        torch_alloc_from(cache, resource, size, stream, device)
    })
    .unwrap_or(std::ptr::null_mut())
}

/// # Safety
/// As [`carve_torch_free`].
unsafe fn torch_free(ptr: *mut c_void, stream: *mut c_void) {
    // SAFETY: the caller passes a stream valid for this call, which is all the handle is used
    // for, and gives up the block.
    let _ = catch(|| free_recorded(ptr, unsafe { stream_of(stream) }));
}

/// PyTorch `alloc`: from the current carve resource of `device`.
///
/// # Safety
/// `stream` must be null (the legacy default stream) or a stream valid during the call.
#[no_mangle]
pub unsafe extern "C" fn carve_torch_alloc(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: forwarded caller contract.
    unsafe { torch_alloc(None, size, device, stream) }
}

/// PyTorch `free` (any carve torch allocation, whichever slot made it).
///
/// # Safety
/// `stream` must be null or a stream valid during the call. When `ptr` is a block carve handed
/// out, nothing may use it after this call except work already queued on `stream`.
#[no_mangle]
pub unsafe extern "C" fn carve_torch_free(
    ptr: *mut c_void,
    _size: isize,
    _device: c_int,
    stream: *mut c_void,
) {
    // SAFETY: forwarded caller contract.
    unsafe { torch_free(ptr, stream) }
}

macro_rules! torch_slots {
    ($($n:literal $alloc:ident $free:ident),* $(,)?) => {$(
        /// PyTorch `alloc` bound to a slot (see [`carve_torch_bind_slot`]).
        ///
        /// # Safety
        /// As [`carve_torch_alloc`].
        #[no_mangle]
        pub unsafe extern "C" fn $alloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
            // SAFETY: forwarded caller contract.
            unsafe { torch_alloc(Some($n), size, device, stream) }
        }
        /// PyTorch `free` for a slot's allocator.
        ///
        /// # Safety
        /// As [`carve_torch_free`].
        #[no_mangle]
        pub unsafe extern "C" fn $free(ptr: *mut c_void, _size: isize, _device: c_int, stream: *mut c_void) {
            // SAFETY: forwarded caller contract.
            unsafe { torch_free(ptr, stream) }
        }
    )*};
}

torch_slots!(
    0 carve_torch_alloc_0 carve_torch_free_0, 1 carve_torch_alloc_1 carve_torch_free_1,
    2 carve_torch_alloc_2 carve_torch_free_2, 3 carve_torch_alloc_3 carve_torch_free_3,
    4 carve_torch_alloc_4 carve_torch_free_4, 5 carve_torch_alloc_5 carve_torch_free_5,
    6 carve_torch_alloc_6 carve_torch_free_6, 7 carve_torch_alloc_7 carve_torch_free_7,
    8 carve_torch_alloc_8 carve_torch_free_8, 9 carve_torch_alloc_9 carve_torch_free_9,
    10 carve_torch_alloc_10 carve_torch_free_10, 11 carve_torch_alloc_11 carve_torch_free_11,
    12 carve_torch_alloc_12 carve_torch_free_12, 13 carve_torch_alloc_13 carve_torch_free_13,
    14 carve_torch_alloc_14 carve_torch_free_14, 15 carve_torch_alloc_15 carve_torch_free_15,
);

/// Binds PyTorch slot `slot` to `r` (null unbinds).
#[no_mangle]
pub extern "C" fn carve_torch_bind_slot(slot: c_int, r: carve_resource_t) -> c_int {
    crate::error::guard(|| {
        let slot =
            usize::try_from(slot).map_err(|_| FfiError::invalid(format!("torch slot {slot}")))?;
        let entry = if r.is_null() {
            None
        } else {
            Some(registry::get(handle_of(r))?)
        };
        bind_torch_slot(slot, entry)
    })
}

/// PyTorch reset hook: releases what the bound slots' resources (and the current resources
/// used so far) hold unused. Resources that cannot release are skipped.
#[no_mangle]
pub extern "C" fn carve_torch_reset() {
    let _ = catch(|| {
        for slot in 0..TORCH_SLOTS {
            if let Some(e) = torch_slot(slot) {
                let _ = make::release(&e);
            }
        }
        Ok(())
    });
}

/// PyTorch memory-fraction hook: torch allocations on `device` fail (null, so PyTorch raises
/// its out-of-memory error) once they would exceed `fraction` of the device's memory.
/// `fraction` outside `(0, 1]` removes the limit.
#[no_mangle]
pub extern "C" fn carve_torch_set_memory_fraction(fraction: c_double, device: c_int) {
    let _ = catch(|| {
        let d = self::device(device)?;
        let limit = if fraction > 0.0 && fraction <= 1.0 {
            let total = carve::current::mem_info(d)?.total;
            (fraction * total as f64) as usize
        } else {
            usize::MAX
        };
        torch_budget(d).set_limit(limit);
        Ok(())
    });
}

// ---- CuPy -----------------------------------------------------------------------------------

/// CuPy `malloc`: `param` is a resource handle (0: the device's current resource). Returns 0
/// on failure; `carve.cupy` turns that into `cupy.cuda.memory.OutOfMemoryError`.
#[no_mangle]
pub extern "C" fn carve_cupy_malloc(param: isize, size: usize, dev: c_int) -> isize {
    catch(|| {
        if size == 0 {
            return Ok(0);
        }
        let device = device(dev)?;
        let resource = if param == 0 {
            carve::current::get(device)?
        } else {
            registry::get(param as u64)?.resource.clone()
        };
        let p = alloc_recorded(resource, size, StreamRef::DEFAULT)?;
        Ok(p as isize)
    })
    .unwrap_or(0)
}

/// CuPy `free`.
///
/// # Safety
/// When `ptr` is a block carve handed out, nothing may use it after this call except work
/// already queued on the legacy default stream.
#[no_mangle]
pub unsafe extern "C" fn carve_cupy_free(_param: isize, ptr: isize, _device: c_int) {
    let _ = catch(|| free_recorded(ptr as *mut c_void, StreamRef::DEFAULT));
}

// ---- ONNX Runtime ---------------------------------------------------------------------------

static ORT: RwLock<Option<Arc<Entry>>> = RwLock::new(None);

/// Binds ONNX Runtime's allocator symbols to `entry` (None: the current resource of the
/// calling thread's device).
pub fn bind_ort(entry: Option<Arc<Entry>>) {
    *ORT.write().unwrap_or_else(PoisonError::into_inner) = entry;
}

/// Binds ONNX Runtime's allocator to `r` (null: the current resource of the caller's device).
#[no_mangle]
pub extern "C" fn carve_ort_set_resource(r: carve_resource_t) -> c_int {
    crate::error::guard(|| {
        let entry = if r.is_null() {
            None
        } else {
            Some(registry::get(handle_of(r))?)
        };
        bind_ort(entry);
        Ok(())
    })
}

fn ort_resource() -> FfiResult<SharedResource> {
    if let Some(e) = ORT.read().unwrap_or_else(PoisonError::into_inner).as_ref() {
        return Ok(e.resource.clone());
    }
    Ok(carve::current::get(Device::current()?.ordinal())?)
}

/// ONNX Runtime `gpu_external_alloc`.
#[no_mangle]
pub extern "C" fn carve_ort_alloc(size: usize) -> *mut c_void {
    catch(|| {
        if size == 0 {
            return Ok(std::ptr::null_mut());
        }
        alloc_recorded(ort_resource()?, size, StreamRef::DEFAULT)
    })
    .unwrap_or(std::ptr::null_mut())
}

/// ONNX Runtime `gpu_external_free`.
///
/// # Safety
/// When `ptr` is a block carve handed out, nothing may use it after this call except work
/// already queued on the legacy default stream.
#[no_mangle]
pub unsafe extern "C" fn carve_ort_free(ptr: *mut c_void) {
    let _ = catch(|| free_recorded(ptr, StreamRef::DEFAULT));
}

/// ONNX Runtime `gpu_external_empty_cache`: releases what the bound resource holds unused.
#[no_mangle]
pub extern "C" fn carve_ort_empty_cache() {
    let _ = catch(|| {
        if let Ok(resource) = ort_resource() {
            let _ = resource.release_unused();
        }
        Ok(())
    });
}

/// `carve_framework_outstanding`: blocks handed to frameworks and not yet freed.
#[no_mangle]
pub extern "C" fn carve_framework_outstanding() -> usize {
    catch(|| Ok(outstanding_blocks())).unwrap_or(0)
}
