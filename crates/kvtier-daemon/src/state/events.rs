//! The state's side of the event stream (`crate::events`): the pools' change logs drained
//! into the bus, and where a new subscriber starts.

use tokio::sync::broadcast;

use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::Removed;
use kvtier_storage::format::parse_object_name;

use super::HostState;
use crate::events::{EventBus, EventKind, EventMetrics, EventTier, First, Snapshot, Start};
use kvtier_core::TenantTag;

/// Where a new `WatchEvents` stream starts, and what it hears after.
pub struct Subscription {
    /// Its first events: the replay it resumes from, or a RESYNC and a snapshot.
    pub first: First,
    /// Why it starts from a snapshot (the resync metric's reason), if it does.
    pub resync: Option<&'static str>,
    /// What is published from now on.
    pub rx: broadcast::Receiver<std::sync::Arc<crate::events::Published>>,
}

impl HostState {
    /// Publishes what changed in every pool since the last call (`Shared::lock`'s guard
    /// calls it when it goes).
    pub fn publish_changes(&mut self) {
        // Events name a page's layout by its fingerprint (what a router computes from the
        // model), also for a tenant's own pool, whose key is derived from it.
        for pool in self.pools.values_mut() {
            if pool.index.has_changes() {
                let fp = pool.layout.fingerprint();
                self.events.publish(fp, pool.index.take_changes());
            }
        }
        let learned = self.l3.take_learned();
        if !learned.is_empty() {
            self.events.publish_l3(learned);
        }
    }

    /// This kvtierd's write of `key` (of layout `fp`, after `parent`) landed in L3.
    pub(super) fn l3_stored(
        &mut self,
        fp: LayoutFingerprint,
        key: PageKey,
        parent: Option<PageKey>,
    ) {
        self.l3.learn(Some(fp), EventKind::Stored { key, parent });
    }

    /// What L3's backend removed on its own (capacity or quota evictions): REMOVED events
    /// for kvtier's pages, or a CLEARED when it removed more than it could name.
    pub fn l3_removed(&mut self, removed: Removed) {
        if removed.overflowed {
            // More than it could name: every page of every layout may be gone.
            self.l3.learn(None, EventKind::Cleared { tenant: None });
        }
        for name in removed.names {
            if let Some((fp, key)) = parse_object_name(&name) {
                self.l3.learn(Some(fp), EventKind::Removed { key });
            }
        }
    }

    /// The event stream.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// Reports the stream's series through `m`.
    pub fn set_event_metrics(&mut self, m: EventMetrics) {
        self.events.set_metrics(m);
    }

    /// Subscribes a stream that last saw `after_seq` of `stream_id` (0, 0: none), limited to
    /// `tenant`'s pages when given.
    pub fn subscribe_events(
        &mut self,
        stream_id: u64,
        after_seq: u64,
        tenant: Option<TenantTag>,
    ) -> Subscription {
        self.publish_changes();
        let (start, rx) = self.events.subscribe(stream_id, after_seq);
        match start {
            Start::Resume(first) => Subscription {
                first: First::Replay(first),
                resync: None,
                rx,
            },
            Start::Resync(why) => Subscription {
                first: First::Snapshot(self.event_snapshot(tenant)),
                resync: Some(why),
                rx,
            },
        }
    }

    /// Every page L2 holds now that `tenant` may see (every page: `None`), as the index
    /// scan found them: the one part of a snapshot done under the state lock. The stream
    /// orders them, makes them events and encodes them after the lock, a batch at a time.
    pub fn event_snapshot(&mut self, tenant: Option<TenantTag>) -> Snapshot {
        self.publish_changes();
        let keep = |k: &PageKey| tenant.is_none_or(|t| TenantTag::of(k) == t);
        // L2's pages, then those L3 holds as far as this kvtierd knows (its writes landed,
        // the page is still indexed): pages only L3 holds are not listed (Locate finds them).
        let parts = self
            .pools
            .values()
            .flat_map(|p| {
                let fp = p.layout.fingerprint();
                [
                    (fp, EventTier::L2Host, p.index.snapshot_pages(false, keep)),
                    (fp, EventTier::L3Storage, p.index.snapshot_pages(true, keep)),
                ]
            })
            .filter(|(_, _, pages)| !pages.is_empty())
            .collect();
        Snapshot::new(self.events.last_seq(), parts)
    }

    /// A resubscription for a stream that fell behind: a snapshot and a fresh channel.
    pub fn resubscribe_events(&mut self, tenant: Option<TenantTag>) -> Subscription {
        let mut s = self.subscribe_events(0, 0, tenant);
        s.resync = Some("lagged");
        s
    }

    /// Publishes `changes` as if pool `layout` had made them (the event stream's tests).
    #[cfg(test)]
    pub fn publish_for_test(
        &mut self,
        layout: kvtier_core::LayoutFingerprint,
        changes: Vec<kvtier_core::host_index::IndexChange>,
    ) {
        self.events.publish(layout, changes);
    }
}
