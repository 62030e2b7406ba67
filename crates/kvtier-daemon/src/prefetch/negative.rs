//! The negative cache: keys whose L3 read failed a moment ago, so a stale `exists` does not
//! send prefetches (or lookups) after them again and again until the entry expires.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvtier_core::{LayoutFingerprint, PageKey};

/// Keys whose L3 read failed recently, per layout class.
#[derive(Debug)]
pub struct NegativeCache {
    until: HashMap<(LayoutFingerprint, PageKey), Instant>,
    ttl: Duration,
    capacity: usize,
}

impl NegativeCache {
    /// Remembers keys for `ttl`, at most `capacity` at once.
    pub fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            until: HashMap::new(),
            ttl,
            capacity,
        }
    }

    /// Remembers that `key` just failed.
    pub fn insert(&mut self, fp: LayoutFingerprint, key: PageKey, now: Instant) {
        if self.ttl.is_zero() {
            return;
        }
        if self.until.len() >= self.capacity {
            self.until.retain(|_, t| *t > now);
            if self.until.len() >= self.capacity {
                // Still full of live entries: forget them all rather than grow.
                self.until.clear();
            }
        }
        self.until.insert((fp, key), now + self.ttl);
    }

    /// The index of the first of `keys` remembered as failed (`keys.len()` if none).
    pub fn first(&mut self, fp: LayoutFingerprint, keys: &[PageKey], now: Instant) -> usize {
        if self.until.is_empty() {
            return keys.len();
        }
        for (i, k) in keys.iter().enumerate() {
            if let Some(&t) = self.until.get(&(fp, *k)) {
                if t > now {
                    return i;
                }
                self.until.remove(&(fp, *k));
            }
        }
        keys.len()
    }

    /// Whether `key` is remembered as failed.
    pub fn contains(&mut self, fp: LayoutFingerprint, key: &PageKey, now: Instant) -> bool {
        self.first(fp, std::slice::from_ref(key), now) == 0
    }

    /// Keys remembered (some may have expired).
    pub fn len(&self) -> usize {
        self.until.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.until.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negative_cache_forgets_after_its_ttl_and_stays_bounded() {
        let fp = LayoutFingerprint([1; 16]);
        let keys: Vec<PageKey> = (0..4u8).map(|i| PageKey([i; 32])).collect();
        let mut n = NegativeCache::new(Duration::from_millis(50), 2);
        let t0 = Instant::now();
        assert_eq!(n.first(fp, &keys, t0), 4);
        n.insert(fp, keys[2], t0);
        assert_eq!(n.first(fp, &keys, t0), 2);
        // Another layout's key is a different key.
        assert_eq!(n.first(LayoutFingerprint([2; 16]), &keys, t0), 4);
        // Expired: usable again, and dropped.
        assert_eq!(n.first(fp, &keys, t0 + Duration::from_millis(60)), 4);
        assert!(n.is_empty());
        n.insert(fp, keys[0], t0);
        n.insert(fp, keys[1], t0);
        n.insert(fp, keys[3], t0);
        assert!(n.len() <= 2, "capacity exceeded: {}", n.len());
        assert_eq!(n.first(fp, &keys[3..], t0), 0);
        // A zero TTL turns it off.
        let mut off = NegativeCache::new(Duration::ZERO, 2);
        off.insert(fp, keys[0], t0);
        assert_eq!(off.first(fp, &keys, t0), 4);
    }
}
