//! When a tier copies a page down to the tier below: the one write policy that both the agent
//! (device → L2 backups) and kvtierd (L2 → L3 writes) follow.
//!
//! Every policy keeps the same promise: **a page is in the tier below before its slot in this
//! tier is reused** ([`WritePolicy::copied_below_before_reuse`]). A computed page therefore
//! leaves the system only when the tier below refuses it (full of pinned pages, down, unreachable), and
//! that is counted with its reason by the caller. The policies differ only in how *early* the
//! copy is made:
//!
//! | policy | copied early when | else |
//! |---|---|---|
//! | `write_through` | stored in this tier ([`WritePolicy::on_store`]) | before eviction |
//! | `write_through_selective` | its hit count reaches the threshold ([`WritePolicy::on_hit`]) | before eviction |
//! | `write_back` | never | before eviction |
//!
//! Early copies make a page visible to the rest of the node (other workers, other nodes
//! through L3) sooner and make eviction cheap; late copies save bandwidth for pages nobody
//! asks for again. Adding a policy is a variant here and its answers to these three methods.
//!
//! Configuration files name a policy by its word (`"write_through_selective"`); the threshold
//! is a separate key, applied with [`WritePolicy::with_threshold`].

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Hits at which `write_through_selective` copies a page when no threshold is given.
pub const DEFAULT_WRITE_THRESHOLD: u64 = 2;

/// When pages are copied to the tier below. See the [module docs](self).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// Copy every page as soon as this tier stores it.
    #[default]
    WriteThrough,
    /// Copy a page once it has been hit `threshold` times (and before eviction otherwise).
    WriteThroughSelective {
        /// Hits that make a page worth copying early (at least 1).
        threshold: u64,
    },
    /// Copy a page only when this tier evicts it.
    WriteBack,
}

/// The words configuration files and flags use, in the order error messages list them.
pub const WRITE_POLICY_NAMES: [&str; 3] =
    ["write_through", "write_through_selective", "write_back"];

impl WritePolicy {
    /// The configuration word (also the `policy` label of metrics).
    pub fn name(self) -> &'static str {
        match self {
            Self::WriteThrough => WRITE_POLICY_NAMES[0],
            Self::WriteThroughSelective { .. } => WRITE_POLICY_NAMES[1],
            Self::WriteBack => WRITE_POLICY_NAMES[2],
        }
    }

    /// The same policy with `threshold` hits for `write_through_selective` (others ignore
    /// it).
    pub fn with_threshold(self, threshold: u64) -> Self {
        match self {
            Self::WriteThroughSelective { .. } => Self::WriteThroughSelective { threshold },
            other => other,
        }
    }

    /// Copy a page down as soon as this tier has stored it (the agent: on insert; kvtierd: on
    /// commit)?
    pub fn on_store(self) -> bool {
        matches!(self, Self::WriteThrough)
    }

    /// Copy a page down now that it has been hit `hits` times (the agent: on a device match;
    /// kvtierd: on an acquire)? Only pages not copied yet are asked about.
    pub fn on_hit(self, hits: u64) -> bool {
        match self {
            Self::WriteThroughSelective { threshold } => hits >= threshold,
            Self::WriteThrough | Self::WriteBack => false,
        }
    }

    /// An engine that keeps its own prefix cache (the agent's engine-cache mode) saves a
    /// page it computed when the policy copies every stored page, or when the page's prompt
    /// has been looked up `lookups` times (write_through_selective's threshold).
    pub fn saves_looked_up(self, lookups: u64) -> bool {
        self.on_store() || self.on_hit(lookups)
    }

    /// Does the policy decide by how often a page was asked for (so lookups must be
    /// counted)?
    pub fn counts_hits(self) -> bool {
        !self.on_store() && self.on_hit(u64::MAX)
    }

    /// Does the policy copy pages while this tier still keeps them (on store, or once hot),
    /// not only when it evicts them? A tier that never hears of its own evictions (an
    /// engine's prefix cache, the agent's engine-cache mode) needs one that does, or it would
    /// never save anything.
    pub fn copies_while_held(self) -> bool {
        self.on_store() || self.on_hit(u64::MAX)
    }

    /// Must a page be in the tier below before its slot here is reused? Every policy says
    /// yes: that is what keeps computed pages from being lost to load. Eviction asks this and
    /// copies (or waits for the copy) first; only when the tier below refuses does it give
    /// the page up, counted with the reason.
    pub fn copied_below_before_reuse(self) -> bool {
        match self {
            Self::WriteThrough | Self::WriteThroughSelective { .. } | Self::WriteBack => true,
        }
    }
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A word that names no write policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown write policy {0:?}: expected one of write_through, write_through_selective, write_back"
)]
pub struct UnknownWritePolicy(pub String);

impl FromStr for WritePolicy {
    type Err = UnknownWritePolicy;

    /// Parses a configuration word; `write_through_selective` gets
    /// [`DEFAULT_WRITE_THRESHOLD`].
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "write_through" => Ok(Self::WriteThrough),
            "write_through_selective" => Ok(Self::WriteThroughSelective {
                threshold: DEFAULT_WRITE_THRESHOLD,
            }),
            "write_back" => Ok(Self::WriteBack),
            other => Err(UnknownWritePolicy(other.to_string())),
        }
    }
}

impl Serialize for WritePolicy {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for WritePolicy {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let word = String::deserialize(d)?;
        word.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip_and_bad_words_list_the_choices() {
        for name in WRITE_POLICY_NAMES {
            let p: WritePolicy = name.parse().unwrap();
            assert_eq!(p.name(), name);
            assert_eq!(p.to_string(), name);
        }
        let e = "sometimes".parse::<WritePolicy>().unwrap_err().to_string();
        assert!(e.contains("sometimes") && e.contains("write_back"), "{e}");
    }

    #[test]
    fn an_engine_cache_saves_per_policy_and_only_selective_counts_lookups() {
        let sel = WritePolicy::WriteThroughSelective { threshold: 2 };
        assert!(!sel.saves_looked_up(1) && sel.saves_looked_up(2));
        assert!(sel.counts_hits());
        assert!(WritePolicy::WriteThrough.saves_looked_up(0));
        assert!(!WritePolicy::WriteThrough.counts_hits());
        // write_back is refused for engine caches; it would save nothing.
        assert!(!WritePolicy::WriteBack.copies_while_held());
        assert!(WritePolicy::WriteThrough.copies_while_held() && sel.copies_while_held());
        assert!(!WritePolicy::WriteBack.saves_looked_up(u64::MAX));
        assert!(!WritePolicy::WriteBack.counts_hits());
    }

    #[test]
    fn each_policy_decides_when_to_copy() {
        let wt = WritePolicy::WriteThrough;
        let sel = WritePolicy::WriteBack.with_threshold(3);
        assert_eq!(
            sel,
            WritePolicy::WriteBack,
            "only selective takes a threshold"
        );
        let sel = "write_through_selective"
            .parse::<WritePolicy>()
            .unwrap()
            .with_threshold(3);
        let wb = WritePolicy::WriteBack;
        assert!(wt.on_store() && !sel.on_store() && !wb.on_store());
        assert!(!wt.on_hit(100) && !wb.on_hit(100));
        assert!(!sel.on_hit(2) && sel.on_hit(3) && sel.on_hit(4));
        for p in [wt, sel, wb] {
            assert!(
                p.copied_below_before_reuse(),
                "{p}: nothing computed may be lost to load"
            );
        }
    }
}
