//! The driver API glue every cuda part shares: error text, the retained primary context,
//! streams, and the driver's version. Every driver object is held by an RAII guard that
//! releases it on drop.

use std::ffi::CStr;

use cudarc::driver::sys;

use crate::DeviceError;

pub(super) fn error_name(r: sys::CUresult) -> String {
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

pub(super) fn check(r: sys::CUresult, what: &str) -> Result<(), DeviceError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(DeviceError::Copy(format!("{what}: {}", error_name(r))))
    }
}

/// Whether the CUDA driver library can be loaded on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library names; calls no driver function.
    unsafe { sys::is_culib_present() }
}

/// A device's primary context, retained while this guard lives.
#[derive(Debug)]
pub(super) struct Context {
    ctx: sys::CUcontext,
    pub(super) dev: sys::CUdevice,
}

// SAFETY: a retained primary context may be made current on any thread.
unsafe impl Send for Context {}
// SAFETY: as above; `&self` methods only make it current.
unsafe impl Sync for Context {}

impl Context {
    /// Loads the driver and retains GPU `ordinal`'s primary context, current on this thread.
    pub(super) fn retain(ordinal: u32) -> Result<Self, DeviceError> {
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

    pub(super) fn make_current(&self) -> Result<(), DeviceError> {
        // SAFETY: `ctx` is a primary context retained by this guard and not yet released.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }

    /// An integer attribute of the device.
    pub(super) fn attribute(&self, a: sys::CUdevice_attribute) -> Result<i32, DeviceError> {
        let mut v = 0;
        check(
            // SAFETY: `dev` is a valid device; writes the attribute into `v`.
            unsafe { sys::cuDeviceGetAttribute(&mut v, a, self.dev) },
            "cuDeviceGetAttribute",
        )?;
        Ok(v)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the retain taken in `retain`, exactly once.
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

/// The driver's CUDA version, e.g. 12040 for 12.4.
pub(super) fn driver_version() -> Result<i32, DeviceError> {
    let mut v = 0;
    check(
        // SAFETY: writes the version into `v`; needs no context.
        unsafe { sys::cuDriverGetVersion(&mut v) },
        "cuDriverGetVersion",
    )?;
    Ok(v)
}

/// `12040` as `12.4`.
pub(super) fn version_text(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// A copy stream of the current context.
#[derive(Debug)]
pub(super) struct Stream(pub(super) sys::CUstream);

// SAFETY: a stream handle may be used from any thread with its context current; users hold
// it under a mutex.
unsafe impl Send for Stream {}

impl Stream {
    pub(super) fn new() -> Result<Self, DeviceError> {
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        check(
            // SAFETY: the caller made the context current; writes a new stream handle into `s`.
            unsafe { sys::cuStreamCreate(&mut s, flags) },
            "cuStreamCreate",
        )?;
        Ok(Self(s))
    }

    /// Waits for everything issued on the stream.
    pub(super) fn sync(&self) -> Result<(), DeviceError> {
        check(
            // SAFETY: waits for the work issued on this stream.
            unsafe { sys::cuStreamSynchronize(self.0) },
            "cuStreamSynchronize",
        )
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: the stream was created by cuStreamCreate and is destroyed exactly once.
        let _ = unsafe { sys::cuStreamDestroy_v2(self.0) };
    }
}
