//! The cuda device: the engine's KV memory in GPU memory, opened from the CUDA IPC handles
//! the engine exported, and copies to and from the host pool, which is registered with the
//! driver (page-locked and mapped into the device) so copies are DMA.
//!
//! The engine's memory is a [`DeviceMap`]: one handle per (layer, part) buffer (SGLang's
//! layer-first pool, [`DeviceMap::layer_first`]), or a few allocations with each run's offset
//! and page stride in them (vLLM's layouts: the handle of a tensor's whole allocation plus the
//! tensor's offset, [`DeviceMap::new`]). Copies are [`Plan`]s executed by the copy method
//! `device.copy_method` picks after every method's start-up self-check
//! ([`crate::method::select`]); [`CudaDevice::checks`] says what each found.
//!
//! The driver library is loaded at run time (cudarc's `dynamic-loading`): nothing CUDA is
//! needed to build, and opening checks that `libcuda` is present before the first driver
//! call, so a machine without it gets [`DeviceError::Unavailable`], never a panic.

mod buffer;
mod driver;
mod movers;

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use kvtier_core::CopyMethod;
use kvtier_core::DevicePool;
use kvtier_core::copy_method::{Check, Choice, Method};
use kvtier_shm::ShmPool;

pub use buffer::DeviceBuffer;
pub use driver::driver_present;

use crate::method::{Direction, Mover, SCRATCH_BYTES, Scratch, select};
use crate::plan::{DeviceMap, HostSlots, Plan, Run};
use crate::{Attached, CopyReport, Device, DeviceError, Fence, PageCopy, check_copies};
use driver::{Context, check};
use movers::Lanes;

/// Bytes of a CUDA IPC memory handle.
pub const IPC_HANDLE_BYTES: usize = 64;

/// The host pool is registered with the driver in pieces of at most this many bytes.
pub const REGISTER_CHUNK: usize = 64 << 30;

/// One region of the engine's memory: opened from an IPC handle (closed on drop) or lent.
#[derive(Debug)]
struct Region {
    ptr: sys::CUdeviceptr,
    ipc: bool,
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.ipc {
            // SAFETY: `ptr` was returned by cuIpcOpenMemHandle and is closed exactly once.
            let _ = unsafe { sys::cuIpcCloseMemHandle(self.ptr) };
        }
    }
}

/// A host mapping registered with the driver, in chunks.
#[derive(Debug)]
struct Registered {
    base: usize,
    len: usize,
    chunks: Vec<usize>,
}

impl Drop for Registered {
    fn drop(&mut self) {
        for &c in &self.chunks {
            // SAFETY: each chunk start was registered by cuMemHostRegister and is
            // unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(c as *mut std::ffi::c_void) };
        }
    }
}

/// Registers `[base, base + len)` in chunks of at most [`REGISTER_CHUNK`] bytes, page-locked
/// and mapped into the device. On failure, what was registered is released again.
fn register(base: usize, len: usize) -> Result<Registered, DeviceError> {
    let mut reg = Registered {
        base,
        len,
        chunks: Vec::new(),
    };
    let mut at = 0;
    while at < len {
        let n = (len - at).min(REGISTER_CHUNK);
        let ptr = (base + at) as *mut std::ffi::c_void;
        let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
        // SAFETY: [base, base + len) is the live host mapping (ShmPool keeps it mapped while
        // it lives; the agent keeps the pool alive longer than the device uses it), and the
        // chunk lies inside it.
        let r = unsafe { sys::cuMemHostRegister_v2(ptr, n, flags) };
        check(r, &format!("cuMemHostRegister ({n} bytes at offset {at})"))?;
        reg.chunks.push(base + at);
        at += n;
    }
    Ok(reg)
}

/// Refuses `given` regions (handles or pointers, named `field`) for a map of another number.
fn one_per_region(map: &DeviceMap, given: usize, field: &str) -> Result<(), DeviceError> {
    let want = map.region_bytes().len();
    if given == want {
        return Ok(());
    }
    Err(DeviceError::Invalid {
        field: field.into(),
        reason: format!("{given} {field} for a map of {want} regions"),
    })
}

/// An engine pool in GPU memory. Field order is drop order: registrations, the mover (its
/// streams and module) and regions go before the context they belong to.
#[derive(Debug)]
pub struct CudaDevice {
    map: DeviceMap,
    bases: Vec<u64>,
    registered: Mutex<Vec<Registered>>,
    mover: Box<dyn Mover>,
    checks: Vec<(Method, Check)>,
    choice: Choice,
    /// Held so the IPC mappings close after everything that copies through them.
    _regions: Vec<Region>,
    ctx: Arc<Context>,
}

// SAFETY: the raw handles inside (device pointers of the retained context) may be used from
// any thread once the context is made current, which every copy does first; the mover keeps
// its streams under mutexes.
unsafe impl Send for CudaDevice {}
// SAFETY: as above.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    /// Opens the engine's memory on GPU `ordinal` from its CUDA IPC handles, one per region
    /// of `map` (for [`DeviceMap::layer_first`], one per (layer, part) buffer in the order of
    /// [`DevicePool::run`]'s `buffer` index), and picks the copy method.
    pub fn open(
        map: DeviceMap,
        ordinal: u32,
        handles: &[[u8; IPC_HANDLE_BYTES]],
        method: CopyMethod,
    ) -> Result<Self, DeviceError> {
        one_per_region(&map, handles.len(), "ipc_handles")?;
        let ctx = Arc::new(Context::retain(ordinal)?);
        let mut regions = Vec::with_capacity(handles.len());
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
            regions.push(Region { ptr, ipc: true });
            let (mut base, mut size) = (0, 0);
            // SAFETY: `ptr` is a live mapping; writes its allocation's base and size.
            let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) };
            check(r, &format!("cuMemGetAddressRange (ipc_handles[{i}])"))?;
            let have = (base + size as u64).saturating_sub(ptr);
            if have < map.region_bytes()[i] {
                return Err(DeviceError::Invalid {
                    field: format!("ipc_handles[{i}]"),
                    reason: format!(
                        "the allocation holds {have} bytes from the handle's address, the map \
                         needs {}",
                        map.region_bytes()[i]
                    ),
                });
            }
        }
        Self::with_regions(map, ctx, regions, method, true)
    }

    /// Uses memory already in this process's address space (an engine embedding the agent,
    /// or tests): `ptrs[i]` is region `i` of `map`, at least as long as the map says, and must
    /// outlive the device.
    pub fn from_device_ptrs(
        map: DeviceMap,
        ordinal: u32,
        ptrs: &[u64],
        method: CopyMethod,
    ) -> Result<Self, DeviceError> {
        one_per_region(&map, ptrs.len(), "buffers")?;
        let ctx = Arc::new(Context::retain(ordinal)?);
        let regions = ptrs.iter().map(|&ptr| Region { ptr, ipc: false }).collect();
        Self::with_regions(map, ctx, regions, method, false)
    }

    fn with_regions(
        map: DeviceMap,
        ctx: Arc<Context>,
        regions: Vec<Region>,
        method: CopyMethod,
        imported: bool,
    ) -> Result<Self, DeviceError> {
        let lanes = Arc::new(Lanes::new(ctx.clone())?);
        let scratch = buffer::CudaScratch::new()?;
        let selected = select(method, movers::offered(&lanes), &scratch)?;
        let dev = Self {
            bases: regions.iter().map(|r| r.ptr).collect(),
            map,
            registered: Mutex::new(Vec::new()),
            mover: selected.mover,
            checks: selected.checks,
            choice: selected.choice,
            _regions: regions,
            ctx,
        };
        if imported {
            dev.verify_import(&scratch)?;
        }
        Ok(dev)
    }

    /// The imported memory, checked without writing to it: page 0 (its first
    /// [`SCRATCH_BYTES`]) read through the chosen method equals the same bytes read piece by piece
    /// with plain synchronous copies.
    fn verify_import(&self, scratch: &buffer::CudaScratch) -> Result<(), DeviceError> {
        let layout = self.map.pool().layout();
        let page = layout.page_bytes();
        let covered = page.min(SCRATCH_BYTES);
        let base = scratch.host_base();
        let plan = Plan::build(
            &self.map,
            &self.bases,
            HostSlots {
                base,
                stride: page as u64,
            },
            &[PageCopy {
                device_page: 0,
                host_slot: 0,
            }],
        );
        let clipped: Vec<Run> = plan
            .runs()
            .iter()
            .filter(|r| r.host - base < covered as u64)
            .map(|r| Run {
                len: r.len.min(covered as u64 - (r.host - base)),
                ..*r
            })
            .collect();
        self.mover.copy(&clipped, Direction::ToHost)?;
        let mut through = vec![0u8; SCRATCH_BYTES];
        scratch.read_host(&mut through);
        let mut plain = vec![0u8; covered];
        let mut at = 0;
        for p in self.map.pieces() {
            if at >= covered {
                break;
            }
            let n = (p.len as usize).min(covered - at);
            let src = self.bases[p.region] + p.offset;
            // SAFETY: page 0 of the piece lies inside region `p.region` (DeviceMap::new) and
            // `plain[at..at + n]` inside the vector; the copy is synchronous.
            let r = unsafe { sys::cuMemcpyDtoH_v2(plain[at..].as_mut_ptr().cast(), src, n) };
            check(r, "cuMemcpyDtoH (import check)")?;
            at += p.len as usize;
        }
        if through[..covered] != plain[..] {
            return Err(DeviceError::Unavailable(format!(
                "the imported memory read through {} differs from a plain read: the map's \
                 offsets or the handles are wrong",
                self.choice.method.name()
            )));
        }
        Ok(())
    }

    /// What each copy method's self-check found, in [`Method::ALL`] order.
    pub fn checks(&self) -> &[(Method, Check)] {
        &self.checks
    }

    /// The method copies use, and why when it is not the configured one.
    pub fn choice(&self) -> &Choice {
        &self.choice
    }

    /// Registers the host pool (once; later calls return at once).
    fn ensure_registered(&self, host: &ShmPool) -> Result<Option<Duration>, DeviceError> {
        let base = host
            .slot_ptr(0)
            .map_err(|e| DeviceError::Copy(e.to_string()))?;
        let (base, len) = (base.as_ptr() as usize, host.len());
        let mut reg = self.registered.lock();
        if reg.iter().any(|r| r.base == base && r.len == len) {
            return Ok(None);
        }
        self.ctx.make_current()?;
        let start = Instant::now();
        let r = register(base, len).map_err(|e| {
            DeviceError::Copy(format!(
                "the host pool ({len} bytes) could not be registered with the driver, so no \
                 copy may use it: {e}"
            ))
        })?;
        // A pool replaced by a new mapping at another address stays registered until the
        // device goes: the agent attaches one pool per daemon session, so there are few.
        reg.push(r);
        Ok(Some(start.elapsed()))
    }

    /// Copies in parts of about [`FENCE_PART_BYTES`], each queued on the stream and waited
    /// for before the next, with `fence` checked before each: what is queued, the GPU moves,
    /// so a part bounds how far past the fence's closing a copy runs (about 2.5 ms at
    /// 25 GB/s), and how long a part waits behind another copy's on the same stream.
    fn copy(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        dir: Direction,
        fence: &Fence,
    ) -> Result<(), DeviceError> {
        let slots = check_copies(self.map.pool(), host, copies)?;
        self.ensure_registered(host)?;
        let plan = Plan::build(&self.map, &self.bases, slots, copies);
        for part in parts(plan.runs(), FENCE_PART_BYTES) {
            // Held until the part's transfers are done (the mover waits for them).
            let _moving = fence.enter()?;
            self.mover.copy(part, dir)?;
        }
        Ok(())
    }
}

/// Bytes of runs a copy queues on its stream between fence checks.
const FENCE_PART_BYTES: u64 = 64 << 20;

/// `runs` in consecutive parts of at least `bytes` each (the last may be smaller; a run is
/// never split).
fn parts(runs: &[Run], bytes: u64) -> impl Iterator<Item = &[Run]> {
    let mut rest = runs;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut sum = 0u64;
        let n = rest
            .iter()
            .position(|r| {
                sum += r.len;
                sum >= bytes
            })
            .map_or(rest.len(), |i| i + 1);
        let (part, tail) = rest.split_at(n);
        rest = tail;
        Some(part)
    })
}

impl Device for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn pool(&self) -> &DevicePool {
        self.map.pool()
    }

    fn attach_host(&self, host: &ShmPool) -> Result<Attached, DeviceError> {
        let took = self.ensure_registered(host)?;
        Ok(Attached {
            registered: took.is_some(),
            took: took.unwrap_or_default(),
        })
    }

    fn copy_report(&self) -> CopyReport<'_> {
        CopyReport {
            method: self.choice.method.name(),
            fallback_from: self.choice.fallback_from.as_ref(),
            checks: &self.checks,
        }
    }

    fn copies_inline(&self, _bytes: usize) -> bool {
        // Every copy waits on the GPU's stream.
        false
    }

    fn copy_to_host(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        fence: &Fence,
    ) -> Result<(), DeviceError> {
        self.copy(host, copies, Direction::ToHost, fence)
    }

    fn copy_from_host(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        fence: &Fence,
    ) -> Result<(), DeviceError> {
        self.copy(host, copies, Direction::FromHost, fence)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_every_run_once_in_order_and_split_only_between_runs() {
        let runs: Vec<Run> = [5u64, 3, 10, 1, 1, 7, 20]
            .iter()
            .enumerate()
            .map(|(i, &len)| Run {
                device: i as u64,
                host: 100 + i as u64,
                len,
            })
            .collect();
        for bytes in [1, 4, 8, 13, 30, 1000] {
            let got: Vec<&[Run]> = parts(&runs, bytes).collect();
            let flat: Vec<Run> = got.iter().flat_map(|p| p.iter().copied()).collect();
            assert_eq!(flat, runs, "parts of {bytes}");
            for p in &got[..got.len() - 1] {
                let sum: u64 = p.iter().map(|r| r.len).sum();
                let without_last: u64 = sum - p[p.len() - 1].len;
                assert!(sum >= bytes && without_last < bytes, "{bytes}: {p:?}");
            }
        }
        assert_eq!(parts(&[], 8).count(), 0);
    }
}
