//! Eviction policies.
//!
//! A policy maps what is known about an entry ([`EntryMeta`]) to a [`Rank`]; the entry with the
//! lowest rank is evicted first. Ranks are computed only when an entry changes, and the cache
//! keeps its candidates in an ordered set, so choosing a victim is `O(log n)` for every policy.
//! Ties are broken by the cache (stably, by entry id).

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// What a policy may look at. Times are ticks of the owner's logical clock (strictly increasing
/// per operation), which orders events exactly and deterministically.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct EntryMeta {
    /// Tick of the last match or insert that touched the entry.
    pub last_access: u64,
    /// Tick at which the entry was created.
    pub created: u64,
    /// Number of matches that reached the entry.
    pub hits: u64,
    /// Caller-assigned priority; higher survives longer under [`PolicyKind::Priority`].
    pub priority: i32,
}

/// Eviction order: lower is evicted first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(pub u64, pub u64);

/// One eviction policy. Implementations are tiny and stateless beyond their parameters.
pub trait EvictionPolicy: Send + Sync + fmt::Debug {
    /// Which policy this is.
    fn kind(&self) -> PolicyKind;
    /// The entry's place in the eviction order.
    fn rank(&self, meta: &EntryMeta) -> Rank;
}

/// Least recently used first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lru;
/// Least frequently used first; ties by recency.
#[derive(Clone, Copy, Debug, Default)]
pub struct Lfu;
/// Oldest created first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fifo;
/// Most recently used first (for scans that will not come back).
#[derive(Clone, Copy, Debug, Default)]
pub struct Mru;
/// Newest created first.
#[derive(Clone, Copy, Debug, Default)]
pub struct Filo;
/// Lowest priority first; ties by recency.
#[derive(Clone, Copy, Debug, Default)]
pub struct Priority;
/// Segmented LRU: entries hit fewer than `protect_hits` times (probation) go before the
/// protected ones; LRU within each segment.
#[derive(Clone, Copy, Debug)]
pub struct Slru {
    /// Hits at which an entry moves to the protected segment.
    pub protect_hits: u64,
}

/// Default hit count at which [`Slru`] protects an entry.
pub const DEFAULT_SLRU_PROTECT_HITS: u64 = 2;

impl Default for Slru {
    fn default() -> Self {
        Self {
            protect_hits: DEFAULT_SLRU_PROTECT_HITS,
        }
    }
}

/// Maps an `i32` to a `u64` preserving order.
fn ordered_i32(p: i32) -> u64 {
    (i64::from(p) as u64) ^ (1 << 63)
}

impl EvictionPolicy for Lru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lru
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(m.last_access, 0)
    }
}

impl EvictionPolicy for Lfu {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Lfu
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(m.hits, m.last_access)
    }
}

impl EvictionPolicy for Fifo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Fifo
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(m.created, 0)
    }
}

impl EvictionPolicy for Mru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Mru
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(u64::MAX - m.last_access, 0)
    }
}

impl EvictionPolicy for Filo {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Filo
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(u64::MAX - m.created, 0)
    }
}

impl EvictionPolicy for Priority {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Priority
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(ordered_i32(m.priority), m.last_access)
    }
}

impl EvictionPolicy for Slru {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Slru
    }
    fn rank(&self, m: &EntryMeta) -> Rank {
        Rank(u64::from(m.hits >= self.protect_hits), m.last_access)
    }
}

/// The policies by name, as configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum PolicyKind {
    /// [`Lru`], the default.
    #[default]
    Lru,
    /// [`Lfu`].
    Lfu,
    /// [`Fifo`].
    Fifo,
    /// [`Mru`].
    Mru,
    /// [`Filo`].
    Filo,
    /// [`Priority`].
    Priority,
    /// [`Slru`] with the default protection threshold.
    Slru,
}

impl PolicyKind {
    /// Every policy.
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::Lru,
        PolicyKind::Lfu,
        PolicyKind::Fifo,
        PolicyKind::Mru,
        PolicyKind::Filo,
        PolicyKind::Priority,
        PolicyKind::Slru,
    ];

    /// The configured name.
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Lfu => "lfu",
            PolicyKind::Fifo => "fifo",
            PolicyKind::Mru => "mru",
            PolicyKind::Filo => "filo",
            PolicyKind::Priority => "priority",
            PolicyKind::Slru => "slru",
        }
    }

    /// The policy object.
    pub fn build(self) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru),
            PolicyKind::Lfu => Box::new(Lfu),
            PolicyKind::Fifo => Box::new(Fifo),
            PolicyKind::Mru => Box::new(Mru),
            PolicyKind::Filo => Box::new(Filo),
            PolicyKind::Priority => Box::new(Priority),
            PolicyKind::Slru => Box::new(Slru::default()),
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::InvalidField {
                field: "eviction_policy",
                reason: format!(
                    "unknown policy {s:?}; expected one of {}",
                    PolicyKind::ALL.map(PolicyKind::name).join(", ")
                ),
            })
    }
}

impl serde::Serialize for PolicyKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> serde::Deserialize<'de> for PolicyKind {
    /// A configured word; a bad one fails naming the choices.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let word = String::deserialize(d)?;
        word.parse().map_err(|e: Error| match e {
            Error::InvalidField { reason, .. } => serde::de::Error::custom(reason),
            other => serde::de::Error::custom(other),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(last_access: u64, created: u64, hits: u64, priority: i32) -> EntryMeta {
        EntryMeta {
            last_access,
            created,
            hits,
            priority,
        }
    }

    /// Sorts entries by a policy and returns their indices, first victim first.
    fn order(kind: PolicyKind, entries: &[EntryMeta]) -> Vec<usize> {
        let p = kind.build();
        assert_eq!(p.kind(), kind);
        let mut idx: Vec<usize> = (0..entries.len()).collect();
        idx.sort_by_key(|&i| (p.rank(&entries[i]), i));
        idx
    }

    #[test]
    fn each_policy_orders_as_documented() {
        // 0: old, created first, many hits, low priority
        // 1: recent, created second, one hit, high priority
        // 2: middle, created last, no hits, negative priority
        let e = [meta(10, 1, 5, 0), meta(30, 2, 1, 7), meta(20, 3, 0, -3)];
        assert_eq!(order(PolicyKind::Lru, &e), [0, 2, 1]);
        assert_eq!(order(PolicyKind::Mru, &e), [1, 2, 0]);
        assert_eq!(order(PolicyKind::Fifo, &e), [0, 1, 2]);
        assert_eq!(order(PolicyKind::Filo, &e), [2, 1, 0]);
        assert_eq!(order(PolicyKind::Lfu, &e), [2, 1, 0]);
        assert_eq!(order(PolicyKind::Priority, &e), [2, 0, 1]);
        // Probation (hits < 2): 1 and 2, by recency; then protected 0.
        assert_eq!(order(PolicyKind::Slru, &e), [2, 1, 0]);
    }

    #[test]
    fn priority_extremes_keep_order() {
        let e = [
            meta(1, 1, 0, i32::MAX),
            meta(1, 1, 0, i32::MIN),
            meta(1, 1, 0, 0),
        ];
        assert_eq!(order(PolicyKind::Priority, &e), [1, 2, 0]);
    }

    #[test]
    fn names_round_trip() {
        for k in PolicyKind::ALL {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        let err = "random".parse::<PolicyKind>().unwrap_err().to_string();
        assert!(
            err.contains("eviction_policy") && err.contains("slru"),
            "{err}"
        );
    }
}
