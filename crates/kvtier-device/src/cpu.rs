//! The cpu device: the engine's KV pool in shared memory, handed over as descriptors (the
//! agent opens no path a client names), one of two ways:
//! - one file of layer-first buffers laid end to end ([`DevicePool::total_bytes`] long)
//!   ([`CpuDevice::open`]): CPU inference engines and vLLM's staging pool use it; tests and
//!   the simulator use it because CI has no GPU;
//! - the engine's own allocations (memfds or shared-memory files) with the pieces of a page
//!   placed in them, as the cuda device takes vLLM's GPU blocks ([`CpuDevice::open_mapped`]):
//!   the agent reads and writes the engine's blocks in place, the CPU stand-in for DMA that
//!   the vLLM fuzzer runs the worker's DMA path on.
//!
//! Each file is sealed against shrinking where its creator allowed sealing (a memfd made
//! with `MFD_ALLOW_SEALING`); every copy is guarded all the same, so a file that shrinks
//! under one fails the copy rather than kill the agent.

use std::os::fd::OwnedFd;

use kvtier_core::DevicePool;
use kvtier_shm::{ShmPool, ShmRegion};

use std::sync::atomic::{AtomicBool, Ordering};

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
    regions: Vec<ShmRegion>,
    /// The address of each of the map's regions (a buffer of the one file, or a file).
    bases: Vec<u64>,
    threads: usize,
    /// A copy found an engine file shrunk under it: part of the mapping is anonymous memory
    /// now, and every later copy is refused.
    damaged: AtomicBool,
}

impl CpuDevice {
    /// Maps the engine's pool file `fd`, which must be at least `pool.total_bytes()` long.
    /// Copies of many pages are spread over `threads` threads (at least one).
    pub fn open(pool: DevicePool, fd: OwnedFd, threads: usize) -> Result<Self, DeviceError> {
        let region = Self::region_of(fd, pool.total_bytes(), "pool file")?;
        let base = region.ptr().as_ptr() as u64;
        let buffer = pool.buffer_bytes() as u64;
        Ok(Self {
            map: DeviceMap::layer_first(&pool),
            bases: (0..pool.num_buffers() as u64)
                .map(|b| base + b * buffer)
                .collect(),
            pool,
            regions: vec![region],
            threads: threads.max(1),
            damaged: AtomicBool::new(false),
        })
    }

    /// Maps the engine's allocations, `fds[i]` for the map's region `i` (a file at least
    /// `map.region_bytes()[i]` long), and reads and writes pages where `map` places their
    /// pieces. Errors name the allocation (`allocations[i]`).
    pub fn open_mapped(
        map: DeviceMap,
        fds: Vec<OwnedFd>,
        threads: usize,
    ) -> Result<Self, DeviceError> {
        if fds.len() != map.region_bytes().len() {
            return Err(DeviceError::Invalid {
                field: "allocations".into(),
                reason: format!(
                    "{} descriptors for a map of {} allocations",
                    fds.len(),
                    map.region_bytes().len()
                ),
            });
        }
        let mut regions = Vec::with_capacity(fds.len());
        for (i, (fd, &bytes)) in fds.into_iter().zip(map.region_bytes()).enumerate() {
            let field = format!("allocations[{i}]");
            let len = usize::try_from(bytes).map_err(|_| DeviceError::Invalid {
                field: field.clone(),
                reason: format!("{bytes} bytes do not fit in memory"),
            })?;
            regions.push(Self::region_of(fd, len, &field)?);
        }
        Ok(Self {
            pool: map.pool().clone(),
            bases: regions.iter().map(|r| r.ptr().as_ptr() as u64).collect(),
            map,
            regions,
            threads: threads.max(1),
            damaged: AtomicBool::new(false),
        })
    }

    /// Maps one of the engine's files, sealed against shrinking where it allows that.
    fn region_of(fd: OwnedFd, len: usize, field: &str) -> Result<ShmRegion, DeviceError> {
        let region =
            ShmRegion::from_fd_at_least(fd, len, field).map_err(|e| DeviceError::Invalid {
                field: field.into(),
                reason: e.to_string(),
            })?;
        // Best effort: a file that cannot be sealed (a tmpfs file, a memfd without
        // MFD_ALLOW_SEALING) is still safe, its copies being guarded.
        region.seal_shrink();
        Ok(region)
    }

    /// The identity (device, inode) of each file mapped: the agent refuses an engine pool
    /// that is a file it holds itself (its L2 pool's descriptor, sent back to it).
    pub fn file_ids(&self) -> Result<Vec<(u64, u64)>, DeviceError> {
        self.regions
            .iter()
            .map(|r| {
                r.file_id().map_err(|e| DeviceError::Invalid {
                    field: "allocations".into(),
                    reason: e.to_string(),
                })
            })
            .collect()
    }

    /// The mapped engine pool's first file (tests and the simulator write and read pages
    /// through the one file of a layer-first pool).
    pub fn region(&self) -> &ShmRegion {
        &self.regions[0]
    }

    /// The copy plan of `copies` over this pool and `host` (checked first).
    fn plan(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<Plan, DeviceError> {
        let slots = check_copies(&self.pool, host, copies)?;
        Ok(Plan::build(&self.map, &self.bases, slots, copies))
    }

    /// Copies `runs`, entering `fence` for each [`FENCE_BYTES`] or so (a long run moves in
    /// pieces of that size; short runs share one entry until they add up to it).
    fn copy_runs(
        runs: &[Run],
        dir: Direction,
        fence: &Fence,
        damaged: &AtomicBool,
    ) -> Result<(), DeviceError> {
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
                // accepted: every device run lies inside a region of this device's mapped
                // files (the map is `layer_first` of the pool the one file was opened with,
                // so offset + page × stride + len ≤ buffer_bytes; or a map `DeviceMap::new`
                // checked against region_bytes, each file mapped at least that long), and
                // every host run inside a
                // slot of the live host mapping (run index × run_bytes + len ≤ page_bytes ≤
                // stride); `off + n ≤ len` keeps this piece inside its run. The two mappings
                // are distinct files (the agent refuses an engine file that is its L2 pool's,
                // `file_ids`), so the ranges do not overlap. No Rust reference into
                // either mapping exists; concurrent access to these bytes is excluded by the
                // agent's locks (device page) and the daemon's reserve/acquire protocol (host
                // slot).
                let copy = || unsafe {
                    match dir {
                        Direction::ToHost => std::ptr::copy_nonoverlapping(dev, hst, n),
                        Direction::FromHost => std::ptr::copy_nonoverlapping(hst, dev, n),
                    }
                };
                // The engine's files are the engine's: one it shrinks under the copy would
                // fault (SIGBUS) in the device range; the guard absorbs that, and the copy,
                // and every later one, fails instead of the agent dying.
                match kvtier_shm::guarded(dev as usize, n, copy) {
                    Some(true) => {}
                    Some(false) => {
                        damaged.store(true, Ordering::Release);
                        return Err(DeviceError::Copy(
                            "the engine's pool file shrank under a copy".into(),
                        ));
                    }
                    // No guard in this process (the handler could not be installed).
                    None => copy(),
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
        if self.damaged.load(Ordering::Acquire) {
            return Err(DeviceError::Copy(
                "the engine's pool file shrank under an earlier copy: register it again".into(),
            ));
        }
        let plan = self.plan(host, copies)?;
        let damaged = &self.damaged;
        if self.threads == 1 || copies.len() < PARALLEL_MIN_PAGES {
            return Self::copy_runs(plan.runs(), dir, fence, damaged);
        }
        std::thread::scope(|s| {
            let parts: Vec<_> = plan
                .split(self.threads)
                .into_iter()
                .map(|part| s.spawn(move || Self::copy_runs(part, dir, fence, damaged)))
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
