//! Device buffers that remember their resource, stream and device, and free through them.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{result, sys, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

use crate::driver::{Device, Stream};
use crate::error::{Error, Result};
use crate::resource::{check_device, MemoryResource, SharedResource, DEFAULT_ALIGNMENT};

mod foreign;

use crate::resource::{release_in_drop, release_once};
use foreign::ForeignUses;

/// Untyped device memory from a [`MemoryResource`], ordered on one stream.
///
/// Dropping it deallocates through the resource it came from, on its stream, whatever the
/// current resource or device is by then. Zero-length buffers allocate nothing.
pub struct DeviceBuffer {
    ptr: Option<NonNull<u8>>,
    len: usize,
    align: usize,
    stream: Stream,
    resource: SharedResource,
    /// cudarc work on other streams, which frees and own-stream work wait for.
    foreign: ForeignUses,
}

// SAFETY: the buffer uniquely owns its block; the pointer is an address, and all access goes
// through driver calls ordered on the stream.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&DeviceBuffer` only exposes reads of plain fields, stream-ordered driver copies and
// the foreign-use record, which a mutex guards.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `len` bytes from `resource`, ordered on `stream` (256-byte aligned).
    pub fn new(len: usize, stream: &Stream, resource: SharedResource) -> Result<Self> {
        Self::with_alignment(len, DEFAULT_ALIGNMENT, stream, resource)
    }

    /// As [`new`](Self::new), with an explicit alignment (a power of two).
    pub fn with_alignment(
        len: usize,
        align: usize,
        stream: &Stream,
        resource: SharedResource,
    ) -> Result<Self> {
        if !resource.properties().device_accessible {
            return Err(Error::InvalidArgument(format!(
                "{resource:?} does not give device-accessible memory"
            )));
        }
        if !align.is_power_of_two() {
            return Err(Error::InvalidAlignment(align));
        }
        check_device(&*resource, stream.device())?;
        stream.device().bind()?;
        let ptr = match len {
            0 => None,
            _ => Some(resource.allocate(stream.as_ref(), len, align)?),
        };
        Ok(DeviceBuffer {
            ptr,
            len,
            align,
            stream: stream.clone(),
            resource,
            foreign: ForeignUses::default(),
        })
    }

    /// Allocates from `device`'s current resource (see [`crate::current`]).
    pub fn from_current(len: usize, stream: &Stream) -> Result<Self> {
        let resource = crate::current::get(stream.device().ordinal())?;
        Self::new(len, stream, resource)
    }

    /// Allocates and copies `data` in.
    pub fn from_slice(data: &[u8], stream: &Stream, resource: SharedResource) -> Result<Self> {
        let mut buf = Self::new(data.len(), stream, resource)?;
        buf.copy_from_host(data)?;
        Ok(buf)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (0 for an empty buffer).
    pub fn as_ptr(&self) -> u64 {
        self.ptr.map_or(0, |p| p.as_ptr() as u64)
    }

    /// The stream its allocation and free are ordered on.
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The device it lives on.
    pub fn device(&self) -> &Device {
        self.stream.device()
    }

    /// The resource it frees through.
    pub fn resource(&self) -> &SharedResource {
        &self.resource
    }

    /// Copies `src` to the start of the buffer and waits for the copy.
    pub fn copy_from_host(&mut self, src: &[u8]) -> Result<()> {
        self.check_len(src.len())?;
        let Some(dst) = self.ptr else { return Ok(()) };
        self.foreign.settle(self.stream.cudarc())?;
        self.device().bind()?;
        // SAFETY: dst holds at least src.len() bytes (checked); the stream is live. We wait for
        // the copy before `src`'s borrow ends.
        unsafe {
            result::memcpy_htod_async(dst.as_ptr() as sys::CUdeviceptr, src, self.raw_stream())
        }
        .map_err(|e| Error::driver("cuMemcpyHtoDAsync", e))?;
        self.stream.synchronize()
    }

    /// Copies the start of the buffer into `dst` and waits for the copy.
    pub fn copy_to_host(&self, dst: &mut [u8]) -> Result<()> {
        self.check_len(dst.len())?;
        let Some(src) = self.ptr else { return Ok(()) };
        self.foreign.settle_writes(self.stream.cudarc())?;
        self.device().bind()?;
        // SAFETY: src holds at least dst.len() bytes; we wait before returning.
        unsafe {
            result::memcpy_dtoh_async(dst, src.as_ptr() as sys::CUdeviceptr, self.raw_stream())
        }
        .map_err(|e| Error::driver("cuMemcpyDtoHAsync", e))?;
        self.stream.synchronize()
    }

    /// The whole buffer, copied to a host `Vec`.
    pub fn to_host_vec(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.len];
        self.copy_to_host(&mut out)?;
        Ok(out)
    }

    /// Copies `src` to the start of this buffer, ordered on this buffer's stream after the work
    /// queued so far on `src`'s stream; `src`'s stream then waits for the copy, so either buffer
    /// may be used or freed on its own stream afterwards. Buffers on different devices are copied
    /// with `cuMemcpyPeerAsync` (no peer access needed), others with `cuMemcpyDtoDAsync`.
    pub fn copy_from_buffer(&mut self, src: &DeviceBuffer) -> Result<()> {
        self.check_len(src.len)?;
        let (Some(dst), Some(from)) = (self.ptr, src.ptr) else {
            return Ok(());
        };
        self.foreign.settle(self.stream.cudarc())?;
        src.foreign.settle_writes(src.stream.cudarc())?;
        self.stream.wait_for(&src.stream)?;
        self.device().bind()?;
        let (d, s) = (
            dst.as_ptr() as sys::CUdeviceptr,
            from.as_ptr() as sys::CUdeviceptr,
        );
        let (call, r) = if self.device() == src.device() {
            // SAFETY: both ranges hold `src.len` bytes (checked) and are live while borrowed;
            // the copy is ordered on this buffer's stream, after `src`'s stream.
            let r = unsafe { sys::cuMemcpyDtoDAsync_v2(d, s, src.len, self.raw_stream()) };
            ("cuMemcpyDtoDAsync", r)
        } else {
            let (dst_ctx, src_ctx) = (
                self.device().context().cu_ctx(),
                src.device().context().cu_ctx(),
            );
            // SAFETY: as above; both contexts are retained for the process's life.
            let r = unsafe {
                sys::cuMemcpyPeerAsync(d, dst_ctx, s, src_ctx, src.len, self.raw_stream())
            };
            ("cuMemcpyPeerAsync", r)
        };
        r.result().map_err(|e| Error::driver(call, e))?;
        src.stream.wait_for(&self.stream)
    }

    /// Sets every byte to `value`, ordered on the buffer's stream.
    pub fn memset(&mut self, value: u8) -> Result<()> {
        let Some(dst) = self.ptr else { return Ok(()) };
        self.foreign.settle(self.stream.cudarc())?;
        self.device().bind()?;
        // SAFETY: the range is this buffer's own.
        unsafe {
            result::memset_d8_async(
                dst.as_ptr() as sys::CUdeviceptr,
                value,
                self.len,
                self.raw_stream(),
            )
        }
        .map_err(|e| Error::driver("cuMemsetD8Async", e))
    }

    /// Frees now, reporting what dropping would have to swallow.
    ///
    /// The free is ordered after the buffer's stream and after cudarc work queued on other
    /// streams through [`DevicePtr`]/[`DevicePtrMut`]. If binding the device or that ordering
    /// fails, the block is not freed: dropping the buffer (which this does on return) tries
    /// once more, and leaks it if that fails too (see [`crate::take_deferred_error`]).
    pub fn free(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        let (stream, foreign) = (&self.stream, &mut self.foreign);
        let (resource, len, align) = (&self.resource, self.len, self.align);
        release_once(
            &mut self.ptr,
            || {
                stream.device().bind()?;
                foreign.settle(stream.cudarc())
            },
            // SAFETY: the block came from this resource with this size and alignment, and
            // `release_once` returns it once. The stream waits for every use of it (`settle`),
            // and later work on the stream is ordered after the free.
            |ptr| unsafe { resource.deallocate(stream.as_ref(), ptr, len, align) },
        )
    }

    fn raw_stream(&self) -> sys::CUstream {
        self.stream.as_ref().as_raw()
    }

    fn check_len(&self, n: usize) -> Result<()> {
        if n > self.len {
            return Err(Error::InvalidArgument(format!(
                "{n} bytes do not fit a {}-byte buffer",
                self.len
            )));
        }
        Ok(())
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Drop cannot report (callers who care use `free`): record it for `take_deferred_error`.
        release_in_drop("DeviceBuffer drop", || self.release());
    }
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.as_ptr()))
            .field("len", &self.len)
            .field("stream", &self.stream.as_ref())
            .field("resource", &self.resource)
            .finish()
    }
}

/// A typed device array of `T: Pod`, over a [`DeviceBuffer`].
pub struct DeviceVec<T: Pod> {
    buf: DeviceBuffer,
    len: usize,
    _marker: PhantomData<T>,
}

impl<T: Pod> DeviceVec<T> {
    /// `len` uninitialised-on-device elements (the device holds whatever was there).
    pub fn new(len: usize, stream: &Stream, resource: SharedResource) -> Result<Self> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or(Error::SizeOverflow {
            bytes: usize::MAX,
            align: align_of::<T>(),
        })?;
        let align = align_of::<T>().max(DEFAULT_ALIGNMENT);
        Ok(DeviceVec {
            buf: DeviceBuffer::with_alignment(bytes, align, stream, resource)?,
            len,
            _marker: PhantomData,
        })
    }

    /// `len` zeroed elements.
    pub fn zeroed(len: usize, stream: &Stream, resource: SharedResource) -> Result<Self> {
        let mut v = Self::new(len, stream, resource)?;
        v.buf.memset(0)?;
        Ok(v)
    }

    /// A copy of `data` on the device.
    pub fn from_slice(data: &[T], stream: &Stream, resource: SharedResource) -> Result<Self> {
        let mut v = Self::new(data.len(), stream, resource)?;
        v.buf.copy_from_host(bytemuck::cast_slice(data))?;
        Ok(v)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of element 0.
    pub fn as_ptr(&self) -> u64 {
        self.buf.as_ptr()
    }

    /// The untyped buffer.
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buf
    }

    /// Copies `src` (at most `len` elements) to the front, waiting for the copy.
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<()> {
        self.buf.copy_from_host(bytemuck::cast_slice(src))
    }

    /// The contents, copied to the host.
    pub fn to_vec(&self) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        self.buf.copy_to_host(bytemuck::cast_slice_mut(&mut out))?;
        Ok(out)
    }

    /// Frees now, reporting errors.
    pub fn free(self) -> Result<()> {
        self.buf.free()
    }
}

impl<T: Pod> fmt::Debug for DeviceVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceVec")
            .field("len", &self.len)
            .field("buf", &self.buf)
            .finish()
    }
}

// cudarc interop: a `DeviceVec` can be passed wherever cudarc takes a device slice.
impl<T: Pod> DeviceSlice<T> for DeviceVec<T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.buf.stream.cudarc()
    }
}

impl<T: Pod> DevicePtr<T> for DeviceVec<T> {
    /// `stream` waits for the buffer's own stream and for earlier writes on other streams; when
    /// the returned guard drops, an event recorded on `stream` orders the free (and later work
    /// on the buffer's own stream) after the read. On the buffer's own stream nothing is
    /// recorded.
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let guard = self.buf.foreign.read(self.buf.stream.cudarc(), stream);
        (self.as_ptr(), guard)
    }
}

impl<T: Pod> DevicePtrMut<T> for DeviceVec<T> {
    /// As [`device_ptr`](DevicePtr::device_ptr), with `stream` also waiting for earlier reads.
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        let ptr = self.as_ptr();
        let buf = &mut self.buf;
        (ptr, buf.foreign.write(buf.stream.cudarc(), stream))
    }
}

impl crate::resource::ManagedRange {
    /// The whole of a buffer, which must come from a managed resource.
    pub fn of_buffer(buffer: &DeviceBuffer) -> Result<Self> {
        Self::new(buffer.as_ptr(), buffer.len())
    }
}
