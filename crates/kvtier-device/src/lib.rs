//! kvtier-device: the engine's KV pool (the device tier, L1) and page copies between it and
//! the daemon's host pool (L2). With kvtier-shm, the only crate with `unsafe`.
//!
//! The engine's pool is layer-first: per (layer, K|V) one buffer of `[token_slot][...]`, so
//! page `p`'s run of one (layer, part) is contiguous at `p × run_bytes` in that buffer
//! ([`kvtier_core::DevicePool::run`]). A host slot is page-first: the same runs back to back
//! ([`kvtier_core::Layout::host_run_offset`]). Moving a page is `runs_per_page` contiguous
//! copies either way.
//!
//! - [`cpu::CpuDevice`]: the pool is a shared-memory file the engine created; copies are
//!   memcpys spread over a few threads.
//! - [`cuda::CudaDevice`]: the pool is GPU memory opened from the engine's CUDA IPC handles;
//!   the host pool is registered with the driver (pinned) and copies are asynchronous on a
//!   dedicated stream per direction. The driver is loaded at run time, so this builds and runs
//!   (with a clear error) where there is no CUDA.
//!
//! Every copy list is checked in full (pages and slots in range, slot big enough) before any
//! byte moves, so a bad request changes nothing.

use kvtier_core::DevicePool;
use kvtier_core::copy_method::{Check, Method};
use kvtier_shm::ShmPool;

pub mod cpu;
pub mod cuda;
pub mod fence;
pub mod method;
pub mod plan;

pub use fence::Fence;

/// Errors of a device.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A copy names a page or slot that does not exist, or the shapes disagree.
    #[error("invalid {field}: {reason}")]
    Invalid {
        /// What is wrong.
        field: String,
        /// Why.
        reason: String,
    },
    /// The device is not available here (no driver, no GPU, cannot open the pool).
    #[error("device unavailable: {0}")]
    Unavailable(String),
    /// A copy failed in the driver or the OS.
    #[error("copy failed: {0}")]
    Copy(String),
    /// A copy stopped, or never started, because its [`Fence`] closed: the call it served
    /// is past its deadline or its client left, so the engine's pages are no longer its.
    #[error("copy fenced: its call is past its deadline or its client left")]
    Fenced,
}

/// One page to move: the engine's page index in its pool and a slot of the host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    /// Page index in the engine's pool (token slot / page size).
    pub device_page: u32,
    /// Slot in the host pool.
    pub host_slot: u32,
}

/// What attaching a host pool did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Attached {
    /// Whether this call registered the pool with the driver (false: nothing to do, or
    /// already registered).
    pub registered: bool,
    /// How long registering took.
    pub took: std::time::Duration,
}

/// How a device copies, for logs and metrics.
#[derive(Clone, Copy, Debug)]
pub struct CopyReport<'a> {
    /// The method in use (`memcpy` on the cpu device).
    pub method: &'static str,
    /// The configured method when it was not usable, and why.
    pub fallback_from: Option<&'a (Method, String)>,
    /// Every method's self-check (none on the cpu device).
    pub checks: &'a [(Method, Check)],
}

/// The engine's KV pool and copies to and from the host pool.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// `cpu` or `cuda`, for metrics and logs.
    fn kind(&self) -> &'static str;

    /// The pool's geometry.
    fn pool(&self) -> &DevicePool;

    /// Prepares `host` for copies before the first one needs it: the cuda device registers
    /// it with the driver (page-locked, in chunks); the cpu device has nothing to do. Copies
    /// into a pool that was not attached attach it first.
    fn attach_host(&self, host: &ShmPool) -> Result<Attached, DeviceError>;

    /// The copy method in use and what its self-checks found.
    fn copy_report(&self) -> CopyReport<'_>;

    /// Whether a copy of `bytes` may run on the calling thread (an async runtime's): a plain
    /// memcpy short enough not to hold up the calls sharing that thread. Longer copies, and
    /// any that wait on a device, run on a blocking thread, whose hand-offs cost more than a
    /// short copy does.
    fn copies_inline(&self, bytes: usize) -> bool;

    /// Copies device pages into host slots (device → host). Returns when every byte landed,
    /// or [`DeviceError::Fenced`] when `fence` closed before the copy ended (what was copied
    /// by then is not to be used).
    fn copy_to_host(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        fence: &Fence,
    ) -> Result<(), DeviceError>;

    /// Copies host slots into device pages (host → device). Returns when every byte landed,
    /// or [`DeviceError::Fenced`] when `fence` closed first: no part starts after it closed.
    fn copy_from_host(
        &self,
        host: &ShmPool,
        copies: &[PageCopy],
        fence: &Fence,
    ) -> Result<(), DeviceError>;
}

/// Checks a copy list against the pool and the host pool before anything moves, and returns
/// where the host pool's slots are, for [`plan::Plan::build`].
pub fn check_copies(
    pool: &DevicePool,
    host: &ShmPool,
    copies: &[PageCopy],
) -> Result<plan::HostSlots, DeviceError> {
    let page_bytes = pool.layout().page_bytes();
    if host.stride() < page_bytes {
        return Err(DeviceError::Invalid {
            field: "host pool".into(),
            reason: format!(
                "slots of {} bytes cannot hold pages of {page_bytes}",
                host.stride()
            ),
        });
    }
    for (i, c) in copies.iter().enumerate() {
        if c.device_page as usize >= pool.num_pages() {
            return Err(DeviceError::Invalid {
                field: format!("copies[{i}].device_page"),
                reason: format!(
                    "{} is outside the engine's pool of {} pages",
                    c.device_page,
                    pool.num_pages()
                ),
            });
        }
        if c.host_slot >= host.slots() {
            return Err(DeviceError::Invalid {
                field: format!("copies[{i}].host_slot"),
                reason: format!(
                    "{} is outside the host pool of {} slots",
                    c.host_slot,
                    host.slots()
                ),
            });
        }
    }
    let slot0 = host
        .slot_ptr(0)
        .map_err(|e| DeviceError::Copy(e.to_string()))?;
    Ok(plan::HostSlots {
        base: slot0.as_ptr() as u64,
        stride: host.stride() as u64,
    })
}
