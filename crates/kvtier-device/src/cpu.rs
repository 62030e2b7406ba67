//! The cpu device: the engine's KV pool is a shared-memory file (layer-first buffers laid end
//! to end, [`DevicePool::total_bytes`] long) that the engine created and names when it
//! registers. CPU inference engines use it for real; tests and the simulator use it because CI
//! has no GPU.

use std::path::Path;

use kvtier_core::DevicePool;
use kvtier_shm::{ShmPool, ShmRegion};

use crate::{Device, DeviceError, PageCopy, check_copies};

/// Copies below this many pages run on the calling thread: spawning costs more than it saves.
const PARALLEL_MIN_PAGES: usize = 8;

/// An engine pool in CPU shared memory.
#[derive(Debug)]
pub struct CpuDevice {
    pool: DevicePool,
    region: ShmRegion,
    threads: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Dir {
    ToHost,
    FromHost,
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
            pool,
            region,
            threads: threads.max(1),
        })
    }

    /// The mapped engine pool (tests and the simulator write and read pages through it).
    pub fn region(&self) -> &ShmRegion {
        &self.region
    }

    fn copy_pages(&self, host: &ShmPool, copies: &[PageCopy], dir: Dir) {
        let layout = self.pool.layout();
        let buffer_bytes = self.pool.buffer_bytes();
        let base = self.region.ptr().as_ptr();
        for c in copies {
            // `check_copies` proved both indices in range, so these cannot fail.
            let Ok(slot) = host.slot_ptr(c.host_slot) else {
                continue;
            };
            for (layer, part) in layout.runs() {
                let Ok(run) = self.pool.run(c.device_page as usize, layer, part) else {
                    continue;
                };
                let dev_off = run.buffer * buffer_bytes + run.offset;
                let host_off = layout.host_run_offset(layer, part);
                // SAFETY: `run` lies inside buffer `run.buffer` (DevicePool::run checks the
                // page and run), so `dev_off + run.len <= total_bytes()`, the region's mapped
                // length (checked at open). `host_off + run.len <= page_bytes <= stride`
                // (check_copies), so the host range is inside slot `c.host_slot`, inside the
                // live host mapping. The two mappings are distinct files, so the ranges do not
                // overlap. No Rust reference into either mapping exists; concurrent access to
                // these bytes is excluded by the agent's locks (device page) and the daemon's
                // reserve/acquire protocol (host slot).
                unsafe {
                    let dev = base.add(dev_off);
                    let hst = slot.as_ptr().add(host_off);
                    match dir {
                        Dir::ToHost => std::ptr::copy_nonoverlapping(dev, hst, run.len),
                        Dir::FromHost => std::ptr::copy_nonoverlapping(hst, dev, run.len),
                    }
                }
            }
        }
    }

    fn copy(&self, host: &ShmPool, copies: &[PageCopy], dir: Dir) -> Result<(), DeviceError> {
        check_copies(&self.pool, host, copies)?;
        if self.threads == 1 || copies.len() < PARALLEL_MIN_PAGES {
            self.copy_pages(host, copies, dir);
            return Ok(());
        }
        let per = copies.len().div_ceil(self.threads);
        std::thread::scope(|s| {
            for chunk in copies.chunks(per) {
                s.spawn(move || self.copy_pages(host, chunk, dir));
            }
        });
        Ok(())
    }
}

impl Device for CpuDevice {
    fn kind(&self) -> &'static str {
        "cpu"
    }

    fn pool(&self) -> &DevicePool {
        &self.pool
    }

    fn copy_to_host(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<(), DeviceError> {
        self.copy(host, copies, Dir::ToHost)
    }

    fn copy_from_host(&self, host: &ShmPool, copies: &[PageCopy]) -> Result<(), DeviceError> {
        self.copy(host, copies, Dir::FromHost)
    }
}
