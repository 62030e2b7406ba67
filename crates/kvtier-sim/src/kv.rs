//! Deterministic KV: the bytes of a page, for every layer and K|V, are a pure function of its
//! page key (which is itself a function of the whole token prefix up to and including the
//! page). So "what recomputing this page would give" is known anywhere, and every page an
//! engine receives from any tier can be checked byte for byte.
//!
//! The simulated engine's pool is CPU shared memory (the agent's cpu device maps the file) or,
//! with `--device cuda`, GPU memory: one allocation per (layer, K|V) buffer, registered with
//! the agent by CUDA IPC handle, so the agent's cuda device (its copy methods) moves every page.

use parking_lot::Mutex;

use anyhow::{Context, Result};
use kvtier_client::PoolMemory;
use kvtier_core::{DevicePool, KvPart, Layout, PageKey};
use kvtier_device::cuda::DeviceBuffer;
use kvtier_shm::ShmRegion;

/// Fills `out` with the bytes of run `run` of the page with key `key` (SplitMix64 stream seeded
/// by the key and the run index; 8 bytes per step, so generating is about as fast as memcpy).
pub fn fill_run(key: &PageKey, run: usize, out: &mut [u8]) {
    let mut seed = u64::from_le_bytes([
        key.0[0], key.0[1], key.0[2], key.0[3], key.0[4], key.0[5], key.0[6], key.0[7],
    ]) ^ (run as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
    let mut next = || {
        seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut chunks = out.chunks_exact_mut(8);
    for c in &mut chunks {
        c.copy_from_slice(&next().to_le_bytes());
    }
    let rest = chunks.into_remainder();
    let tail = next().to_le_bytes();
    rest.copy_from_slice(&tail[..rest.len()]);
}

/// Which memory the simulated engine's pool is in (`--device`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SimDevice {
    /// A memfd handed to the agent as a descriptor (the agent's cpu device).
    #[default]
    Cpu,
    /// GPU 0's memory, by CUDA IPC handle (the agent's cuda device).
    Cuda,
}

enum Memory {
    Cpu { region: ShmRegion },
    // One allocation per buffer; each copy in or out takes its buffer's lock (its stream).
    Cuda(Vec<Mutex<DeviceBuffer>>),
}

/// An engine's KV pool, with "compute" and "check" of pages.
pub struct KvPool {
    /// Geometry.
    pub pool: DevicePool,
    mem: Memory,
}

impl std::fmt::Debug for KvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.mem {
            Memory::Cpu { .. } => "cpu",
            Memory::Cuda(_) => "cuda",
        };
        f.debug_struct("KvPool").field("memory", &kind).finish()
    }
}

impl KvPool {
    /// A pool on `device`; a cpu pool is a memfd named `name`.
    pub fn new(pool: DevicePool, device: SimDevice, name: &str) -> Result<Self> {
        let mem = match device {
            SimDevice::Cpu => Memory::Cpu {
                region: ShmRegion::memfd(name, pool.total_bytes())
                    .with_context(|| format!("creating the KV pool {name}"))?,
            },
            SimDevice::Cuda => Memory::Cuda(
                (0..pool.num_buffers())
                    .map(|b| {
                        DeviceBuffer::new(0, pool.buffer_bytes())
                            .map(Mutex::new)
                            .with_context(|| format!("allocating KV buffer {b} on GPU 0"))
                    })
                    .collect::<Result<_>>()?,
            ),
        };
        Ok(Self { pool, mem })
    }

    /// How the agent opens this pool (`RegisterPool`).
    pub fn memory(&self) -> Result<PoolMemory> {
        Ok(match &self.mem {
            Memory::Cpu { region } => PoolMemory::Cpu {
                fd: std::sync::Arc::new(
                    region
                        .fd()
                        .try_clone_to_owned()
                        .context("duplicating the KV pool's descriptor")?,
                ),
            },
            Memory::Cuda(buffers) => PoolMemory::Cuda {
                ordinal: 0,
                ipc_handles: buffers
                    .iter()
                    .map(|b| {
                        let b = b.lock();
                        b.ipc_handle().map(|h| h.to_vec())
                    })
                    .collect::<Result<_, _>>()
                    .context("exporting the KV buffers by CUDA IPC handle")?,
            },
        })
    }

    fn runs(layout: &Layout) -> impl Iterator<Item = (usize, KvPart)> + '_ {
        layout.runs()
    }

    /// (buffer, offset in it) of run `(layer, part)` of `page`.
    fn place(&self, page: u32, layer: usize, part: KvPart) -> (usize, usize) {
        // Callers only pass pages below num_pages and runs of the layout.
        match self.pool.run(page as usize, layer, part) {
            Ok(run) => (run.buffer, run.offset),
            Err(_) => (0, 0),
        }
    }

    fn write(&self, (buffer, offset): (usize, usize), bytes: &[u8]) -> bool {
        match &self.mem {
            Memory::Cpu { region, .. } => region
                .write(buffer * self.pool.buffer_bytes() + offset, bytes)
                .is_ok(),
            Memory::Cuda(b) => b[buffer].lock().write_at(offset, bytes).is_ok(),
        }
    }

    fn read(&self, (buffer, offset): (usize, usize), out: &mut [u8]) -> bool {
        match &self.mem {
            Memory::Cpu { region, .. } => region
                .read(buffer * self.pool.buffer_bytes() + offset, out)
                .is_ok(),
            Memory::Cuda(b) => b[buffer].lock().read_at(offset, out).is_ok(),
        }
    }

    /// Writes page `key`'s KV into device page `page`, as prefill would.
    pub fn compute(&self, page: u32, key: &PageKey, scratch: &mut Vec<u8>) {
        let layout = self.pool.layout();
        scratch.resize(layout.run_bytes(), 0);
        for (layer, part) in Self::runs(layout) {
            fill_run(key, layout.run_index(layer, part), scratch);
            // In range: `page` is a page of this pool; a failed write shows at the check.
            let _ = self.write(self.place(page, layer, part), scratch);
        }
    }

    /// Whether device page `page` holds exactly page `key`'s KV.
    pub fn check(
        &self,
        page: u32,
        key: &PageKey,
        scratch: &mut Vec<u8>,
        got: &mut Vec<u8>,
    ) -> bool {
        let layout = self.pool.layout();
        scratch.resize(layout.run_bytes(), 0);
        got.resize(layout.run_bytes(), 0);
        Self::runs(layout).all(|(layer, part)| {
            fill_run(key, layout.run_index(layer, part), scratch);
            self.read(self.place(page, layer, part), got) && got == scratch
        })
    }

    /// Overwrites device page `page` with garbage (a page being reused), so a tier that
    /// claims to have loaded it but did not is caught.
    pub fn scribble(&self, page: u32, scratch: &mut Vec<u8>) {
        let layout = self.pool.layout();
        scratch.clear();
        scratch.resize(layout.run_bytes(), 0xA5);
        for (layer, part) in Self::runs(layout) {
            let _ = self.write(self.place(page, layer, part), scratch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_differ_by_key_and_run_and_are_repeatable() {
        let (a, b) = (PageKey([1; 32]), PageKey([2; 32]));
        let mut x = vec![0u8; 100];
        let mut y = vec![0u8; 100];
        fill_run(&a, 0, &mut x);
        fill_run(&a, 0, &mut y);
        assert_eq!(x, y);
        fill_run(&a, 1, &mut y);
        assert_ne!(x, y);
        fill_run(&b, 0, &mut y);
        assert_ne!(x, y);
    }
}
