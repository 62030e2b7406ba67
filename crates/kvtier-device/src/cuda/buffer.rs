//! Memory this process allocates on the GPU: [`DeviceBuffer`] (the engine's buffers in tests
//! and benchmarks, and the baseline of `kvtier-bench gpu`) and the self-check's [`Scratch`]
//! pair (device memory plus pinned, device-mapped host memory).

use cudarc::driver::sys;
use kvtier_shm::ShmPool;

use super::driver::{Context, Stream, check};
use crate::DeviceError;
use crate::method::{SCRATCH_BYTES, Scratch};

/// Device memory this process allocated: the engine's buffers in tests and benchmarks, and
/// the baseline of `kvtier-bench gpu`. It retains GPU `ordinal`'s primary context for as long
/// as it lives, so the memory stays valid whatever devices are opened and dropped meanwhile.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    bytes: usize,
    stream: Stream,
    ctx: Context,
}

// SAFETY: a device pointer and a stream of a retained context, used only after making that
// context current; the stream is used by `&mut self` methods or under the caller's order.
unsafe impl Send for DeviceBuffer {}
// SAFETY: `&self` methods only read the pointer value.
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
    /// Allocates `bytes` of device memory on GPU `ordinal`.
    pub fn new(ordinal: u32, bytes: usize) -> Result<Self, DeviceError> {
        let ctx = Context::retain(ordinal)?;
        let mut ptr = 0;
        // SAFETY: the context is current; writes the new allocation's address into `ptr`.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        check(r, "cuMemAlloc")?;
        let stream = match Stream::new() {
            Ok(s) => s,
            Err(e) => {
                // SAFETY: frees the allocation made above, once.
                let _ = unsafe { sys::cuMemFree_v2(ptr) };
                return Err(e);
            }
        };
        Ok(Self {
            ptr,
            bytes,
            stream,
            ctx,
        })
    }

    /// The device address, for [`super::CudaDevice::from_device_ptrs`].
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// A CUDA IPC handle of the allocation, for another process to open (tests stand in for
    /// an exporting engine with it).
    pub fn ipc_handle(&self) -> Result<[u8; super::IPC_HANDLE_BYTES], DeviceError> {
        self.ctx.make_current()?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; super::IPC_HANDLE_BYTES],
        };
        check(
            // SAFETY: `ptr` is this allocation; writes the handle into `h`.
            unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) },
            "cuIpcGetMemHandle",
        )?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// Copies `src` to the start of the buffer and waits.
    pub fn write(&mut self, src: &[u8]) -> Result<(), DeviceError> {
        self.write_at(0, src)
    }

    /// Copies `src` to byte `offset` of the buffer and waits.
    pub fn write_at(&mut self, offset: usize, src: &[u8]) -> Result<(), DeviceError> {
        self.check_range(offset, src.len())?;
        self.ctx.make_current()?;
        // SAFETY: `src` is a live host slice and [offset, offset + len) lies in this
        // allocation (checked above); the stream is synchronised before returning.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.ptr + offset as u64,
                src.as_ptr().cast(),
                src.len(),
                self.stream.0,
            )
        };
        check(r, "cuMemcpyHtoDAsync")?;
        self.sync()
    }

    /// Copies the start of the buffer into `dst` and waits.
    pub fn read(&mut self, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.read_at(0, dst)
    }

    /// Copies bytes from `offset` of the buffer into `dst` and waits.
    pub fn read_at(&mut self, offset: usize, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check_range(offset, dst.len())?;
        self.ctx.make_current()?;
        // SAFETY: as in `write_at`, the other way.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst.as_mut_ptr().cast(),
                self.ptr + offset as u64,
                dst.len(),
                self.stream.0,
            )
        };
        check(r, "cuMemcpyDtoHAsync")?;
        self.sync()
    }

    /// One copy of `bytes` between the buffer's start and the host pool's first slot (which
    /// must hold them contiguously), and waits: what moving the same bytes costs without
    /// kvtier's page layout, the baseline of `kvtier-bench gpu`.
    pub fn copy_with_pool(
        &mut self,
        host: &ShmPool,
        bytes: usize,
        to_host: bool,
    ) -> Result<(), DeviceError> {
        self.check_len(bytes)?;
        if bytes > host.len() {
            return Err(DeviceError::Invalid {
                field: "bytes".into(),
                reason: format!("{bytes} bytes exceed the host pool's {}", host.len()),
            });
        }
        self.ctx.make_current()?;
        let base = host
            .slot_ptr(0)
            .map_err(|e| DeviceError::Copy(e.to_string()))?;
        let r = if to_host {
            // SAFETY: [base, base + bytes) lies in the live host mapping (checked above), the
            // device range in this allocation; synchronised before returning.
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(base.as_ptr().cast(), self.ptr, bytes, self.stream.0)
            }
        } else {
            // SAFETY: as above.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    self.ptr,
                    base.as_ptr().cast_const().cast(),
                    bytes,
                    self.stream.0,
                )
            }
        };
        check(r, "cuMemcpyAsync (baseline)")?;
        self.sync()
    }

    fn check_len(&self, n: usize) -> Result<(), DeviceError> {
        self.check_range(0, n)
    }

    fn check_range(&self, offset: usize, n: usize) -> Result<(), DeviceError> {
        if offset.checked_add(n).is_none_or(|end| end > self.bytes) {
            return Err(DeviceError::Invalid {
                field: "length".into(),
                reason: format!("{n} bytes at {offset} for a buffer of {}", self.bytes),
            });
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), DeviceError> {
        self.stream.sync()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.make_current().is_ok() {
            // SAFETY: waits for this buffer's stream, then frees the allocation once; the
            // stream and then the context are released by their own guards afterwards.
            let _ = unsafe { sys::cuStreamSynchronize(self.stream.0) };
            // SAFETY: as above.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// The self-check's buffers: [`SCRATCH_BYTES`] of device memory and as much pinned host
/// memory mapped into the device (as the host pool is once registered).
#[derive(Debug)]
pub(super) struct CudaScratch {
    device: sys::CUdeviceptr,
    host: *mut u8,
}

impl CudaScratch {
    /// Allocates both; the caller made the context current.
    pub(super) fn new() -> Result<Self, DeviceError> {
        let mut device = 0;
        check(
            // SAFETY: writes the new allocation's address into `device`.
            unsafe { sys::cuMemAlloc_v2(&mut device, SCRATCH_BYTES) },
            "cuMemAlloc (self-check)",
        )?;
        let mut host = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: writes the new pinned allocation's address into `host`.
        let r = unsafe { sys::cuMemHostAlloc(&mut host, SCRATCH_BYTES, flags) };
        if let Err(e) = check(r, "cuMemHostAlloc (self-check)") {
            // SAFETY: frees the device allocation made above, once.
            let _ = unsafe { sys::cuMemFree_v2(device) };
            return Err(e);
        }
        Ok(Self {
            device,
            host: host.cast(),
        })
    }
}

impl Drop for CudaScratch {
    fn drop(&mut self) {
        // SAFETY: both were allocated in `new` and are freed once; every copy into them was
        // synchronised by the mover that issued it.
        unsafe {
            let _ = sys::cuMemFree_v2(self.device);
            let _ = sys::cuMemFreeHost(self.host.cast());
        }
    }
}

impl Scratch for CudaScratch {
    fn bytes(&self) -> usize {
        SCRATCH_BYTES
    }

    fn device_base(&self) -> u64 {
        self.device
    }

    fn host_base(&self) -> u64 {
        self.host as u64
    }

    fn write_device(&self, bytes: &[u8]) -> Result<(), DeviceError> {
        let n = bytes.len().min(SCRATCH_BYTES);
        check(
            // SAFETY: a synchronous copy of `n` bytes into this allocation of SCRATCH_BYTES.
            unsafe { sys::cuMemcpyHtoD_v2(self.device, bytes.as_ptr().cast(), n) },
            "cuMemcpyHtoD (self-check)",
        )
    }

    fn read_device(&self, out: &mut [u8]) -> Result<(), DeviceError> {
        let n = out.len().min(SCRATCH_BYTES);
        check(
            // SAFETY: a synchronous copy of `n` bytes out of this allocation.
            unsafe { sys::cuMemcpyDtoH_v2(out.as_mut_ptr().cast(), self.device, n) },
            "cuMemcpyDtoH (self-check)",
        )
    }

    fn write_host(&self, bytes: &[u8]) {
        let n = bytes.len().min(SCRATCH_BYTES);
        // SAFETY: `host` is a live allocation of SCRATCH_BYTES; no copy into it is in flight
        // (every mover synchronises before returning).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.host, n) }
    }

    fn read_host(&self, out: &mut [u8]) {
        let n = out.len().min(SCRATCH_BYTES);
        // SAFETY: as in `write_host`.
        unsafe { std::ptr::copy_nonoverlapping(self.host, out.as_mut_ptr(), n) }
    }
}
