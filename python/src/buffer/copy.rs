//! Copies between host memory and a buffer's block: through the driver, on a stream and waited
//! for, when the block is device-accessible; a plain memory copy when only the host reaches it
//! (a host resource's buffer, which needs no GPU).

use carve::cudarc::driver::{result, sys, DriverError};
use carve::error::DriverCode;
use carve::{Device, Error, Result, StreamRef};

use super::block::Block;

fn driver(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Driver {
        call,
        code: DriverCode(e.0),
    }
}

fn check_len(block: &Block, len: usize) -> Result<()> {
    if len > block.size {
        return Err(Error::InvalidArgument(format!(
            "copy of {len} bytes into a {}-byte buffer",
            block.size
        )));
    }
    Ok(())
}

/// Copies `src` to the start of `block`, ordered on `stream`, and waits for the copy.
pub fn host_to_block(block: &Block, src: &[u8], stream: StreamRef<'_>) -> Result<()> {
    check_len(block, src.len())?;
    if !block.entry.resource.properties().device_accessible {
        // SAFETY: the block is host memory of at least `src.len()` bytes (checked), owned by
        // the buffer and distinct from `src`, which Python owns.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), block.ptr.as_ptr(), src.len());
        }
        return Ok(());
    }
    let raw = stream.driver_handle("cuMemcpyHtoDAsync")?;
    Device::get(block.device)?.bind()?;
    // SAFETY: the destination holds `src.len()` bytes (checked); the stream is valid for this
    // call; we wait for the copy before `src`'s borrow ends.
    unsafe {
        result::memcpy_htod_async(block.ptr.as_ptr() as sys::CUdeviceptr, src, raw)
            .map_err(driver("cuMemcpyHtoDAsync"))?;
        result::stream::synchronize(raw).map_err(driver("cuStreamSynchronize"))
    }
}

/// Copies the start of `block` into `dst`, ordered on `stream`, and waits for the copy.
pub fn block_to_host(block: &Block, dst: &mut [u8], stream: StreamRef<'_>) -> Result<()> {
    check_len(block, dst.len())?;
    if !block.entry.resource.properties().device_accessible {
        // SAFETY: as in `host_to_block`, the other way round.
        unsafe {
            std::ptr::copy_nonoverlapping(block.ptr.as_ptr(), dst.as_mut_ptr(), dst.len());
        }
        return Ok(());
    }
    let raw = stream.driver_handle("cuMemcpyDtoHAsync")?;
    Device::get(block.device)?.bind()?;
    // SAFETY: the source holds `dst.len()` bytes (checked); the stream is valid for this call;
    // we wait for the copy before `dst`'s borrow ends.
    unsafe {
        result::memcpy_dtoh_async(dst, block.ptr.as_ptr() as sys::CUdeviceptr, raw)
            .map_err(driver("cuMemcpyDtoHAsync"))?;
        result::stream::synchronize(raw).map_err(driver("cuStreamSynchronize"))
    }
}
