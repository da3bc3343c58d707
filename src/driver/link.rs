//! JIT-linking PTX modules with the driver's linker (cuLinkCreate / cuLinkAddData /
//! cuLinkComplete), so that kernels written in other languages can call carve's device functions:
//! compile a CUDA C++ kernel with `nvcc -rdc=true -ptx`, then link it with [`super::PTX`].

use std::ffi::{c_void, CString};
use std::ptr;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUjitInputType, CUjit_option, CUlinkState};
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use super::Device;
use crate::error::{DriverCode, Error, Result};

/// Bytes kept of each of the linker's logs.
const LOG_BYTES: usize = 16 * 1024;

/// One PTX text to link, named for the linker's messages.
#[derive(Clone, Copy, Debug)]
pub struct PtxInput<'a> {
    /// The name the linker's log uses.
    pub name: &'a str,
    /// The PTX text.
    pub ptx: &'a str,
}

impl<'a> PtxInput<'a> {
    /// A PTX text called `name` in the linker's log.
    pub fn new(name: &'a str, ptx: &'a str) -> Self {
        PtxInput { name, ptx }
    }

    /// carve's own PTX module ([`super::PTX`]), which exports `carve_slab_alloc` and friends.
    pub fn carve() -> PtxInput<'static> {
        PtxInput::new("carve_kernels.ptx", super::PTX)
    }
}

/// A module linked from several PTX texts and loaded into one device's context.
#[derive(Debug, Clone)]
pub struct LinkedModule {
    module: Arc<CudaModule>,
}

impl LinkedModule {
    /// Links `inputs` for `device`'s architecture and loads the result into its context.
    pub fn link(device: &Device, inputs: &[PtxInput<'_>]) -> Result<LinkedModule> {
        let cubin = link_ptx(device, inputs)?;
        let module = device
            .context()
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| Error::driver("cuModuleLoadData", e))?;
        Ok(LinkedModule { module })
    }

    /// A kernel of the module, by its exported (unmangled) name.
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        if name.contains('\0') {
            return Err(Error::InvalidArgument(format!(
                "kernel name {name:?} contains a NUL byte"
            )));
        }
        self.module
            .load_function(name)
            .map_err(|e| Error::driver("cuModuleGetFunction", e))
    }

    /// The cudarc module, for cudarc's own launch and symbol APIs.
    pub fn cudarc(&self) -> &Arc<CudaModule> {
        &self.module
    }
}

/// Links `inputs` (PTX texts) into one cubin for `device`'s architecture, and returns its bytes.
/// A link error returns [`Error::Link`] with the linker's log.
pub fn link_ptx(device: &Device, inputs: &[PtxInput<'_>]) -> Result<Vec<u8>> {
    if inputs.is_empty() {
        return Err(Error::InvalidArgument("nothing to link".to_owned()));
    }
    let texts = inputs
        .iter()
        .map(|i| Ok((c_string(i.name, "name")?, c_string(i.ptx, i.name)?)))
        .collect::<Result<Vec<_>>>()?;
    // The linker targets the current context's device.
    device.bind()?;
    let mut state = LinkState::new()?;
    for (name, ptx) in &texts {
        state.add_ptx(name, ptx)?;
    }
    state.complete()
}

fn c_string(s: &str, what: &str) -> Result<CString> {
    CString::new(s)
        .map_err(|_| Error::InvalidArgument(format!("{what}: PTX input contains a NUL byte")))
}

/// A live `CUlinkState` and the log buffers it writes into; destroyed on drop, so every path
/// out of [`link_ptx`] releases it.
struct LinkState {
    raw: CUlinkState,
    // Boxed so that their addresses, given to the driver, stay put until `cuLinkDestroy`.
    info: Box<[u8; LOG_BYTES]>,
    error: Box<[u8; LOG_BYTES]>,
}

impl LinkState {
    fn new() -> Result<Self> {
        let mut info = Box::new([0u8; LOG_BYTES]);
        let mut error = Box::new([0u8; LOG_BYTES]);
        let mut options = [
            CUjit_option::CU_JIT_INFO_LOG_BUFFER,
            CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
            CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        ];
        // Size options pass their value in the pointer itself, as the driver API specifies.
        let mut values: [*mut c_void; 4] = [
            info.as_mut_ptr().cast(),
            LOG_BYTES as *mut c_void,
            error.as_mut_ptr().cast(),
            LOG_BYTES as *mut c_void,
        ];
        let mut raw: CUlinkState = ptr::null_mut();
        // SAFETY: the option and value arrays have the same length; the log buffers are
        // LOG_BYTES long and live in `Self` until cuLinkDestroy; a context is current.
        let rc = unsafe {
            sys::cuLinkCreate_v2(
                options.len() as u32,
                options.as_mut_ptr(),
                values.as_mut_ptr(),
                &mut raw,
            )
        };
        if raw.is_null() {
            return Err(Error::Link {
                call: "cuLinkCreate",
                code: DriverCode(rc),
                log: log_text(&error[..]),
            });
        }
        // Owned from here on, so that it is destroyed even if the driver reported an error.
        let state = LinkState { raw, info, error };
        state.check("cuLinkCreate", rc)?;
        Ok(state)
    }

    fn add_ptx(&mut self, name: &CString, ptx: &CString) -> Result<()> {
        let bytes = ptx.as_bytes_with_nul();
        // SAFETY: `raw` is a live link state; the PTX is NUL-terminated and `bytes.len()` long
        // (the driver copies it before returning); no per-input options.
        let rc = unsafe {
            sys::cuLinkAddData_v2(
                self.raw,
                CUjitInputType::CU_JIT_INPUT_PTX,
                bytes.as_ptr() as *mut c_void,
                bytes.len(),
                name.as_ptr(),
                0,
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        self.check("cuLinkAddData", rc)
    }

    fn complete(self) -> Result<Vec<u8>> {
        let mut cubin: *mut c_void = ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: `raw` is a live link state; the out-pointers are valid.
        let rc = unsafe { sys::cuLinkComplete(self.raw, &mut cubin, &mut size) };
        self.check("cuLinkComplete", rc)?;
        if cubin.is_null() || size == 0 {
            return Err(Error::Link {
                call: "cuLinkComplete",
                code: DriverCode(rc),
                log: "the linker returned an empty image".to_owned(),
            });
        }
        // SAFETY: the driver owns `size` bytes at `cubin` until cuLinkDestroy (on drop, after
        // this copy).
        Ok(unsafe { std::slice::from_raw_parts(cubin as *const u8, size) }.to_vec())
    }

    fn check(&self, call: &'static str, rc: sys::CUresult) -> Result<()> {
        if rc == sys::CUresult::CUDA_SUCCESS {
            return Ok(());
        }
        let mut log = log_text(&self.error[..]);
        let info = log_text(&self.info[..]);
        if !info.is_empty() {
            log = format!("{log}\n{info}");
        }
        Err(Error::Link {
            call,
            code: DriverCode(rc),
            log,
        })
    }
}

impl Drop for LinkState {
    fn drop(&mut self) {
        // SAFETY: `raw` came from cuLinkCreate and is destroyed once, here; nothing borrows
        // from it any more (complete() copied the image out).
        let r = unsafe { sys::cuLinkDestroy(self.raw) }.result();
        crate::deferred::record(
            "LinkedModule: cuLinkDestroy",
            r.map_err(|e| Error::driver("cuLinkDestroy", e)),
        );
    }
}

/// The NUL-terminated text at the start of a log buffer, trimmed.
fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).trim().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_text_stops_at_the_nul() {
        let mut buf = [0u8; 16];
        buf[..7].copy_from_slice(b" error\n");
        buf[8] = b'x';
        assert_eq!(log_text(&buf), "error");
        assert_eq!(log_text(b"no nul"), "no nul");
        assert_eq!(log_text(&[0u8; 4]), "");
    }

    #[test]
    fn nul_bytes_are_refused_before_the_driver() {
        assert!(matches!(
            c_string("a\0b", "kernel.ptx"),
            Err(Error::InvalidArgument(m)) if m.contains("kernel.ptx")
        ));
        assert!(c_string(".version 7.0", "x").is_ok());
    }

    #[test]
    fn carve_input_is_the_embedded_ptx() {
        let i = PtxInput::carve();
        let exported = |name: &str| {
            i.ptx
                .lines()
                .any(|l| l.starts_with(".visible .func") && l.contains(&format!(" {name}(")))
        };
        for name in [
            "carve_slab_alloc",
            "carve_slab_free",
            "carve_bump_alloc",
            "carve_numba_slab_alloc",
            "carve_numba_slab_free",
            "carve_numba_bump_alloc",
        ] {
            assert!(exported(name), "{name} is not a .visible .func");
        }
        assert!(!exported("carve_no_such_function"));
    }
}
