//! The cpu device: the engine's KV pool is a shared-memory file (layer-first buffers laid end
//! to end, [`DevicePool::total_bytes`] long) that the engine created and names when it
//! registers. CPU inference engines use it for real; tests and the simulator use it because CI
//! has no GPU.

use std::path::Path;

use kvtier_core::DevicePool;
use kvtier_shm::{ShmPool, ShmRegion};

use crate::method::Direction;
use crate::plan::{DeviceMap, Plan, Run};
use crate::{Attached, CopyReport, Device, DeviceError, Fence, PageCopy, check_copies};

/// Copies below this many pages run on the calling thread: spawning costs more than it saves.
const PARALLEL_MIN_PAGES: usize = 8;

/// A copy enters its fence for each piece of this many bytes: after it closes, at most this
/// much more moves on each copy thread (tens of microseconds), and a settling close waits
/// for no more than that.
const FENCE_BYTES: usize = 256 << 10;

/// Copies up to this many bytes may run on an async runtime's thread ([`Device::copies_inline`]):
/// about 0.1 ms of memcpy, less than the two thread hand-offs of a blocking task cost on a
/// busy machine (measured: 60 µs off a one-page Save of 512 KiB on 2 cores).
const INLINE_COPY_BYTES: usize = 1 << 20;

/// An engine pool in CPU shared memory.
#[derive(Debug)]
pub struct CpuDevice {
    pool: DevicePool,
    map: DeviceMap,
    region: ShmRegion,
    threads: usize,
}

impl CpuDevice {
    /// Maps the engine's pool file at `path`, which must be exactly `pool.total_bytes()` long.
    /// Copies of many pages are spread over `threads` threads (at least one).
    pub fn open(pool: DevicePool, path: &Path, threads: usize) -> Result<Self, DeviceError> {
        let region =
            ShmRegion::open(path, pool.total_bytes()).map_err(|e| DeviceError::Invalid {
                field: "pool file".into(),
                reason: e.to_string(),
            })?;
        Ok(Self {
            map: DeviceMap::layer_first(&pool),
            pool,
            region,
            threads: threads.max(1),
        })
    }

    /// The mapped engine pool (tests and the simulator write and read pages through it).
    pub fn region(&self) -> &ShmRegion {
        &self.region
    }

    /// The copy plan of `copies` over this pool and `host` (checked first).
    fn plan(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<Plan, DeviceError> {
        let slots = check_copies(&self.pool, host, copies)?;
        let base = self.region.ptr().as_ptr() as u64;
        let buffer = self.pool.buffer_bytes() as u64;
        let bases: Vec<u64> = (0..self.pool.num_buffers() as u64)
            .map(|b| base + b * buffer)
            .collect();
        Ok(Plan::build(&self.map, &bases, slots, copies))
    }

    /// Copies `runs`, entering `fence` for each [`FENCE_BYTES`] or so (a long run moves in
    /// pieces of that size; short runs share one entry until they add up to it).
    fn copy_runs(runs: &[Run], dir: Direction, fence: &Fence) -> Result<(), DeviceError> {
        let mut moving = None;
        let mut since = FENCE_BYTES;
        for r in runs {
            let len = r.len as usize;
            let mut off = 0;
            while off < len {
                if since >= FENCE_BYTES {
                    // Out of the last part before entering the next.
                    drop(moving.take());
                    moving = Some(fence.enter()?);
                    since = 0;
                }
                let n = (len - off).min(FENCE_BYTES);
                let (dev, hst) = (
                    (r.device as usize + off) as *mut u8,
                    (r.host as usize + off) as *mut u8,
                );
                // SAFETY: the plan was built by `plan` from a copy list `check_copies`
                // accepted: every device run lies inside a buffer of this device's mapped
                // pool file (the map is `layer_first` of the pool the region was opened with,
                // so offset + page × stride + len ≤ buffer_bytes), and every host run inside a
                // slot of the live host mapping (run index × run_bytes + len ≤ page_bytes ≤
                // stride); `off + n ≤ len` keeps this piece inside its run. The two mappings
                // are distinct files, so the ranges do not overlap. No Rust reference into
                // either mapping exists; concurrent access to these bytes is excluded by the
                // agent's locks (device page) and the daemon's reserve/acquire protocol (host
                // slot).
                unsafe {
                    match dir {
                        Direction::ToHost => std::ptr::copy_nonoverlapping(dev, hst, n),
                        Direction::FromHost => std::ptr::copy_nonoverlapping(hst, dev, n),
                    }
                }
                off += n;
                since += n;
            }
        }
        Ok(())
    }

    fn copy(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        dir: Direction,
        fence: &Fence,
    ) -> Result<(), DeviceError> {
        let plan = self.plan(host, copies)?;
        if self.threads == 1 || copies.len() < PARALLEL_MIN_PAGES {
            return Self::copy_runs(plan.runs(), dir, fence);
        }
        std::thread::scope(|s| {
            let parts: Vec<_> = plan
                .split(self.threads)
                .into_iter()
                .map(|part| s.spawn(move || Self::copy_runs(part, dir, fence)))
                .collect();
            parts.into_iter().try_for_each(|p| {
                p.join()
                    .unwrap_or_else(|_| Err(DeviceError::Copy("a copy thread panicked".into())))
            })
        })
    }
}

impl Device for CpuDevice {
    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn pool(&self) -> &DevicePool {
        &self.pool
    }

    fn attach_host(&self, _host: &ShmPool) -> Result<Attached, DeviceError> {
        Ok(Attached::default())
    }

    fn copy_report(&self) -> CopyReport<'_> {
        CopyReport {
            method: "memcpy",
            fallback_from: None,
            checks: &[],
        }
    }

    fn copies_inline(&self, bytes: usize) -> bool {
        bytes <= INLINE_COPY_BYTES
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
