//! The engine's KV memory as `RegisterPool` describes it, opened as a [`Device`]: CPU memory
//! from the descriptors the engine deposited at the memory door (never a path: the agent
//! opens no file a client names), or GPU memory by CUDA IPC handle. Every field is checked
//! here before anything is opened or mapped; errors name the `cpu.*` or `cuda.*` field.

use std::sync::Arc;

use kvtier_core::{CopyMethod, DevicePool};
use kvtier_device::cpu::CpuDevice;
use kvtier_device::cuda::{CudaDevice, IPC_HANDLE_BYTES};
use kvtier_device::plan::{DeviceMap, Piece};
use kvtier_device::{Device, DeviceError};
use kvtier_proto::ApiError;
use kvtier_proto::v1;

use crate::memory_door::Deposits;
use crate::metrics::Metrics;

/// Most allocations a CPU pool may span: each is a descriptor and a mapping the agent holds
/// (vLLM allocates one per KV cache tensor, at most one per layer). The memory door takes
/// no more in one deposit.
pub(crate) const MAX_ALLOCATIONS: usize = kvtier_shm::memory_door::MAX_FDS;

/// What opening the engine's memory needs besides the request.
pub(crate) struct Opener<'a> {
    /// Deposits waiting for their registration.
    pub deposits: &'a Deposits,
    /// The registering caller's uid (a deposit is taken by its own uid alone).
    pub caller_uid: Option<u32>,
    /// Threads a CPU copy may spread over.
    pub copy_threads: usize,
    /// How GPU copies move.
    pub copy_method: CopyMethod,
    /// The identity of the agent's own L2 pool file, which no engine pool may be.
    pub l2_file: Option<(u64, u64)>,
    /// Where the copy methods' checks are shown.
    pub metrics: &'a Metrics,
}

impl Opener<'_> {
    /// Opens the engine's memory for `pool` as `device` describes it.
    pub(crate) fn open(
        &self,
        pool: &DevicePool,
        device: Option<v1::register_pool_request::Device>,
    ) -> Result<Arc<dyn Device>, ApiError> {
        Ok(match device {
            Some(v1::register_pool_request::Device::Cpu(c)) => Arc::new(self.cpu(pool, &c)?),
            Some(v1::register_pool_request::Device::Cuda(c)) => Arc::new(self.cuda(pool, &c)?),
            None => return Err(ApiError::invalid("device", "required: cpu or cuda")),
        })
    }

    /// The engine's CPU memory: one layer-first file, or its allocations with the pieces of a
    /// page in them. A file that is the agent's own L2 pool (its descriptor, sent back to
    /// it) is refused: it would hand the client every tenant's pages.
    fn cpu(&self, pool: &DevicePool, c: &v1::CpuPool) -> Result<CpuDevice, ApiError> {
        if c.memory.is_empty() {
            return Err(ApiError::invalid(
                "cpu.memory",
                "required: the ticket the memory door (AgentStats.memory_socket) gave for the \
                 pool's descriptors; the agent opens no path a client names",
            ));
        }
        // Checked before the deposit is taken: a request with a bad map leaves the deposit
        // for a corrected one.
        let map = if c.pieces.is_empty() {
            if !c.allocation_bytes.is_empty() {
                return Err(ApiError::invalid(
                    "cpu.allocation_bytes",
                    "given without pieces: a layer-first file needs neither",
                ));
            }
            None
        } else {
            if c.allocation_bytes.len() > MAX_ALLOCATIONS {
                return Err(ApiError::invalid(
                    "cpu.allocation_bytes",
                    format!(
                        "{} allocations; at most {MAX_ALLOCATIONS} (one per KV cache tensor)",
                        c.allocation_bytes.len()
                    ),
                ));
            }
            Some(
                DeviceMap::new(pool.clone(), c.allocation_bytes.clone(), pieces(&c.pieces))
                    .map_err(|e| device_error("cpu", e))?,
            )
        };
        // The agent maps what the pool uses of each file: no more than this machine's memory
        // (a sparse file of any size could otherwise take the agent's address space).
        let bytes: u64 = match &map {
            None => pool.total_bytes() as u64,
            Some(m) => m.region_bytes().iter().sum(),
        };
        let ram = kvtier_shm::physical_memory();
        if bytes > ram {
            return Err(ApiError::invalid(
                "cpu",
                format!("the pool's memory is {bytes} bytes, more than this machine's {ram}"),
            ));
        }
        let fds = self
            .deposits
            .take(&c.memory, self.caller_uid)
            .map_err(|e| ApiError::invalid("cpu.memory", e.to_string()))?;
        let want = map.as_ref().map_or(1, |m| m.region_bytes().len());
        if fds.len() != want {
            return Err(ApiError::invalid(
                "cpu.memory",
                format!(
                    "{} descriptors deposited for {want} {}",
                    fds.len(),
                    if map.is_some() {
                        "allocations (allocation_bytes)"
                    } else {
                        "layer-first file (give pieces for several allocations)"
                    }
                ),
            ));
        }
        let threads = self.copy_threads;
        let dev = match map {
            None => {
                let fd = fds.into_iter().next().expect("one descriptor, checked");
                CpuDevice::open(pool.clone(), fd, threads)
            }
            Some(map) => CpuDevice::open_mapped(map, fds, threads),
        }
        .map_err(|e| device_error("cpu", e))?;
        if let Some(l2) = self.l2_file {
            let ids = dev.file_ids().map_err(|e| device_error("cpu", e))?;
            if let Some(i) = ids.iter().position(|id| *id == l2) {
                return Err(ApiError::invalid(
                    format!("cpu.memory[{i}]"),
                    "is the agent's own L2 pool",
                ));
            }
        }
        Ok(dev)
    }

    /// The engine's GPU memory: per-buffer handles (layer-first), or allocations with the
    /// pieces of a page placed in them.
    fn cuda(&self, pool: &DevicePool, c: &v1::CudaPool) -> Result<CudaDevice, ApiError> {
        let mut handles = Vec::with_capacity(c.ipc_handles.len());
        for (i, h) in c.ipc_handles.iter().enumerate() {
            let h: [u8; IPC_HANDLE_BYTES] = h.as_slice().try_into().map_err(|_| {
                ApiError::invalid(
                    format!("cuda.ipc_handles[{i}]"),
                    format!(
                        "{} bytes; a CUDA IPC handle has {IPC_HANDLE_BYTES}",
                        h.len()
                    ),
                )
            })?;
            handles.push(h);
        }
        let map = cuda_map(pool, c)?;
        let dev = CudaDevice::open(map, c.device_ordinal, &handles, self.copy_method)
            .map_err(|e| device_error("cuda", e))?;
        self.metrics.copy_methods(&dev.copy_report());
        Ok(dev)
    }
}

/// The engine's GPU memory as the registration describes it: per-buffer handles alone
/// (layer-first), or allocations with the pieces of a page placed in them. Checked here, before any handle
/// is opened; errors name the `cuda.*` field.
fn cuda_map(pool: &DevicePool, c: &v1::CudaPool) -> Result<DeviceMap, ApiError> {
    if c.pieces.is_empty() {
        if !c.allocation_bytes.is_empty() {
            return Err(ApiError::invalid(
                "cuda.allocation_bytes",
                "given without pieces: per-buffer handles need neither",
            ));
        }
        if c.ipc_handles.len() != pool.num_buffers() {
            return Err(ApiError::invalid(
                "cuda.ipc_handles",
                format!(
                    "{} handles for a layout of {} buffers (or give pieces)",
                    c.ipc_handles.len(),
                    pool.num_buffers()
                ),
            ));
        }
        return Ok(DeviceMap::layer_first(pool));
    }
    if c.allocation_bytes.len() != c.ipc_handles.len() {
        return Err(ApiError::invalid(
            "cuda.allocation_bytes",
            format!(
                "{} sizes for {} handles",
                c.allocation_bytes.len(),
                c.ipc_handles.len()
            ),
        ));
    }
    DeviceMap::new(pool.clone(), c.allocation_bytes.clone(), pieces(&c.pieces))
        .map_err(|e| device_error("cuda", e))
}

/// The wire's page pieces in the device layer's terms.
fn pieces(pieces: &[v1::PagePiece]) -> Vec<Piece> {
    pieces
        .iter()
        .map(|r| Piece {
            region: r.allocation as usize,
            offset: r.offset,
            page_stride: r.page_stride,
            len: r.length,
        })
        .collect()
}

fn device_error(field: &str, e: DeviceError) -> ApiError {
    match e {
        DeviceError::Invalid { field: f, reason } => {
            ApiError::invalid(format!("{field}.{f}"), reason)
        }
        DeviceError::Unavailable(m) => ApiError::FailedPrecondition(m),
        DeviceError::Copy(m) => ApiError::Internal(m),
        e @ DeviceError::Fenced => ApiError::Internal(e.to_string()),
    }
}
