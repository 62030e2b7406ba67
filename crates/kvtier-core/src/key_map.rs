//! Hash maps and sets keyed by [`PageKey`], with a hasher made for them.
//!
//! A page key is already a SHA-256 digest, so a map does not need SipHash (std's default) to
//! spread it: [`KeyHasher`] folds the key's four 64-bit words with two 64×64→128-bit
//! multiplies, about a nanosecond per key against SipHash's ~20 ns for 32 bytes. The words are
//! mixed with seeds drawn from the OS per map (through std's `RandomState`), because keys come
//! from clients: a client that picked keys sharing some bytes must not be able to pile them
//! into one bucket chain, and without the seeds it cannot tell which keys collide.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use crate::keys::PageKey;

/// A `HashMap` keyed by page keys.
pub type KeyMap<V> = HashMap<PageKey, V, BuildKeyHasher>;
/// A `HashSet` of page keys.
pub type KeySet = HashSet<PageKey, BuildKeyHasher>;

/// An empty [`KeyMap`] with room for `n` keys.
pub fn key_map_with_capacity<V>(n: usize) -> KeyMap<V> {
    HashMap::with_capacity_and_hasher(n, BuildKeyHasher::default())
}

/// Builds [`KeyHasher`]s with this map's seeds.
#[derive(Clone, Copy, Debug)]
pub struct BuildKeyHasher {
    seeds: [u64; 4],
}

impl Default for BuildKeyHasher {
    fn default() -> Self {
        // std seeds each RandomState from the OS's random source (once per thread, then
        // stepped), so hashing four fixed words with it gives four seeds nobody can predict.
        let rs = std::collections::hash_map::RandomState::new();
        let mut seeds = [0u64; 4];
        for (i, s) in seeds.iter_mut().enumerate() {
            *s = rs.hash_one(i as u64) | 1;
        }
        Self { seeds }
    }
}

impl BuildHasher for BuildKeyHasher {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher {
            seeds: self.seeds,
            acc: 0,
        }
    }
}

/// The hasher of [`KeyMap`]: see the module docs. Written for [`PageKey`] (32 bytes); other
/// input is folded 8 bytes at a time, so it stays a correct (if slower) hasher for anything.
#[derive(Clone, Debug)]
pub struct KeyHasher {
    seeds: [u64; 4],
    acc: u64,
}

/// 64×64→128-bit multiply, the halves folded together.
#[inline(always)]
fn fold_mul(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline(always)]
fn word(b: &[u8], i: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[i * 8..i * 8 + 8]);
    u64::from_le_bytes(w)
}

impl Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let s = self.seeds;
        if bytes.len() == 32 {
            let h = fold_mul(word(bytes, 0) ^ s[0], word(bytes, 1) ^ s[1])
                ^ fold_mul(word(bytes, 2) ^ s[2], word(bytes, 3) ^ s[3]);
            self.acc = fold_mul(self.acc ^ h, s[0] ^ s[3]);
            return;
        }
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.acc = fold_mul(self.acc ^ word(c, 0) ^ s[1], s[2]);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut w = [0u8; 8];
            w[..rest.len()].copy_from_slice(rest);
            self.acc = fold_mul(self.acc ^ u64::from_le_bytes(w) ^ s[1], s[3]);
        }
    }

    #[inline]
    fn write_usize(&mut self, n: usize) {
        // The length prefix std hashes before a slice: the same for every page key.
        self.acc ^= n as u64;
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> PageKey {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&i.to_le_bytes());
        PageKey(k)
    }

    #[test]
    fn equal_keys_hash_equal_and_maps_work() {
        let b = BuildKeyHasher::default();
        assert_eq!(b.hash_one(key(7)), b.hash_one(key(7)));
        let mut m: KeyMap<u64> = key_map_with_capacity(10);
        for i in 0..10_000 {
            m.insert(key(i), i);
        }
        assert!((0..10_000).all(|i| m[&key(i)] == i));
        assert_eq!(m.len(), 10_000);
    }

    #[test]
    fn keys_that_differ_in_one_word_spread_over_buckets() {
        // Keys a client made equal but for one word, in each word position: the low bits
        // (what picks a bucket) must still spread.
        let b = BuildKeyHasher::default();
        for word in 0..4 {
            let buckets: HashSet<u64> = (0..4096u64)
                .map(|i| {
                    let mut k = [0xabu8; 32];
                    k[word * 8..word * 8 + 8].copy_from_slice(&i.to_le_bytes());
                    b.hash_one(PageKey(k)) & 4095
                })
                .collect();
            // 4,096 balls in 4,096 bins fill ~63% of them when the hash is uniform.
            assert!(
                buckets.len() > 2300,
                "word {word}: {} buckets",
                buckets.len()
            );
        }
    }

    #[test]
    fn maps_are_seeded_apart() {
        let (a, b) = (BuildKeyHasher::default(), BuildKeyHasher::default());
        assert_ne!(a.hash_one(key(1)), b.hash_one(key(1)));
    }
}
