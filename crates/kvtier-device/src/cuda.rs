//! The cuda device: the engine's KV buffers in GPU memory, opened from the CUDA IPC handles
//! the engine exported (one per (layer, K|V) buffer), and copies to and from the host pool,
//! which is registered with the driver (page-locked) so copies are DMA.
//!
//! The driver library is loaded at run time (cudarc's `dynamic-loading`): nothing CUDA is
//! needed to build, and [`CudaDevice::open`] checks that `libcuda` is present before the first
//! driver call, so a machine without it gets [`DeviceError::Unavailable`], never a panic.
//! Every driver object is held by an RAII guard that releases it on drop.

use std::ffi::CStr;
use std::sync::Mutex;

use cudarc::driver::sys;
use kvtier_core::DevicePool;
use kvtier_shm::ShmPool;

use crate::{Device, DeviceError, PageCopy, check_copies};

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

fn error_name(r: sys::CUresult) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorString writes a pointer to a static, NUL-terminated string (or leaves
    // it null for an unknown code); it reads nothing else.
    let ok = unsafe { sys::cuGetErrorString(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
    if ok && !p.is_null() {
        // SAFETY: non-null pointers from cuGetErrorString point at static C strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        format!("{r:?}")
    }
}

fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Copy(format!("{what}: {}", error_name(r))))
    }
}

/// The device's primary context, retained while the device is open.
#[derive(Debug)]
struct Context {
    ctx: sys::CUcontext,
    dev: sys::CUdevice,
}

impl Context {
    fn make_current(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is a primary context retained by this guard and not yet released.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `CudaDevice::open`, exactly once.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// One engine buffer in device memory.
#[derive(Debug)]
struct Buffer {
    ptr: sys::CUdeviceptr,
    /// Opened from an IPC handle (closed on drop) rather than lent by the caller.
    ipc: bool,
}

impl Drop for Buffer {
    fn drop(&mut self) {
        if self.ipc {
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed exactly once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// A copy stream.
#[derive(Debug)]
struct Stream(sys::CUstream);

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by cuStreamCreate and is destroyed exactly once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}

/// A host mapping registered with the driver.
#[derive(Debug)]
struct Registered {
    base: usize,
    len: usize,
    ok: bool,
}

impl Drop for Registered {
    fn drop(&mut self) {
        if self.ok {
            // SAFETY: `base` was registered by cuMemHostRegister and is unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.base as *mut std::ffi::c_void) };
        }
    }
}

/// An engine pool in GPU memory. Field order is drop order: registrations, streams and
/// buffers go before the context they belong to.
#[derive(Debug)]
pub struct CudaDevice {
    pool: DevicePool,
    registered: Mutex<Vec<Registered>>,
    to_host: Mutex<Stream>,
    from_host: Mutex<Stream>,
    buffers: Vec<Buffer>,
    ctx: Context,
}

// SAFETY: the raw handles inside (context, streams, device pointers) are driver objects that
// may be used from any thread once the context is made current, which every method does
// first; each stream is used under its own mutex.
unsafe impl Send for CudaDevice {}
// SAFETY: as above: `&self` methods serialise per stream and make the context current.
unsafe impl Sync for CudaDevice {}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library names; calls no driver function.
    unsafe { sys::is_culib_present() }
}

impl CudaDevice {
    fn init(ordinal: u32) -> Result<Context, DeviceError> {
        if !driver_present() {
            return Err(DeviceError::Unavailable(
                "the CUDA driver library (libcuda.so.1) is not installed on this machine; use \
                 the cpu device, or install the NVIDIA driver"
                    .into(),
            ));
        }
        let unavailable = |e: DeviceError| DeviceError::Unavailable(e.to_string());
        // SAFETY: the library is present (checked above); cuInit takes flags 0.
        check(unsafe { sys::cuInit(0) }, "cuInit").map_err(unavailable)?;
        let mut count = 0;
        // SAFETY: writes the device count into `count`.
        let r = unsafe { sys::cuDeviceGetCount(&mut count) };
        check(r, "cuDeviceGetCount").map_err(unavailable)?;
        if ordinal as i32 >= count {
            return Err(DeviceError::Unavailable(format!(
                "GPU {ordinal} asked for, {count} present"
            )));
        }
        let mut dev = 0;
        // SAFETY: `ordinal` is below the device count; writes the handle into `dev`.
        let r = unsafe { sys::cuDeviceGet(&mut dev, ordinal as i32) };
        check(r, "cuDeviceGet")?;
        let mut ctx = std::ptr::null_mut();
        // SAFETY: `dev` is a valid device; writes the retained primary context into `ctx`.
        let r = unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) };
        check(r, "cuDevicePrimaryCtxRetain")?;
        let ctx = Context { ctx, dev };
        ctx.make_current()?;
        Ok(ctx)
    }

    fn with_buffers(
        pool: DevicePool,
        ctx: Context,
        buffers: Vec<Buffer>,
    ) -> Result<Self, DeviceError> {
        let stream = || -> Result<Stream, DeviceError> {
            let mut s = std::ptr::null_mut();
            let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
            // SAFETY: the context is current; writes a new stream handle into `s`.
            let r = unsafe { sys::cuStreamCreate(&mut s, flags) };
            check(r, "cuStreamCreate")?;
            Ok(Stream(s))
        };
        Ok(Self {
            pool,
            registered: Mutex::new(Vec::new()),
            to_host: Mutex::new(stream()?),
            from_host: Mutex::new(stream()?),
            buffers,
            ctx,
        })
    }

    /// Opens the engine's buffers on GPU `ordinal` from their CUDA IPC handles, one per
    /// (layer, part) in the order of [`DevicePool::run`]'s `buffer` index.
    pub fn open(
        pool: DevicePool,
        ordinal: u32,
        handles: &[[u8; IPC_HANDLE_BYTES]],
    ) -> Result<Self, DeviceError> {
        if handles.len() != pool.num_buffers() {
            return Err(DeviceError::Invalid {
                field: "ipc_handles".into(),
                reason: format!(
                    "{} handles for a layout of {} buffers",
                    handles.len(),
                    pool.num_buffers()
                ),
            });
        }
        let ctx = Self::init(ordinal)?;
        let mut buffers = Vec::with_capacity(handles.len());
        for (i, h) in handles.iter().enumerate() {
            let mut handle = sys::CUipcMemHandle {
                reserved: [0; IPC_HANDLE_BYTES],
            };
            for (d, s) in handle.reserved.iter_mut().zip(h) {
                *d = *s as std::ffi::c_char;
            }
            let mut ptr = 0;
            let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
            // SAFETY: the context is current; `handle` is a plain 64-byte value; writes the
            // mapped device address into `ptr`.
            let r = unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) };
            check(r, &format!("cuIpcOpenMemHandle (ipc_handles[{i}])"))?;
            buffers.push(Buffer { ptr, ipc: true });
        }
        Self::with_buffers(pool, ctx, buffers)
    }

    /// Uses buffers already in this process's address space (an engine embedding the agent,
    /// or tests): `ptrs[i]` is buffer `i`, at least `pool.buffer_bytes()` long, and must
    /// outlive the device.
    pub fn from_device_ptrs(
        pool: DevicePool,
        ordinal: u32,
        ptrs: &[u64],
    ) -> Result<Self, DeviceError> {
        if ptrs.len() != pool.num_buffers() {
            return Err(DeviceError::Invalid {
                field: "buffers".into(),
                reason: format!(
                    "{} buffers for a layout of {}",
                    ptrs.len(),
                    pool.num_buffers()
                ),
            });
        }
        let ctx = Self::init(ordinal)?;
        let buffers = ptrs.iter().map(|&ptr| Buffer { ptr, ipc: false }).collect();
        Self::with_buffers(pool, ctx, buffers)
    }

    /// Registers the host pool with the driver once (page-locked, so copies are DMA). When
    /// registration is refused (memlock limits), copies still work, staged by the driver.
    fn register(&self, host: &ShmPool) -> Result<(), DeviceError> {
        let base = host
            .slot_ptr(0)
            .map_err(|e| DeviceError::Copy(e.to_string()))?;
        let (base, len) = (base.as_ptr() as usize, host.len());
        let mut reg = match self.registered.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if reg.iter().any(|r| r.base == base && r.len == len) {
            return Ok(());
        }
        let ptr = base as *mut std::ffi::c_void;
        // SAFETY: [base, base + len) is the live host mapping (ShmPool keeps it mapped while
        // it lives; the agent keeps the pool alive longer than the device uses it).
        let r = unsafe { sys::cuMemHostRegister_v2(ptr, len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
        reg.push(Registered {
            base,
            len,
            ok: r == sys::CUresult::CUDA_SUCCESS,
        });
        Ok(())
    }

    fn copy(&self, host: &ShmPool, copies: &[PageCopy], to_host: bool) -> Result<(), DeviceError> {
        check_copies(&self.pool, host, copies)?;
        self.ctx.make_current()?;
        self.register(host)?;
        let layout = self.pool.layout();
        let stream = if to_host {
            &self.to_host
        } else {
            &self.from_host
        };
        let stream = match stream.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for c in copies {
            let slot = host
                .slot_ptr(c.host_slot)
                .map_err(|e| DeviceError::Copy(e.to_string()))?;
            for (layer, part) in layout.runs() {
                let run = self
                    .pool
                    .run(c.device_page as usize, layer, part)
                    .map_err(|e| DeviceError::Copy(e.to_string()))?;
                let dev = self.buffers[run.buffer].ptr + run.offset as u64;
                // SAFETY: `host_run_offset + run.len <= page_bytes <= stride` (check_copies),
                // so the host range lies in slot `c.host_slot` of the live mapping; the device
                // range lies in buffer `run.buffer` (DevicePool::run), opened or lent for the
                // device's life. The stream is synchronised below before returning, so the
                // host memory outlives the copy.
                let hst = unsafe { slot.as_ptr().add(layout.host_run_offset(layer, part)) };
                let r = if to_host {
                    // SAFETY: as above.
                    unsafe { sys::cuMemcpyDtoHAsync_v2(hst.cast(), dev, run.len, stream.0) }
                } else {
                    // SAFETY: as above.
                    unsafe {
                        sys::cuMemcpyHtoDAsync_v2(dev, hst.cast_const().cast(), run.len, stream.0)
                    }
                };
                check(
                    r,
                    if to_host {
                        "cuMemcpyDtoHAsync"
                    } else {
                        "cuMemcpyHtoDAsync"
                    },
                )?;
            }
        }
        // SAFETY: waits for the copies issued above on this stream.
        check(
            unsafe { sys::cuStreamSynchronize(stream.0) },
            "cuStreamSynchronize",
        )
    }
}

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
        let ctx = CudaDevice::init(ordinal)?;
        let mut ptr = 0;
        // SAFETY: the context is current; writes the new allocation's address into `ptr`.
        let r = unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) };
        check(r, "cuMemAlloc")?;
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: the context is current; writes a new stream handle into `s`.
        let r = unsafe { sys::cuStreamCreate(&mut s, flags) };
        if let Err(e) = check(r, "cuStreamCreate") {
            // SAFETY: frees the allocation made above, once.
            let _ = unsafe { sys::cuMemFree_v2(ptr) };
            return Err(e);
        }
        Ok(Self {
            ptr,
            bytes,
            stream: Stream(s),
            ctx,
        })
    }

    /// The device address, for [`CudaDevice::from_device_ptrs`].
    pub fn ptr(&self) -> u64 {
        self.ptr
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
        self.check_len(src.len())?;
        self.ctx.make_current()?;
        // SAFETY: `src` is a live host slice of `src.len() <= bytes` bytes and the device
        // range lies in this allocation; the stream is synchronised before returning.
        let r = unsafe {
            sys::cuMemcpyHtoDAsync_v2(self.ptr, src.as_ptr().cast(), src.len(), self.stream.0)
        };
        check(r, "cuMemcpyHtoDAsync")?;
        self.sync()
    }

    /// Copies the start of the buffer into `dst` and waits.
    pub fn read(&mut self, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check_len(dst.len())?;
        self.ctx.make_current()?;
        // SAFETY: as in `write`, the other way.
        let r = unsafe {
            sys::cuMemcpyDtoHAsync_v2(dst.as_mut_ptr().cast(), self.ptr, dst.len(), self.stream.0)
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
        if n > self.bytes {
            return Err(DeviceError::Invalid {
                field: "length".into(),
                reason: format!("{n} bytes for a buffer of {}", self.bytes),
            });
        }
        Ok(())
    }

    fn sync(&self) -> Result<(), DeviceError> {
        // SAFETY: waits for the work issued on this buffer's own stream.
        check(
            unsafe { sys::cuStreamSynchronize(self.stream.0) },
            "cuStreamSynchronize",
        )
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

impl Device for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn pool(&self) -> &DevicePool {
        &self.pool
    }

    fn copy_to_host(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<(), DeviceError> {
        self.copy(host, copies, true)
    }

    fn copy_from_host(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<(), DeviceError> {
        self.copy(host, copies, false)
    }
}
