//! Match handles: the lease an engine holds on a matched prefix until it releases it.

/// Issues match handles: a counter through a keyed bijection of u64, so a run never hands out
/// one handle twice, while its handles look random and differ from every other run's. An
/// engine that kept a handle across an agent restart then gets "unknown" instead of releasing
/// a lock some other request of the new run holds.
pub(crate) struct HandleIds {
    key: u64,
    next: u64,
}

impl HandleIds {
    pub(crate) fn new() -> Self {
        use std::hash::{BuildHasher, Hasher};
        // std seeds RandomState from the OS's random source once per process.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(std::process::id() as u64);
        Self {
            key: h.finish(),
            next: 0,
        }
    }

    pub(crate) fn next(&mut self) -> u64 {
        loop {
            self.next = self.next.wrapping_add(1);
            // splitmix64's finalizer: a bijection of u64 (0 maps to 0 only).
            let mut z = self.next.wrapping_add(self.key);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            if z != 0 {
                return z;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_never_repeat_in_a_run_and_differ_between_runs() {
        let mut a = HandleIds::new();
        let mut b = HandleIds::new();
        let from_a: std::collections::HashSet<u64> = (0..100_000).map(|_| a.next()).collect();
        assert_eq!(from_a.len(), 100_000);
        assert!(!from_a.contains(&0));
        let from_b: Vec<u64> = (0..1_000).map(|_| b.next()).collect();
        assert!(from_b.iter().all(|h| !from_a.contains(h)));
        // Not a plain counter: consecutive handles are far apart.
        assert!(from_b.windows(2).all(|w| w[0].abs_diff(w[1]) > 1 << 20));
    }
}
