//! Hash maps and sets keyed by [`PageKey`], with a hasher made for them, and [`KeyTable`]
//! for slots whose keys are stored elsewhere.
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

/// Slot numbers found by page key, where each slot's key lives in the caller's own array
/// (the L2 index's entries). Lookups and removals take `key_of`, which gives the key stored
/// for a slot (compared when a cell's tag matches); inserts need no key but the new one, since
/// a cell's tag alone places it.
///
/// An open-addressing table of 8-byte cells, each a slot number and a 32-bit tag from the
/// key's hash, probed linearly from a home cell that the tag picks, at most 3/4 full, deleted
/// by backward shift (no tombstones). One cache line answers a probe, and the key itself is
/// compared only when the tag matches: at 10 million pages a lookup or removal costs one
/// random memory access, where a SwissTable costs two dependent ones (its control bytes and
/// its slots live in separate arrays), and nothing stores a key twice. 10.7–16 bytes a slot.
#[derive(Clone, Debug)]
pub struct KeyTable {
    /// 0 when empty, else `tag << 32 | (slot + 1)`.
    cells: Vec<u64>,
    /// `64 - log2(cells.len())`: the home cell is the top bits of the tag times a constant.
    shift: u32,
    len: usize,
    hasher: BuildKeyHasher,
    /// Bits of the hash kept as the tag: all of them, but tests keep few to force collisions.
    tag_mask: u32,
}

/// 2^64 / φ: spreads any tag's bits over the home cell's index.
const FIB: u64 = 0x9E37_79B9_7F4A_7C15;

impl KeyTable {
    /// An empty table with room for `n` slots before it grows.
    pub fn with_capacity(n: usize) -> Self {
        let cells = (n.saturating_mul(4) / 3 + 1).max(8).next_power_of_two();
        Self {
            cells: vec![0; cells],
            shift: 64 - cells.trailing_zeros(),
            len: 0,
            hasher: BuildKeyHasher::default(),
            tag_mask: u32::MAX,
        }
    }

    /// Slots in the table.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn tag(&self, key: &PageKey) -> u32 {
        self.hasher.hash_one(key) as u32 & self.tag_mask
    }

    fn home(&self, tag: u32) -> usize {
        (u64::from(tag).wrapping_mul(FIB) >> self.shift) as usize
    }

    fn mask(&self) -> usize {
        self.cells.len() - 1
    }

    /// The cell holding `key`.
    fn find(&self, key: &PageKey, key_of: impl Fn(u32) -> PageKey) -> Option<usize> {
        let tag = self.tag(key);
        let mut i = self.home(tag);
        loop {
            let c = self.cells[i];
            if c == 0 {
                return None;
            }
            if (c >> 32) as u32 == tag && key_of(c as u32 - 1) == *key {
                return Some(i);
            }
            i = (i + 1) & self.mask();
        }
    }

    /// The slot holding `key`.
    pub fn get(&self, key: &PageKey, key_of: impl Fn(u32) -> PageKey) -> Option<u32> {
        self.find(key, key_of).map(|i| self.cells[i] as u32 - 1)
    }

    fn put(&mut self, cell: u64) {
        let mask = self.mask();
        let mut i = self.home((cell >> 32) as u32);
        while self.cells[i] != 0 {
            i = (i + 1) & mask;
        }
        self.cells[i] = cell;
    }

    /// Records that `slot` (below `u32::MAX`) holds `key`, which must not be in the table.
    pub fn insert(&mut self, key: &PageKey, slot: u32) {
        assert!(slot < u32::MAX, "slot {slot} out of range");
        if (self.len + 1) * 4 > self.cells.len() * 3 {
            let grown = vec![0; self.cells.len() * 2];
            let old = std::mem::replace(&mut self.cells, grown);
            self.shift -= 1;
            for c in old.into_iter().filter(|&c| c != 0) {
                self.put(c);
            }
        }
        self.put(u64::from(self.tag(key)) << 32 | u64::from(slot + 1));
        self.len += 1;
    }

    /// Forgets `key`; returns the slot it was in.
    pub fn remove(&mut self, key: &PageKey, key_of: impl Fn(u32) -> PageKey) -> Option<u32> {
        let i = self.find(key, key_of)?;
        let slot = self.cells[i] as u32 - 1;
        // Backward shift: pull later cells of the run into the hole unless that would put
        // them before their home cell.
        let mask = self.mask();
        let mut hole = i;
        let mut j = (i + 1) & mask;
        loop {
            let c = self.cells[j];
            if c == 0 {
                break;
            }
            let home = self.home((c >> 32) as u32);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.cells[hole] = c;
                hole = j;
            }
            j = (j + 1) & mask;
        }
        self.cells[hole] = 0;
        self.len -= 1;
        Some(slot)
    }

    /// Every slot, in no particular order.
    pub fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        self.cells
            .iter()
            .filter(|&&c| c != 0)
            .map(|&c| c as u32 - 1)
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
    fn a_key_table_finds_slots_through_the_callers_keys() {
        let keys: Vec<PageKey> = (0..5000).map(key).collect();
        let of = |s: u32| keys[s as usize];
        let mut t = KeyTable::with_capacity(4);
        for s in 0..5000 {
            t.insert(&keys[s as usize], s);
        }
        assert_eq!(t.len(), 5000);
        assert!((0..5000u32).all(|s| t.get(&keys[s as usize], of) == Some(s)));
        assert_eq!(t.get(&key(9999), of), None);
        assert_eq!(t.remove(&keys[17], of), Some(17));
        assert_eq!(
            (t.get(&keys[17], of), t.remove(&keys[17], of)),
            (None, None)
        );
        assert_eq!(t.slots().count(), 4999);
    }

    #[test]
    fn a_key_table_survives_churn_with_colliding_tags() {
        // A model check under inserts and removals in random order, in a table that starts
        // small enough to grow, with tags cut to 2 bits: 4 home cells and long runs that
        // wrap, so lookups must fall back to comparing keys and removals must shift runs.
        let keys: Vec<PageKey> = (0..400).map(key).collect();
        let of = |s: u32| keys[s as usize];
        let mut t = KeyTable::with_capacity(1);
        t.tag_mask = 3;
        let mut model = std::collections::BTreeSet::new();
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let s = (x % 400) as u32;
            if model.insert(s) {
                t.insert(&keys[s as usize], s);
            } else {
                assert_eq!(t.remove(&keys[s as usize], of), Some(s));
                model.remove(&s);
            }
            if x.is_multiple_of(97) {
                assert_eq!(t.len(), model.len());
                let mut got: Vec<u32> = t.slots().collect();
                got.sort_unstable();
                assert!(got.iter().eq(model.iter()));
                assert!(
                    (0..400u32)
                        .all(|s| (t.get(&keys[s as usize], of) == Some(s)) == model.contains(&s))
                );
            }
        }
    }

    #[test]
    fn maps_are_seeded_apart() {
        let (a, b) = (BuildKeyHasher::default(), BuildKeyHasher::default());
        assert_ne!(a.hash_one(key(1)), b.hash_one(key(1)));
    }
}
