//! What the index tells the outside world: every page that became readable (committed,
//! landed from L3, adopted after a crash) and every readable page that left (evicted,
//! removed by the operator), in the order it happened. Pages being written were never
//! readable, so their reservations and aborts are not changes. kvtierd drains the log after
//! each locked section and publishes it as events (`kvtier-daemon`'s `events.rs`).

use super::{HostIndex, PageState};
use crate::PageKey;

/// One change to the pages the index holds ready.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IndexChange {
    /// `key` became readable, after `parent` in its prompt when that page is indexed.
    Stored {
        /// The page.
        key: PageKey,
        /// The page before it, when the index links it.
        parent: Option<PageKey>,
    },
    /// `key` is no longer held.
    Removed {
        /// The page.
        key: PageKey,
    },
}

impl HostIndex {
    /// Starts (or stops, dropping what was logged) recording [`IndexChange`]s. Off by
    /// default: a log nobody drains would only grow.
    pub fn record_changes(&mut self, on: bool) {
        self.changes = on.then(Vec::new);
    }

    /// The changes since the last call, oldest first.
    pub fn take_changes(&mut self) -> Vec<IndexChange> {
        match &mut self.changes {
            Some(log) => std::mem::take(log),
            None => Vec::new(),
        }
    }

    /// Whether changes are waiting to be taken.
    pub fn has_changes(&self) -> bool {
        self.changes.as_ref().is_some_and(|l| !l.is_empty())
    }

    /// Every ready page (`persisted`: only those L3 holds too, as this index knows: their
    /// writes landed) whose key `keep` keeps, with its indexed parent, as a
    /// [`SnapshotPages`]: what a reader that lost the log rebuilds from. The scan is all
    /// that is done here (it runs under the daemon's state lock); the ordering is the
    /// caller's, after the lock ([`SnapshotPages::in_order`]).
    pub fn snapshot_pages(
        &self,
        persisted: bool,
        keep: impl Fn(&PageKey) -> bool,
    ) -> SnapshotPages {
        SnapshotPages(
            self.entries
                .iter()
                .flatten()
                .filter(|e| {
                    e.state == PageState::Ready
                        && (!persisted || e.l3 == super::L3Mark::Persisted)
                        && keep(&e.key)
                })
                .map(|e| {
                    let parent = self.live(e.parent).map(|p| self.entry(p).key);
                    (e.created, e.key, parent)
                })
                .collect(),
        )
    }

    /// Logs that the page in `slot` became readable.
    pub(super) fn log_stored(&mut self, slot: u32) {
        if self.changes.is_none() {
            return;
        }
        let e = self.entry(slot);
        let (key, parent) = (e.key, self.live(e.parent).map(|p| self.entry(p).key));
        if let Some(log) = &mut self.changes {
            log.push(IndexChange::Stored { key, parent });
        }
    }

    /// Logs that readable page `key` left.
    pub(super) fn log_removed(&mut self, key: PageKey) {
        if let Some(log) = &mut self.changes {
            log.push(IndexChange::Removed { key });
        }
    }
}

/// Pages of a snapshot as the scan found them: (creation order, key, parent).
#[derive(Debug, Default)]
pub struct SnapshotPages(Vec<(u64, PageKey, Option<PageKey>)>);

impl SnapshotPages {
    /// Pages already in order (parents first), as a snapshot would list them.
    pub fn from_ordered(pages: Vec<(PageKey, Option<PageKey>)>) -> Self {
        Self((0u64..).zip(pages).map(|(i, (k, p))| (i, k, p)).collect())
    }

    /// How many.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pages with their parents, parents before their children: a child is created
    /// after the parent it links to, so creation order does it.
    pub fn in_order(mut self) -> Vec<(PageKey, Option<PageKey>)> {
        self.0.sort_unstable_by_key(|(created, ..)| *created);
        self.0.into_iter().map(|(_, k, p)| (k, p)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PolicyKind;
    use crate::host_index::Reserve;

    fn keys(r: std::ops::Range<u8>) -> Vec<PageKey> {
        r.map(|i| PageKey([i; 32])).collect()
    }

    fn stored(key: PageKey, parent: Option<PageKey>) -> IndexChange {
        IndexChange::Stored { key, parent }
    }

    #[test]
    fn only_readable_pages_are_changes_and_the_log_is_off_until_asked_for() {
        let mut ix = HostIndex::new(4, PolicyKind::Lru);
        let ks = keys(1..5);
        ix.reserve(1, None, &ks[..1]);
        ix.commit(1, &ks[..1]).unwrap();
        assert!(
            !ix.has_changes() && ix.take_changes().is_empty(),
            "off by default"
        );
        ix.record_changes(true);
        // Reserved, then aborted: never readable, so no change.
        ix.reserve(1, Some(ks[0]), &ks[1..3]);
        ix.abort(1, &ks[1..3]).unwrap();
        assert!(!ix.has_changes());
        // Committed: stored, each after its parent.
        ix.reserve(1, Some(ks[0]), &ks[1..4]);
        ix.commit(1, &ks[1..4]).unwrap();
        assert_eq!(
            ix.take_changes(),
            vec![
                stored(ks[1], Some(ks[0])),
                stored(ks[2], Some(ks[1])),
                stored(ks[3], Some(ks[2])),
            ]
        );
        assert!(ix.take_changes().is_empty(), "taken once");
        // A full pool evicts a leaf to make room: removed, then the new page stored.
        let other = keys(9..10);
        let (r, evicted) = ix.reserve(2, None, &other);
        assert!(matches!(r[0], Reserve::Reserved(_)), "{r:?}");
        ix.commit(2, &other).unwrap();
        assert_eq!(
            ix.take_changes(),
            vec![
                IndexChange::Removed { key: evicted[0] },
                stored(other[0], None)
            ]
        );
        // The operator's clear removes every idle page.
        ix.clear();
        let removed: Vec<_> = ix.take_changes();
        assert_eq!(removed.len(), 4, "{removed:?}");
        assert!(
            removed
                .iter()
                .all(|c| matches!(c, IndexChange::Removed { .. }))
        );
        ix.validate().unwrap();
    }

    #[test]
    fn pages_landed_pinned_and_adopted_are_stored_and_ready_pages_put_parents_first() {
        let mut ix = HostIndex::new(8, PolicyKind::Lru);
        ix.record_changes(true);
        let ks = keys(1..5);
        // Adopted after a crash, child-less first.
        assert!(ix.adopt(ks[0], None).is_some());
        // Landed from L3 by a prefetch: ready and pinned in one step.
        ix.reserve(7, Some(ks[0]), &ks[1..3]);
        ix.commit_pinned(7, &ks[1..3], true).unwrap();
        assert_eq!(
            ix.take_changes(),
            vec![
                stored(ks[0], None),
                stored(ks[1], Some(ks[0])),
                stored(ks[2], Some(ks[1])),
            ]
        );
        // A page being written is not ready.
        ix.reserve(7, Some(ks[2]), &ks[3..4]);
        assert_eq!(
            ix.snapshot_pages(false, |_| true).in_order(),
            vec![(ks[0], None), (ks[1], Some(ks[0])), (ks[2], Some(ks[1]))]
        );
        assert_eq!(
            ix.snapshot_pages(false, |k| *k == ks[1]).in_order(),
            vec![(ks[1], Some(ks[0]))]
        );
        ix.record_changes(false);
        ix.commit(7, &ks[3..4]).unwrap();
        assert!(ix.take_changes().is_empty(), "off again");
    }
}
