//! The state's side of the event stream (`crate::events`): the pools' change logs drained
//! into the bus, and where a new subscriber starts.

use tokio::sync::broadcast;

use super::HostState;
use crate::events::{Event, EventBus, EventMetrics, Start};

/// Where a new `WatchEvents` stream starts, and what it hears after.
pub struct Subscription {
    /// Its first events: the replay it resumes from, or a RESYNC and a snapshot.
    pub first: Vec<Event>,
    /// Why it starts from a snapshot (the resync metric's reason), if it does.
    pub resync: Option<&'static str>,
    /// What is published from now on.
    pub rx: broadcast::Receiver<std::sync::Arc<[Event]>>,
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
    }

    /// The event stream.
    pub fn events(&self) -> &EventBus {
        &self.events
    }

    /// Reports the stream's series through `m`.
    pub fn set_event_metrics(&mut self, m: EventMetrics) {
        self.events.set_metrics(m);
    }

    /// Subscribes a stream that last saw `after_seq` of `stream_id` (0, 0: none).
    pub fn subscribe_events(&mut self, stream_id: u64, after_seq: u64) -> Subscription {
        self.publish_changes();
        let (start, rx) = self.events.subscribe(stream_id, after_seq);
        match start {
            Start::Resume(first) => Subscription {
                first,
                resync: None,
                rx,
            },
            Start::Resync(why) => Subscription {
                first: self.event_snapshot(),
                resync: Some(why),
                rx,
            },
        }
    }

    /// A RESYNC at the last published seq, then every page L2 holds now.
    pub fn event_snapshot(&mut self) -> Vec<Event> {
        self.publish_changes();
        self.events.snapshot(
            self.pools
                .values()
                .map(|p| (p.layout.fingerprint(), p.index.ready_pages())),
        )
    }

    /// A resubscription for a stream that fell behind: a snapshot and a fresh channel.
    pub fn resubscribe_events(&mut self) -> Subscription {
        let mut s = self.subscribe_events(0, 0);
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
