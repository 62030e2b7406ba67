//! The hit rate a cache of unbounded size could reach: of the pages requested within a
//! window, the share that had been requested before in it. Every distinct page's first
//! request is a miss no cache avoids, so the ceiling is `1 - distinct / requested`. The
//! distinct pages are counted by a HyperLogLog (16 KiB, about 0.8% standard error) over the
//! page keys, which are SHA-256 outputs already: the key's bytes 8..16 are its hash (bytes
//! 0..8 are a tenant's tag under tenancy, the same for all of a tenant's keys).
//!
//! The window is two generations: the ceiling covers the current one and the one before it
//! (between one and two windows of requests), so it never drops to nothing at a rotation.

use std::time::{Duration, Instant};

use crate::PageKey;

/// Register index bits: 2^14 registers of one byte.
const P: u32 = 14;
const M: usize = 1 << P;

/// A HyperLogLog of page keys.
#[derive(Clone)]
struct Sketch {
    registers: Box<[u8; M]>,
}

impl Sketch {
    fn new() -> Self {
        Self {
            registers: Box::new([0; M]),
        }
    }

    fn add(&mut self, key: &PageKey) {
        let mut b = [0u8; 8];
        b.copy_from_slice(&key.0[8..16]);
        let h = u64::from_le_bytes(b);
        let idx = (h >> (64 - P)) as usize;
        // The rank of the first 1 in the remaining bits (a sentinel bounds it).
        let rest = (h << P) | (1 << (P - 1));
        let rank = rest.leading_zeros() as u8 + 1;
        if self.registers[idx] < rank {
            self.registers[idx] = rank;
        }
    }

    /// The estimated number of distinct keys in `self` and `other` together.
    fn count_with(&self, other: &Sketch) -> f64 {
        let mut sum = 0.0;
        let mut zeros = 0usize;
        for (a, b) in self.registers.iter().zip(other.registers.iter()) {
            let r = (*a).max(*b);
            sum += 2f64.powi(-i32::from(r));
            if r == 0 {
                zeros += 1;
            }
        }
        let m = M as f64;
        let alpha = 0.7213 / (1.0 + 1.079 / m);
        let raw = alpha * m * m / sum;
        // Small ranges: linear counting over the empty registers.
        if raw <= 2.5 * m && zeros > 0 {
            m * (m / zeros as f64).ln()
        } else {
            raw
        }
    }
}

/// One generation: its pages requested and their sketch.
#[derive(Clone)]
struct Generation {
    requested: u64,
    sketch: Sketch,
}

impl Generation {
    fn new() -> Self {
        Self {
            requested: 0,
            sketch: Sketch::new(),
        }
    }
}

/// The hit-rate ceiling over a sliding window of requests.
pub struct HitCeiling {
    window: Duration,
    started: Instant,
    current: Generation,
    previous: Generation,
}

impl std::fmt::Debug for HitCeiling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HitCeiling")
            .field("window", &self.window)
            .field("requested", &self.requested())
            .finish_non_exhaustive()
    }
}

impl HitCeiling {
    /// A ceiling over windows of `window`, starting at `now`.
    pub fn new(window: Duration, now: Instant) -> Self {
        Self {
            window,
            started: now,
            current: Generation::new(),
            previous: Generation::new(),
        }
    }

    fn rotate(&mut self, now: Instant) {
        let age = now.saturating_duration_since(self.started);
        if age < self.window {
            return;
        }
        if age >= self.window * 2 {
            // Nothing requested for a whole window: both generations are stale.
            self.previous = Generation::new();
        } else {
            self.previous = std::mem::replace(&mut self.current, Generation::new());
        }
        self.current = Generation::new();
        self.started = now;
    }

    /// Counts a request for `keys` at `now`.
    pub fn observe(&mut self, keys: &[PageKey], now: Instant) {
        self.rotate(now);
        self.current.requested += keys.len() as u64;
        for k in keys {
            self.current.sketch.add(k);
        }
    }

    /// Pages requested in the window.
    pub fn requested(&self) -> u64 {
        self.current.requested + self.previous.requested
    }

    /// The ceiling at `now`: the share of the window's requested pages that had been
    /// requested before in it (0 with none requested).
    pub fn ratio(&mut self, now: Instant) -> f64 {
        self.rotate(now);
        let requested = self.requested();
        if requested == 0 {
            return 0.0;
        }
        let distinct = self
            .current
            .sketch
            .count_with(&self.previous.sketch)
            .min(requested as f64);
        (1.0 - distinct / requested as f64).clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Distinct keys as the hasher makes them (SHA-256 of an index).
    fn key(i: u64) -> PageKey {
        use sha2::Digest as _;
        PageKey(sha2::Sha256::digest(i.to_le_bytes()).into())
    }

    #[test]
    fn the_ceiling_is_the_share_of_requests_seen_before_within_a_percent() {
        let t0 = Instant::now();
        let mut c = HitCeiling::new(Duration::from_secs(60), t0);
        assert_eq!(c.ratio(t0), 0.0);
        // 20,000 distinct pages, each requested 4 times: 3 in 4 requests could hit.
        for _ in 0..4 {
            let keys: Vec<PageKey> = (0..20_000).map(key).collect();
            c.observe(&keys, t0);
        }
        let r = c.ratio(t0);
        assert!((r - 0.75).abs() < 0.01, "{r}");
        // All distinct: nothing could hit.
        let mut cold = HitCeiling::new(Duration::from_secs(60), t0);
        let keys: Vec<PageKey> = (100_000..150_000).map(key).collect();
        cold.observe(&keys, t0);
        assert!(cold.ratio(t0) < 0.02, "{}", cold.ratio(t0));
        // Few pages (linear counting): 10 pages twice each.
        let mut few = HitCeiling::new(Duration::from_secs(60), t0);
        let keys: Vec<PageKey> = (0..10).map(key).collect();
        few.observe(&keys, t0);
        few.observe(&keys, t0);
        assert!((few.ratio(t0) - 0.5).abs() < 0.01, "{}", few.ratio(t0));
    }

    #[test]
    fn the_window_slides_by_generations() {
        let t0 = Instant::now();
        let w = Duration::from_secs(60);
        let mut c = HitCeiling::new(w, t0);
        let a: Vec<PageKey> = (0..1000).map(key).collect();
        c.observe(&a, t0);
        // A window later the same pages are seen again: the previous generation counts.
        c.observe(&a, t0 + w);
        assert!((c.ratio(t0 + w) - 0.5).abs() < 0.01);
        // Another window on, the first generation has gone: a repeat of it looks new.
        let b: Vec<PageKey> = (5000..6000).map(key).collect();
        c.observe(&b, t0 + w * 2);
        assert!(
            (c.ratio(t0 + w * 2) - 0.0).abs() < 0.02,
            "{}",
            c.ratio(t0 + w * 2)
        );
        // Idle for two windows: nothing is left.
        assert_eq!(c.ratio(t0 + w * 5), 0.0);
        assert_eq!(c.requested(), 0);
    }
}
