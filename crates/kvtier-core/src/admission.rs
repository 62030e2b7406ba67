//! Which pages L2 writes down to L3: the admission filter between the tiers
//! (`l3.admission`). Every time a pool stores a page (an engine computed it) or serves one
//! (a hit), the pool's filter is told, and it answers whether the page may go to L3:
//!
//! - `all`: every page (kvtier's behaviour before the filter).
//! - `seen_twice`: a page on its second sighting within the last one to two windows, as
//!   Dynamo's KVBM writes to disk only blocks it saw twice. A page seen once is declined:
//!   it stays in L2 while it fits and leaves it unwritten, counted.
//! - `tinylfu`: TinyLFU's frequency sketch (a count-min sketch of 4-bit counters behind a
//!   one-bit doorkeeper, every counter halved after ten windows of sightings): a page whose
//!   estimated sightings reach two. Unlike `seen_twice` it remembers pages seen often
//!   before the last two windows. TinyLFU in a cache compares the newcomer with the page it
//!   would push out; L3 does not say which page that is, so the filter compares with a fixed
//!   threshold instead.
//!
//! A window is a number of new pages sighted (`l3.admission_window`), about the pages L3
//! holds: a page seen again farther apart than that is as good as new, as L3 would have
//! evicted it by then anyway. Repeat sightings do not advance it. A window sized to L2 instead forgets a page long before it comes back: on
//! the Mooncake trace with a 1,024-page L2, that kept 4% of the reuse. A declined page seen
//! again while L2 still holds it is admitted then, and written.
//!
//! Page keys are SHA-256 outputs: their bytes 8..24 are two independent 64-bit hashes
//! (bytes 0..8 are a tenant's tag under tenancy, the same for all of a tenant's keys).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::PageKey;

/// The admission filter's kind (`l3.admission`). See the [module docs](self).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AdmissionKind {
    /// Every page goes to L3.
    #[default]
    All,
    /// A page goes on its second sighting within the last one to two windows.
    SeenTwice,
    /// A page goes once TinyLFU's sketch counts two sightings of it.
    TinyLfu,
}

/// The words configuration files and flags use, in the order error messages list them.
pub const ADMISSION_NAMES: [&str; 3] = ["all", "seen_twice", "tinylfu"];

impl AdmissionKind {
    /// The configuration word (also the `admission` label of metrics).
    pub fn name(self) -> &'static str {
        match self {
            Self::All => ADMISSION_NAMES[0],
            Self::SeenTwice => ADMISSION_NAMES[1],
            Self::TinyLfu => ADMISSION_NAMES[2],
        }
    }
}

impl fmt::Display for AdmissionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A word that names no admission filter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown admission filter {0:?}: expected one of all, seen_twice, tinylfu")]
pub struct UnknownAdmission(pub String);

impl FromStr for AdmissionKind {
    type Err = UnknownAdmission;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "all" => Ok(Self::All),
            "seen_twice" => Ok(Self::SeenTwice),
            "tinylfu" => Ok(Self::TinyLfu),
            other => Err(UnknownAdmission(other.to_string())),
        }
    }
}

impl Serialize for AdmissionKind {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for AdmissionKind {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let word = String::deserialize(d)?;
        word.parse().map_err(serde::de::Error::custom)
    }
}

/// The two hashes of a key (see the module docs).
fn hashes(key: &PageKey) -> (u64, u64) {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&key.0[8..16]);
    b.copy_from_slice(&key.0[16..24]);
    // Odd, so that the probes of one key never collapse onto one position.
    (u64::from_le_bytes(a), u64::from_le_bytes(b) | 1)
}

/// Probes per key, in the Bloom filters and the sketch's rows.
const PROBES: u64 = 4;

/// Smallest window: below it the filters' false positives and the sketch's collisions
/// decide more than the sightings.
pub const MIN_WINDOW: u64 = 1024;

/// A Bloom filter of about `10 × keys` bits (about 1% false positives at `keys` keys).
#[derive(Clone, Debug)]
struct Bloom {
    bits: Vec<u64>,
    mask: u64,
}

impl Bloom {
    fn new(keys: u64) -> Self {
        let bits = (keys.max(64) * 10).next_power_of_two();
        Self {
            bits: vec![0; (bits / 64) as usize],
            mask: bits - 1,
        }
    }

    /// Sets the key's bits; says whether they were all set already.
    fn insert(&mut self, (h1, h2): (u64, u64)) -> bool {
        let mut seen = true;
        for i in 0..PROBES {
            let bit = h1.wrapping_add(i.wrapping_mul(h2)) & self.mask;
            let (word, b) = ((bit / 64) as usize, 1u64 << (bit % 64));
            seen &= self.bits[word] & b != 0;
            self.bits[word] |= b;
        }
        seen
    }

    fn contains(&self, (h1, h2): (u64, u64)) -> bool {
        (0..PROBES).all(|i| {
            let bit = h1.wrapping_add(i.wrapping_mul(h2)) & self.mask;
            self.bits[(bit / 64) as usize] & (1u64 << (bit % 64)) != 0
        })
    }

    /// Forgets every key. A fresh allocation, not a fill: the kernel hands zeroed pages
    /// over lazily, where writing zeros over a large filter first faults every page in (1.25 s
    /// under kvtierd's state lock at the largest window, in review).
    fn clear(&mut self) {
        self.bits = vec![0; self.bits.len()];
    }
}

/// A count-min sketch of 4-bit counters (two per byte), `PROBES` rows of `width` each.
#[derive(Clone, Debug)]
struct CountMin {
    counters: Vec<u8>,
    mask: u64,
}

impl CountMin {
    fn new(keys: u64) -> Self {
        let width = keys.max(64).next_power_of_two();
        Self {
            counters: vec![0; (width * PROBES / 2) as usize],
            mask: width - 1,
        }
    }

    fn positions(&self, (h1, h2): (u64, u64)) -> [u64; PROBES as usize] {
        let width = self.mask + 1;
        std::array::from_fn(|i| {
            let i = i as u64;
            i * width + (h1.wrapping_add(i.wrapping_mul(h2)).rotate_left(17) & self.mask)
        })
    }

    fn get(&self, pos: u64) -> u8 {
        let byte = self.counters[(pos / 2) as usize];
        if pos.is_multiple_of(2) {
            byte & 0x0f
        } else {
            byte >> 4
        }
    }

    fn set(&mut self, pos: u64, v: u8) {
        let byte = &mut self.counters[(pos / 2) as usize];
        *byte = if pos.is_multiple_of(2) {
            (*byte & 0xf0) | v
        } else {
            (*byte & 0x0f) | (v << 4)
        };
    }

    fn estimate(&self, h: (u64, u64)) -> u8 {
        self.positions(h)
            .into_iter()
            .map(|p| self.get(p))
            .min()
            .unwrap_or(0)
    }

    /// Counts one more sighting (conservatively: only the counters at the minimum grow).
    fn increment(&mut self, h: (u64, u64)) {
        let pos = self.positions(h);
        let min = pos.iter().map(|&p| self.get(p)).min().unwrap_or(0);
        if min == 15 {
            return;
        }
        for p in pos {
            if self.get(p) == min {
                self.set(p, min + 1);
            }
        }
    }

    /// Halves every counter (TinyLFU's aging).
    fn halve(&mut self) {
        for byte in &mut self.counters {
            *byte = (*byte >> 1) & 0x77;
        }
    }
}

#[derive(Clone, Debug)]
enum Filter {
    All,
    SeenTwice { current: Bloom, previous: Bloom },
    TinyLfu { doorkeeper: Bloom, sketch: CountMin },
}

/// One pool's admission filter. See the [module docs](self).
#[derive(Clone, Debug)]
pub struct Admission {
    kind: AdmissionKind,
    filter: Filter,
    /// New pages per window.
    window: u64,
    /// New pages sighted since the last rotation (`seen_twice`) or halving (`tinylfu`).
    sightings: u64,
}

/// Windows of sightings between two halvings of TinyLFU's counters.
const TINYLFU_WINDOWS: u64 = 10;

impl Admission {
    /// A filter remembering sightings over windows of `window` new pages (at least
    /// [`MIN_WINDOW`]). Its memory: none for `all`; two Bloom filters of `10 × window` bits
    /// rounded up to a power of two for `seen_twice`; one such Bloom filter and four rows of
    /// `window` (rounded up) 4-bit counters for `tinylfu`. Either is 4 bytes per page of a
    /// window that is a power of two (up to 5 and 6.5 bytes otherwise).
    pub fn new(kind: AdmissionKind, window: u64) -> Self {
        let window = window.max(MIN_WINDOW);
        let filter = match kind {
            AdmissionKind::All => Filter::All,
            AdmissionKind::SeenTwice => Filter::SeenTwice {
                current: Bloom::new(window),
                previous: Bloom::new(window),
            },
            AdmissionKind::TinyLfu => Filter::TinyLfu {
                doorkeeper: Bloom::new(window),
                sketch: CountMin::new(window),
            },
        };
        Self {
            kind,
            filter,
            window,
            sightings: 0,
        }
    }

    /// Its kind.
    pub fn kind(&self) -> AdmissionKind {
        self.kind
    }

    /// Records one sighting of `key` (the pool stored it, or served it) and says whether the
    /// page may go to L3 now.
    pub fn admit(&mut self, key: &PageKey) -> bool {
        let h = hashes(key);
        match &mut self.filter {
            Filter::All => true,
            Filter::SeenTwice { current, previous } => {
                let seen = current.insert(h) || previous.contains(h);
                // The window counts pages, not repeats: one hot page seen over and over (a
                // shared system prompt, a tenant's loop) must not make the filter forget
                // everyone else's first sightings.
                if !seen {
                    self.sightings += 1;
                }
                if self.sightings >= self.window {
                    std::mem::swap(current, previous);
                    current.clear();
                    self.sightings = 0;
                }
                seen
            }
            Filter::TinyLfu { doorkeeper, sketch } => {
                // The first sighting only sets the doorkeeper's bits; later ones count. The
                // doorkeeper is cleared every window of new pages, the counters halved every
                // ten.
                let new = !doorkeeper.insert(h);
                if new {
                    self.sightings += 1;
                } else {
                    sketch.increment(h);
                }
                let estimate = sketch.estimate(h) + 1;
                if new && self.sightings.is_multiple_of(self.window) {
                    doorkeeper.clear();
                }
                if self.sightings >= self.window * TINYLFU_WINDOWS {
                    sketch.halve();
                    self.sightings = 0;
                }
                estimate >= 2
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn key(i: u64) -> PageKey {
        use sha2::{Digest, Sha256};
        PageKey(Sha256::digest(i.to_le_bytes()).into())
    }

    #[test]
    fn words_round_trip_and_bad_words_list_the_choices() {
        for name in ADMISSION_NAMES {
            let k: AdmissionKind = name.parse().unwrap();
            assert_eq!(k.name(), name);
            assert_eq!(k.to_string(), name);
        }
        let e = "twice".parse::<AdmissionKind>().unwrap_err().to_string();
        assert!(e.contains("twice") && e.contains("seen_twice"), "{e}");
    }

    #[test]
    fn all_admits_every_page_at_once() {
        let mut a = Admission::new(AdmissionKind::All, MIN_WINDOW);
        assert!((0..1000).all(|i| a.admit(&key(i))));
    }

    #[test]
    fn each_filter_declines_a_first_sighting_and_admits_the_second() {
        for kind in [AdmissionKind::SeenTwice, AdmissionKind::TinyLfu] {
            let mut a = Admission::new(kind, 2 * MIN_WINDOW);
            let first = (0..500).filter(|&i| a.admit(&key(i))).count();
            // False positives of the Bloom filters only: about 1%.
            assert!(
                first <= 10,
                "{kind}: {first} of 500 first sightings admitted"
            );
            let second = (0..500).filter(|&i| a.admit(&key(i))).count();
            assert_eq!(second, 500, "{kind}");
        }
    }

    #[test]
    fn seen_twice_forgets_after_two_windows_and_tinylfu_remembers_the_frequent() {
        let w = MIN_WINDOW;
        let (mut twice, mut lfu) = (
            Admission::new(AdmissionKind::SeenTwice, w),
            Admission::new(AdmissionKind::TinyLfu, w),
        );
        // Page 0 is seen five times, then three windows of other pages.
        for _ in 0..5 {
            twice.admit(&key(0));
            lfu.admit(&key(0));
        }
        for i in 1..=3 * w {
            twice.admit(&key(i));
            lfu.admit(&key(i));
        }
        assert!(!twice.admit(&key(0)), "seen_twice still remembers page 0");
        assert!(lfu.admit(&key(0)), "tinylfu forgot a page seen five times");
        // A page seen once is new again a window later under tinylfu (the doorkeeper is
        // cleared), and two windows later under seen_twice.
        let (mut twice, mut lfu) = (
            Admission::new(AdmissionKind::SeenTwice, w),
            Admission::new(AdmissionKind::TinyLfu, w),
        );
        twice.admit(&key(0));
        lfu.admit(&key(0));
        for i in 1..=2 * w {
            twice.admit(&key(i + 100_000));
            lfu.admit(&key(i + 100_000));
        }
        assert!(
            !lfu.admit(&key(0)),
            "tinylfu admitted a page seen once, a window ago"
        );
        assert!(
            !twice.admit(&key(0)),
            "seen_twice admitted a page seen once, two windows ago"
        );
        // Within a window, both remember.
        let mut twice = Admission::new(AdmissionKind::SeenTwice, w);
        twice.admit(&key(0));
        for i in 1..w / 2 {
            twice.admit(&key(i + 100_000));
        }
        assert!(twice.admit(&key(0)));
    }

    #[test]
    fn a_page_seen_over_and_over_does_not_make_the_filters_forget_the_others() {
        // Review finding: one hot page rotated the window, and every other page's first
        // sighting was forgotten before its second.
        for kind in [AdmissionKind::SeenTwice, AdmissionKind::TinyLfu] {
            let mut a = Admission::new(kind, MIN_WINDOW);
            a.admit(&key(1));
            for _ in 0..4 * MIN_WINDOW {
                a.admit(&key(2));
            }
            assert!(a.admit(&key(1)), "{kind}: page 1 forgotten");
        }
    }

    #[test]
    fn the_sketch_saturates_and_halves_without_carrying_into_a_neighbour() {
        let mut cm = CountMin::new(64);
        let h = hashes(&key(7));
        for _ in 0..40 {
            cm.increment(h);
        }
        assert_eq!(cm.estimate(h), 15);
        cm.halve();
        assert_eq!(cm.estimate(h), 7);
        assert_eq!(cm.estimate(hashes(&key(8))), 0);
    }
}
