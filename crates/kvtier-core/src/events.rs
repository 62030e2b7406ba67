//! Events about what a kvtierd's L2 holds, as its `WatchEvents` stream carries them
//! (docs/routing.md): kvtierd publishes them (`kvtier-daemon`'s `events.rs`), and
//! `kvtier-client` reads them.

use crate::tenant::TenantTag;
use crate::{LayoutFingerprint, PageKey};

/// What happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// `key` became readable, after `parent` when that page is held.
    Stored {
        /// The page.
        key: PageKey,
        /// The page before it.
        parent: Option<PageKey>,
    },
    /// `key` left.
    Removed {
        /// The page.
        key: PageKey,
    },
    /// Every page of the event's layout (every layout when it has none) left: of one
    /// tenant's (its tag: a tenant's own pool went) or, with none, of every tenant's.
    Cleared {
        /// The tenant whose pages left; `None`: every tenant's.
        tenant: Option<TenantTag>,
    },
    /// The subscriber must forget this node's pages: a snapshot follows.
    Resync,
}

/// Which tier an event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EventTier {
    /// kvtierd's shared host memory.
    L2Host,
    /// Its storage tier, as far as this kvtierd knows: pages its writes landed there, pages
    /// its backend evicted, an operator's clear.
    L3Storage,
}

/// One event of the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    /// From 1 in publication order; 0 for a snapshot's pages.
    pub seq: u64,
    /// When it was published (or the snapshot taken), in ns since the Unix epoch.
    pub unix_nanos: u64,
    /// What happened.
    pub kind: EventKind,
    /// The pool's layout; `None` only for a [`EventKind::Cleared`] of every pool or a
    /// [`EventKind::Resync`].
    pub layout: Option<LayoutFingerprint>,
    /// The tier it is about (a [`EventKind::Resync`]: every tier).
    pub tier: EventTier,
}

impl Event {
    /// Whether a subscriber limited to `tenant`'s pages (`None`: every page) sees it.
    pub fn visible_to(&self, tenant: Option<TenantTag>) -> bool {
        match (tenant, self.kind) {
            (None, _) => true,
            (Some(t), EventKind::Stored { key, .. } | EventKind::Removed { key }) => {
                TenantTag::of(&key) == t
            }
            (Some(t), EventKind::Cleared { tenant }) => tenant.is_none_or(|c| c == t),
            (Some(_), EventKind::Resync) => true,
        }
    }
}
