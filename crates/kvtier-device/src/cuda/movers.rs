//! The cuda device's three copy methods over one pair of streams ([`Lanes`]): one
//! `cuMemcpyAsync` per run, `cuMemcpyBatchAsync` per batch, and the gather/scatter kernel
//! in `copy.ptx`. Each copy waits for its stream before returning. [`offered`] sets up every
//! method this driver can run, or says why it cannot; `method::select` then self-checks them.

use parking_lot::{Mutex, MutexGuard};
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;
use kvtier_core::copy_method::Method;

use super::driver::{Context, Stream, check, driver_version, version_text};
use crate::DeviceError;
use crate::method::{Direction, Mover, Offered};
use crate::plan::Run;

/// Runs per driver call: batches are split here (the driver allocates per-call state in
/// proportion to the count).
pub(super) const MAX_BATCH: usize = 4096;

/// One stream per direction, so a backup and a load overlap. Field order is drop order: the
/// streams go before the context they belong to.
#[derive(Debug)]
pub(super) struct Lanes {
    to_host: Mutex<Stream>,
    from_host: Mutex<Stream>,
    pub(super) ctx: Arc<Context>,
}

impl Lanes {
    pub(super) fn new(ctx: Arc<Context>) -> Result<Self, DeviceError> {
        ctx.make_current()?;
        Ok(Self {
            to_host: Mutex::new(Stream::new()?),
            from_host: Mutex::new(Stream::new()?),
            ctx,
        })
    }

    /// The direction's stream, locked, with the context current on this thread.
    fn lane(&self, dir: Direction) -> Result<MutexGuard<'_, Stream>, DeviceError> {
        self.ctx.make_current()?;
        Ok(match dir {
            Direction::ToHost => self.to_host.lock(),
            Direction::FromHost => self.from_host.lock(),
        })
    }
}

fn ends(r: &Run, dir: Direction) -> (u64, u64) {
    match dir {
        Direction::ToHost => (r.device, r.host),
        Direction::FromHost => (r.host, r.device),
    }
}

/// One `cuMemcpyAsync` per run: every driver has it.
#[derive(Debug)]
struct PerRun {
    lanes: Arc<Lanes>,
}

impl Mover for PerRun {
    fn method(&self) -> Method {
        Method::PerRun
    }

    fn copy(&self, runs: &[Run], dir: Direction) -> Result<(), DeviceError> {
        let stream = self.lanes.lane(dir)?;
        for r in runs {
            let (src, dst) = ends(r, dir);
            // SAFETY: the caller's runs lie inside the device's memory and the registered host
            // pool (or the self-check's scratch), both alive until this returns; the stream
            // is synchronised below, so no copy outlives the call.
            let res = unsafe { sys::cuMemcpyAsync(dst, src, r.len as usize, stream.0) };
            if let Err(e) = check(res, "cuMemcpyAsync") {
                // The runs queued before this one still move: wait for them, so that no
                // copy outlives the call (a fence's settling close counts on it).
                let _ = stream.sync();
                return Err(e);
            }
        }
        stream.sync()
    }
}

/// `CUmemcpyAttributes` of CUDA 12.8 and 13: how the driver may read the sources.
#[repr(C)]
struct Attributes {
    src_access_order: u32,
    src_loc_hint: [i32; 2],
    dst_loc_hint: [i32; 2],
    flags: u32,
}

/// `CU_MEMCPY_SRC_ACCESS_ORDER_STREAM`: sources are read in stream order.
const SRC_ACCESS_ORDER_STREAM: u32 = 1;

type Batch12 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    *mut usize,
    sys::CUstream,
) -> sys::CUresult;
type Batch13 = unsafe extern "C" fn(
    *mut sys::CUdeviceptr,
    *mut sys::CUdeviceptr,
    *mut usize,
    usize,
    *mut Attributes,
    *mut usize,
    usize,
    sys::CUstream,
) -> sys::CUresult;

/// The two ABIs of `cuMemcpyBatchAsync`: 12.8 reports the failing index, 13.0 dropped it.
#[derive(Clone, Copy, Debug)]
enum BatchFn {
    V12(Batch12),
    V13(Batch13),
}

/// `cuMemcpyBatchAsync`: one driver call per batch of up to [`MAX_BATCH`] runs.
#[derive(Debug)]
struct Batch {
    lanes: Arc<Lanes>,
    f: BatchFn,
}

impl Batch {
    /// Finds the function for the running driver's ABI through `cuGetProcAddress`, which
    /// hands out the signature of the version asked for.
    fn load(lanes: Arc<Lanes>) -> Result<Self, String> {
        let v = driver_version().map_err(|e| e.to_string())?;
        if v < 12080 {
            return Err(format!(
                "the driver is CUDA {}; cuMemcpyBatchAsync needs 12.8",
                version_text(v)
            ));
        }
        let ask = if v >= 13000 { 13000 } else { 12080 };
        let mut pfn: *mut c_void = std::ptr::null_mut();
        let mut status = sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS;
        // SAFETY: the symbol is a NUL-terminated literal; the driver writes a function
        // pointer (or null) into `pfn` and the query result into `status`.
        let r = unsafe {
            sys::cuGetProcAddress_v2(
                c"cuMemcpyBatchAsync".as_ptr(),
                &mut pfn,
                ask,
                0,
                &mut status,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS
            || pfn.is_null()
            || status != sys::CUdriverProcAddressQueryResult::CU_GET_PROC_ADDRESS_SUCCESS
        {
            return Err(format!(
                "cuMemcpyBatchAsync not found in driver {} ({r:?}, {status:?})",
                version_text(v)
            ));
        }
        let f = if ask >= 13000 {
            // SAFETY: asked for the 13.0 ABI, whose signature is `Batch13`.
            BatchFn::V13(unsafe { std::mem::transmute::<*mut c_void, Batch13>(pfn) })
        } else {
            // SAFETY: asked for the 12.8 ABI, whose signature is `Batch12`.
            BatchFn::V12(unsafe { std::mem::transmute::<*mut c_void, Batch12>(pfn) })
        };
        Ok(Self { lanes, f })
    }
}

impl Mover for Batch {
    fn method(&self) -> Method {
        Method::Batch
    }

    fn copy(&self, runs: &[Run], dir: Direction) -> Result<(), DeviceError> {
        let stream = self.lanes.lane(dir)?;
        let mut attrs = Attributes {
            src_access_order: SRC_ACCESS_ORDER_STREAM,
            src_loc_hint: [0; 2],
            dst_loc_hint: [0; 2],
            flags: 0,
        };
        for batch in runs.chunks(MAX_BATCH) {
            let (mut srcs, mut dsts): (Vec<u64>, Vec<u64>) =
                batch.iter().map(|r| ends(r, dir)).unzip();
            let mut sizes: Vec<usize> = batch.iter().map(|r| r.len as usize).collect();
            let mut attr_index = 0usize;
            let mut fail = usize::MAX;
            let n = batch.len();
            // SAFETY: the three arrays hold `n` entries each and one attribute applies from
            // index 0; all live until the stream is synchronised below. The runs lie in the
            // device's memory and registered host memory (as for `PerRun`).
            let r = unsafe {
                match self.f {
                    BatchFn::V12(f) => f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        n,
                        &mut attrs,
                        &mut attr_index,
                        1,
                        &mut fail,
                        stream.0,
                    ),
                    BatchFn::V13(f) => f(
                        dsts.as_mut_ptr(),
                        srcs.as_mut_ptr(),
                        sizes.as_mut_ptr(),
                        n,
                        &mut attrs,
                        &mut attr_index,
                        1,
                        stream.0,
                    ),
                }
            };
            if r != sys::CUresult::CUDA_SUCCESS {
                // Whatever was issued must finish before the arrays go away.
                let _ = stream.sync();
                let at = if fail == usize::MAX {
                    String::new()
                } else {
                    format!(" at run {fail}")
                };
                check(r, &format!("cuMemcpyBatchAsync{at}"))?;
            }
            stream.sync()?;
        }
        Ok(())
    }
}

/// The PTX of the gather/scatter kernel (NUL-terminated for `cuModuleLoadData`).
const COPY_PTX: &str = concat!(include_str!("copy.ptx"), "\0");

/// A loaded module, unloaded on drop.
#[derive(Debug)]
struct Module(sys::CUmodule);

// SAFETY: a module handle may be used from any thread with its context current.
unsafe impl Send for Module {}
// SAFETY: only read (to launch) after loading.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded by cuModuleLoadData, unloaded once.
        let _ = unsafe { sys::cuModuleUnload(self.0) };
    }
}

/// Device memory holding a batch's descriptors, grown as needed.
#[derive(Debug, Default)]
struct Descriptors {
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        if self.ptr != 0 {
            // SAFETY: allocated by cuMemAlloc, freed once.
            let _ = unsafe { sys::cuMemFree_v2(self.ptr) };
        }
    }
}

/// The gather/scatter kernel: one launch per batch, reading and writing host memory mapped
/// into the device. Field order is drop order: memory and module before the lanes' context.
#[derive(Debug)]
struct Kernel {
    descriptors: [Mutex<Descriptors>; 2],
    function: sys::CUfunction,
    _module: Module,
    lanes: Arc<Lanes>,
}

// SAFETY: the function handle belongs to the module held alongside; launches run with the
// context current and each direction's descriptor memory under its own mutex.
unsafe impl Send for Kernel {}
// SAFETY: as above.
unsafe impl Sync for Kernel {}

const THREADS: u32 = 256;
const MAX_BLOCKS: u32 = 1024;

impl Kernel {
    fn load(lanes: Arc<Lanes>) -> Result<Self, String> {
        let ctx = &lanes.ctx;
        let host_ptrs = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM,
            )
            .map_err(|e| e.to_string())?;
        if host_ptrs == 0 {
            return Err(
                "this GPU cannot use host pointers of registered memory; the kernel needs them"
                    .into(),
            );
        }
        ctx.make_current().map_err(|e| e.to_string())?;
        let mut module = std::ptr::null_mut();
        // SAFETY: COPY_PTX is NUL-terminated PTX text; writes the module into `module`.
        let r = unsafe { sys::cuModuleLoadData(&mut module, COPY_PTX.as_ptr().cast()) };
        check(r, "cuModuleLoadData (copy.ptx)").map_err(|e| e.to_string())?;
        let module = Module(module);
        let mut function = std::ptr::null_mut();
        // SAFETY: the module is loaded; the name is NUL-terminated.
        let r =
            unsafe { sys::cuModuleGetFunction(&mut function, module.0, c"kvtier_copy".as_ptr()) };
        check(r, "cuModuleGetFunction (kvtier_copy)").map_err(|e| e.to_string())?;
        Ok(Self {
            descriptors: Default::default(),
            function,
            _module: module,
            lanes,
        })
    }
}

impl Mover for Kernel {
    fn method(&self) -> Method {
        Method::Kernel
    }

    fn copy(&self, runs: &[Run], dir: Direction) -> Result<(), DeviceError> {
        if runs.is_empty() {
            return Ok(());
        }
        let stream = self.lanes.lane(dir)?;
        let mut desc = self.descriptors[dir as usize].lock();
        for batch in runs.chunks(MAX_BATCH) {
            let table: Vec<u64> = batch
                .iter()
                .flat_map(|r| {
                    let (s, d) = ends(r, dir);
                    [s, d, r.len]
                })
                .collect();
            let bytes = table.len() * 8;
            if desc.bytes < bytes {
                let mut ptr = 0;
                // SAFETY: the context is current; writes the allocation into `ptr`.
                check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }, "cuMemAlloc")?;
                *desc = Descriptors { ptr, bytes };
            }
            check(
                // SAFETY: `table` is `bytes` long and the allocation at least that. Issued on
                // the lane's stream, so the launch below reads the descriptors after they
                // land (a synchronous copy from pageable memory may return before its DMA
                // does, and the lanes are non-blocking streams); `table` lives until the
                // stream is synchronised at the end of this iteration.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(desc.ptr, table.as_ptr().cast(), bytes, stream.0)
                },
                "cuMemcpyHtoDAsync (descriptors)",
            )?;
            let mut runs_ptr = desc.ptr;
            let mut count = batch.len() as u64;
            let mut params = [
                (&mut runs_ptr as *mut u64).cast::<c_void>(),
                (&mut count as *mut u64).cast::<c_void>(),
            ];
            let blocks = (batch.len() as u32).min(MAX_BLOCKS);
            // SAFETY: `function` takes (u64 runs, u64 count), the two parameters passed; the
            // descriptors are in device memory and every run lies in the device's memory or
            // host memory registered with DEVICEMAP. Synchronised below, before `desc` can be
            // reused or freed.
            let r = unsafe {
                sys::cuLaunchKernel(
                    self.function,
                    blocks,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream.0,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            // Synchronised first either way: the descriptor copy may still read `table`.
            let synced = stream.sync();
            check(r, "cuLaunchKernel (kvtier_copy)")?;
            synced?;
        }
        Ok(())
    }
}

/// Every method, set up over `lanes`, or why it cannot run here.
pub(super) fn offered(lanes: &Arc<Lanes>) -> Vec<Offered> {
    Method::ALL
        .into_iter()
        .map(|m| {
            let mover: Result<Box<dyn Mover>, String> = match m {
                Method::Batch => Batch::load(lanes.clone()).map(|b| Box::new(b) as _),
                Method::Kernel => Kernel::load(lanes.clone()).map(|k| Box::new(k) as _),
                Method::PerRun => Ok(Box::new(PerRun {
                    lanes: lanes.clone(),
                })),
            };
            (m, mover)
        })
        .collect()
}
