//! Deterministic KV: the bytes of a page, for every layer and K|V, are a pure function of its
//! page key (which is itself a function of the whole token prefix up to and including the
//! page). So "what recomputing this page would give" is known anywhere, and every page an
//! engine receives from any tier can be checked byte for byte.

use kvtier_core::{DevicePool, KvPart, Layout, PageKey};
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

/// An engine's KV pool in CPU shared memory, with "compute" and "check" of pages.
#[derive(Debug)]
pub struct KvPool {
    /// Geometry.
    pub pool: DevicePool,
    /// The mapped pool file.
    pub region: ShmRegion,
}

impl KvPool {
    fn runs(layout: &Layout) -> impl Iterator<Item = (usize, KvPart)> + '_ {
        layout.runs()
    }

    fn offset(&self, page: u32, layer: usize, part: KvPart) -> (usize, usize) {
        // Callers only pass pages below num_pages and runs of the layout.
        match self.pool.run(page as usize, layer, part) {
            Ok(run) => (run.buffer * self.pool.buffer_bytes() + run.offset, run.len),
            Err(_) => (0, 0),
        }
    }

    /// Writes page `key`'s KV into device page `page`, as prefill would.
    pub fn compute(&self, page: u32, key: &PageKey, scratch: &mut Vec<u8>) {
        let layout = self.pool.layout();
        scratch.resize(layout.run_bytes(), 0);
        for (layer, part) in Self::runs(layout) {
            fill_run(key, layout.run_index(layer, part), scratch);
            let (at, _) = self.offset(page, layer, part);
            // In range: `page` is a page of this pool.
            let _ = self.region.write(at, scratch);
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
            let (at, _) = self.offset(page, layer, part);
            self.region.read(at, got).is_ok() && got == scratch
        })
    }

    /// Overwrites device page `page` with garbage (a page being reused), so a tier that
    /// claims to have loaded it but did not is caught.
    pub fn scribble(&self, page: u32, scratch: &mut Vec<u8>) {
        let layout = self.pool.layout();
        scratch.clear();
        scratch.resize(layout.run_bytes(), 0xA5);
        for (layer, part) in Self::runs(layout) {
            let (at, _) = self.offset(page, layer, part);
            let _ = self.region.write(at, scratch);
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
