//! The state's side of the event stream (`crate::events`): the pools' change logs drained
//! into the bus, and where a new subscriber starts.

use tokio::sync::broadcast;

use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::Removed;
use kvtier_storage::format::parse_object_name;

use super::HostState;
use super::tenants::Sees;
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
        // L2's pages, then those L3 holds as far as this kvtierd knows (its writes landed,
        // the page is still indexed): pages only L3 holds are not listed (Locate finds them).
        // Another tenant's own pool is not scanned at all.
        let parts = self
            .pools
            .values()
            .filter(|p| !p.writes_own_l3)
            .filter_map(|p| {
                let fp = p.layout.fingerprint();
                let only = match self.tenants.sees(tenant, &p.key, &fp) {
                    Sees::Nothing => return None,
                    Sees::All => None,
                    Sees::Only(t) => Some(t),
                };
                let keep = move |k: &PageKey| only.is_none_or(|t| TenantTag::of(k) == t);
                Some([
                    (fp, EventTier::L2Host, p.index.snapshot_pages(false, keep)),
                    (fp, EventTier::L3Storage, p.index.snapshot_pages(true, keep)),
                ])
            })
            .flatten()
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::time::Instant;

    use kvtier_core::{PageKey, TenantScope};

    use crate::state::testing::{keys, state, tenant, tiny_layout};

    /// A tenant's snapshot is made from its own pool alone: another tenant's own pool is not
    /// even scanned (the stream's later filter would hide its pages, but not the time the
    /// scan holds the lock), and the shared layout pool holds the default tenant's pages.
    #[test]
    fn a_tenants_snapshot_holds_its_own_pools_pages_alone() {
        let (mut st, default) = state();
        st.set_tenants(&[tenant(""), tenant("acme"), tenant("globex")]);
        let now = Instant::now();
        let stored = |st: &mut crate::state::HostState, name: &str, n: u8, first: u8| {
            let id = if name.is_empty() {
                default
            } else {
                st.register(name.into(), name, &tiny_layout(), now)
                    .unwrap()
                    .session_id
            };
            let mut ks: Vec<PageKey> = keys(first + n - 1).split_off(usize::from(first - 1));
            TenantScope::new(name).apply_all(&mut ks);
            st.reserve(id, None, &ks, now).unwrap();
            st.commit(id, &ks, 0, now).unwrap();
        };
        stored(&mut st, "", 2, 1);
        stored(&mut st, "acme", 3, 3);
        stored(&mut st, "globex", 4, 6);
        let tag = |name: &str| Some(TenantScope::new(name).tag());
        assert_eq!(st.event_snapshot(tag("acme")).len(), 3);
        assert_eq!(st.event_snapshot(tag("globex")).len(), 4);
        assert_eq!(st.event_snapshot(tag("")).len(), 2);
        assert_eq!(st.event_snapshot(None).len(), 9);
    }

    /// A crashed kvtierd ran with `l2.tenant_pools = false`: its layout pool held every
    /// tenant's pages. The next run, with tenant pools on, takes it over into the layout's
    /// pool, the default tenant's own: its snapshot still lists its own pages alone (review:
    /// the tenant's own pool was listed unfiltered, acme's keys in it). Modelled by
    /// committing under the old table and swapping in the new run's.
    #[test]
    fn a_pool_adopted_from_a_run_without_tenant_pools_is_still_filtered() {
        let (mut st, _) = state();
        let now = Instant::now();
        st.tenants = crate::state::tenants::TenantTable::new(false);
        st.set_tenants(&[tenant(""), tenant("acme")]);
        let id = st
            .register("a".into(), "acme", &tiny_layout(), now)
            .unwrap()
            .session_id;
        let mut ks: Vec<PageKey> = keys(3);
        TenantScope::new("acme").apply_all(&mut ks);
        st.reserve(id, None, &ks, now).unwrap();
        st.commit(id, &ks, 0, now).unwrap();
        let default = Some(TenantScope::new("").tag());
        assert_eq!(st.event_snapshot(default).len(), 0);
        st.tenants = crate::state::tenants::TenantTable::new(true);
        st.set_tenants(&[tenant(""), tenant("acme")]);
        assert_eq!(st.event_snapshot(default).len(), 0, "acme's pages listed");
    }
}
