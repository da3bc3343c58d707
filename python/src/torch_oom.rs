//! `torch.OutOfMemoryError` from carve's PyTorch allocation function under `carve.torch.use`,
//! with no compiler at run time.
//!
//! PyTorch's `CUDAPluggableAllocator` keeps whatever pointer its allocation function returns:
//! a null one would become a tensor at address 0. A C++ allocator reports failure by throwing,
//! so [`carve_torch_alloc_or_throw`] throws PyTorch's own `c10::OutOfMemoryError`, which
//! PyTorch's Python bindings turn into `torch.OutOfMemoryError`. It needs only what the
//! installed PyTorch exports and what the Itanium C++ ABI fixes:
//! - `c10::Error`'s constructor builds the object in memory from `__cxa_allocate_exception`;
//! - `c10::OutOfMemoryError` adds no members to `c10::Error`, so pointing the object at its
//!   vtable makes it one, and its type info is what `catch (const c10::OutOfMemoryError&)`
//!   matches;
//! - `__cxa_throw` raises it, with the destructor the vtable lists first.
//!
//! Every symbol is looked up once, by [`torch_oom_thrower`]; if one is missing, `carve.torch.use`
//! is told why and nothing of this is used.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;

use pyo3::exceptions::PyOSError;
use pyo3::prelude::*;

/// `c10::SourceLocation`, passed by value (trivially copyable: in memory, as C passes it).
#[repr(C)]
struct SourceLocation {
    function: *const c_char,
    file: *const c_char,
    line: u32,
}

/// libstdc++'s `std::string` (the C++11 ABI, which PyTorch wheels use): data pointer, length,
/// then the capacity or, for short strings, the characters themselves.
#[repr(C)]
struct CxxString {
    data: *mut u8,
    len: usize,
    local: [usize; 2],
}
const _: () = assert!(size_of::<CxxString>() == 32);

/// Bytes asked of `__cxa_allocate_exception`: more than any `c10::Error` holds (a few strings,
/// a vector and two pointers), since its size is not exported.
const EXCEPTION_BYTES: usize = 1024;

type Allocate = unsafe extern "C" fn(usize) -> *mut c_void;
type Destroy = unsafe extern "C" fn(*mut c_void);
type Throw = unsafe extern "C-unwind" fn(*mut c_void, *const c_void, Option<Destroy>) -> !;
type New = unsafe extern "C-unwind" fn(usize) -> *mut c_void;
type Delete = unsafe extern "C" fn(*mut c_void);
type Construct = unsafe extern "C-unwind" fn(*mut c_void, SourceLocation, *mut CxxString);

/// What throwing takes, resolved in the loaded PyTorch and C++ runtime.
struct Thrower {
    allocate: Allocate,
    throw: Throw,
    new: New,
    delete: Delete,
    construct: Construct,
    /// `c10::OutOfMemoryError`'s vtable address point (two words past the symbol).
    vtable: usize,
    type_info: usize,
    destroy: Destroy,
}

static THROWER: OnceLock<Thrower> = OnceLock::new();

const C10_ERROR_CTOR: &CStr =
    c"_ZN3c105ErrorC1ENS_14SourceLocationENSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE";
const OOM_VTABLE: &CStr = c"_ZTVN3c1016OutOfMemoryErrorE";
const OOM_TYPE_INFO: &CStr = c"_ZTIN3c1016OutOfMemoryErrorE";

/// A library PyTorch has loaded already, opened again for lookups (never closed: PyTorch keeps
/// it loaded for the life of the process).
fn loaded(path: &str) -> Result<*mut c_void, String> {
    let c = CString::new(path).map_err(|_| format!("{path:?} holds a NUL byte"))?;
    // SAFETY: `c` is a NUL-terminated path; RTLD_NOLOAD only finds a library already loaded.
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        return Err(format!("{path} is not loaded (import torch first)"));
    }
    Ok(h)
}

/// `name` in `lib` or the libraries it depends on.
fn symbol(lib: *mut c_void, name: &CStr) -> Result<usize, String> {
    // SAFETY: `lib` is a live handle from `dlopen`; `name` is NUL-terminated.
    let p = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if p.is_null() {
        return Err(format!("PyTorch exports no {}", name.to_string_lossy()));
    }
    Ok(p as usize)
}

fn resolve(c10: &str, c10_cuda: &str) -> Result<Thrower, String> {
    let (base, cuda) = (loaded(c10)?, loaded(c10_cuda)?);
    let vtable = symbol(cuda, OOM_VTABLE)?;
    // The first virtual function of a class derived from `std::exception` is its complete-object
    // destructor, at the vtable's address point (two words past the symbol).
    // SAFETY: each address is the named symbol's, and each type is the signature the C++ ABI
    // gives it (`__cxa_*` per the Itanium ABI; `operator new(size_t)`, `operator delete(void*)`;
    // a constructor takes `this` first and returns nothing on x86-64); the vtable is mapped.
    unsafe {
        let destroy = *((vtable + 2 * size_of::<usize>()) as *const usize);
        Ok(Thrower {
            allocate: std::mem::transmute::<usize, Allocate>(symbol(
                base,
                c"__cxa_allocate_exception",
            )?),
            throw: std::mem::transmute::<usize, Throw>(symbol(base, c"__cxa_throw")?),
            new: std::mem::transmute::<usize, New>(symbol(base, c"_Znwm")?),
            delete: std::mem::transmute::<usize, Delete>(symbol(base, c"_ZdlPv")?),
            construct: std::mem::transmute::<usize, Construct>(symbol(base, C10_ERROR_CTOR)?),
            vtable: vtable + 2 * size_of::<usize>(),
            type_info: symbol(cuda, OOM_TYPE_INFO)?,
            destroy: std::mem::transmute::<usize, Destroy>(destroy),
        })
    }
}

/// Resolves what throwing needs in the loaded PyTorch (`c10` and `c10_cuda` are the paths of
/// its `libc10.so` and `libc10_cuda.so`) and returns the address of
/// [`carve_torch_alloc_or_throw`]; OSError names what is missing.
#[pyfunction]
pub fn torch_oom_thrower(c10: &str, c10_cuda: &str) -> PyResult<usize> {
    if THROWER.get().is_none() {
        let t = resolve(c10, c10_cuda).map_err(PyOSError::new_err)?;
        let _ = THROWER.set(t);
    }
    Ok(carve_torch_alloc_or_throw as *const () as usize)
}

/// A `c10::OutOfMemoryError(message)`, built in exception memory and ready for `__cxa_throw`.
///
/// # Safety
/// `t` holds the symbols `resolve` found in the loaded PyTorch.
unsafe fn out_of_memory_error(t: &Thrower, message: &str) -> *mut c_void {
    let loc = SourceLocation {
        function: c"carve_torch_alloc".as_ptr(),
        file: c"carve".as_ptr(),
        line: 0,
    };
    // SAFETY: the calls follow the Itanium ABI and the signatures `resolve` looked up by name.
    // The string owns a buffer from `operator new` holding `len` bytes and a NUL, as libstdc++
    // requires of a heap string; the constructor moves it out (or copies it, and then the
    // buffer is still ours to delete). The object is a `c10::Error` in memory large enough for
    // one; its vtable then makes it a `c10::OutOfMemoryError`, which has no other members.
    // Should the C++ runtime run out of host memory here, its `bad_alloc` ends the process.
    unsafe {
        let obj = (t.allocate)(EXCEPTION_BYTES);
        let bytes = message.as_bytes();
        let data = (t.new)(bytes.len() + 1).cast::<u8>();
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), data, bytes.len());
        *data.add(bytes.len()) = 0;
        let mut msg = CxxString {
            data,
            len: bytes.len(),
            local: [bytes.len(), 0],
        };
        (t.construct)(obj, loc, &mut msg);
        if msg.data != std::ptr::addr_of_mut!(msg.local).cast::<u8>() {
            (t.delete)(msg.data.cast());
        }
        *obj.cast::<usize>() = t.vtable;
        obj
    }
}

/// The exception for a refused allocation of `device`, with `carve_last_error()`'s message;
/// null if building it panicked.
#[inline(never)]
fn refusal(t: &Thrower, device: c_int) -> *mut c_void {
    catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `carve_last_error` returns a NUL-terminated string valid until the next call
        // on this thread.
        let why = unsafe { CStr::from_ptr(carve_capi::ffi::carve_last_error()) };
        let message = format!(
            "carve: CUDA out of memory on device {device}: {}",
            why.to_string_lossy()
        );
        // SAFETY: `t` came from `resolve`.
        unsafe { out_of_memory_error(t, &message) }
    }))
    .unwrap_or(std::ptr::null_mut())
}

/// PyTorch `alloc` for `carve.torch.use`: [`carve_capi::frameworks::carve_torch_alloc`], and
/// when it fails, `c10::OutOfMemoryError` with carve's message.
///
/// This is the one carve function that unwinds into its caller, on purpose and only with a C++
/// exception, which PyTorch catches; a Rust panic before the throw is caught and returns null.
/// Neither it nor anything it calls holds a value to drop when the exception leaves: the
/// exception then passes its frame by the unwind tables alone, with no Rust personality routine
/// (which, linked statically beside its own unwinder, could not read the C++ runtime's
/// unwinding state).
///
/// # Safety
/// As `carve_torch_alloc`; the caller is C++ that handles exceptions.
pub unsafe extern "C-unwind" fn carve_torch_alloc_or_throw(
    size: isize,
    device: c_int,
    stream: *mut c_void,
) -> *mut c_void {
    // SAFETY: forwarded caller contract.
    let p = unsafe { carve_capi::frameworks::carve_torch_alloc(size, device, stream) };
    if !p.is_null() || size == 0 {
        return p;
    }
    let Some(t) = THROWER.get() else {
        return p;
    };
    let error = refusal(t, device);
    if error.is_null() {
        return p;
    }
    // SAFETY: PyTorch's allocator called this from C++, which catches the exception; `error`
    // is a constructed `c10::OutOfMemoryError` in exception memory.
    unsafe { (t.throw)(error, t.type_info as *const c_void, Some(t.destroy)) }
}
