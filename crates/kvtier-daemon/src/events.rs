//! What this kvtierd's L2 holds, published as events for routers (`WatchEvents`,
//! docs/routing.md).
//!
//! The index logs every page that becomes readable or leaves (`HostIndex::take_changes`);
//! [`HostState::publish_changes`](crate::state::HostState::publish_changes) drains the logs
//! each time the state lock is let go, so no path that changes L2 can forget to publish, and
//! the order of events is the order of the changes. [`EventBus::publish`] numbers them,
//! keeps the last [`REPLAY`] in a ring for subscribers that resume, and hands each batch to
//! a broadcast channel as the change log it was ([`Published`]): a batch becomes events and
//! wire bytes when a stream first reads it, not in the commit that published it. Publishing
//! never waits: a subscriber that falls more than [`BACKLOG`] batches behind loses its
//! place, and its stream sends a RESYNC and a snapshot
//! instead (counted in `kvtier_events_resyncs_total{reason}`). One call's stream (its
//! encoding, lingering and resync) is the service layer's: `service/watch.rs`.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

pub use kvtier_core::events::{Event, EventKind, EventTier};
use kvtier_core::host_index::{IndexChange, SnapshotPages};
use kvtier_core::{LayoutFingerprint, TenantTag};
use kvtier_server::metrics::MetricRegistry;
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use tokio::sync::broadcast;

use kvtier_proto::events::EncodedEvents;

/// Events kept for resuming subscribers.
pub const REPLAY: usize = 65_536;
/// Batches a subscriber may fall behind before it must resync.
pub const BACKLOG: usize = 4_096;

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or_default()
}

/// The series the bus and its streams report.
#[derive(Clone, Debug)]
pub struct EventMetrics {
    /// `kvtier_events_published_total`.
    pub published: IntCounter,
    /// `kvtier_events_subscribers`.
    pub subscribers: IntGauge,
    /// `kvtier_events_resyncs_total{reason}`: `new` (a fresh subscriber, or one resuming
    /// another stream or outside the window) and `lagged` (it fell behind).
    pub resyncs: IntCounterVec,
}

impl EventMetrics {
    /// Registers the series.
    pub fn new(r: &MetricRegistry) -> prometheus::Result<Self> {
        let m = Self {
            published: r.counter(
                "kvtier_events_published_total",
                "L2 page events published (stored, removed, cleared)",
            )?,
            subscribers: r.gauge("kvtier_events_subscribers", "WatchEvents streams open now")?,
            resyncs: r.counter_vec(
                "kvtier_events_resyncs_total",
                "Event streams that started over from a snapshot, by reason: new (a fresh \
                 subscriber, or one resuming another stream or outside the replay window), \
                 lagged (it fell more than the backlog behind)",
                &["reason"],
            )?,
        };
        // Every reason shows from the start, at 0.
        for why in ["new", "lagged"] {
            m.resyncs.with_label_values(&[why]);
        }
        Ok(m)
    }
}

/// One publish, as every stream receives it and the ring keeps it: what the state handed
/// over, numbered from `first_seq`. It becomes [`Event`]s, and those their wire encoding, the
/// first time a stream reads it, once for all (never, while nobody subscribes or resumes):
/// the commit that published it, under the state lock, only moved its change log here.
#[derive(Debug)]
pub struct Published {
    first_seq: u64,
    unix_nanos: u64,
    body: Body,
    events: OnceLock<Box<[Event]>>,
    wire: OnceLock<EncodedEvents>,
}

/// What a publish carried.
#[derive(Debug)]
enum Body {
    /// An L2 pool's index changes, in order.
    L2(LayoutFingerprint, Vec<IndexChange>),
    /// Events that say their own layout and tier (L3's, a clear).
    Each(Vec<(Option<LayoutFingerprint>, EventKind, EventTier)>),
}

impl Body {
    fn len(&self) -> usize {
        match self {
            Body::L2(_, changes) => changes.len(),
            Body::Each(kinds) => kinds.len(),
        }
    }
}

impl Published {
    /// How many events.
    fn len(&self) -> usize {
        self.body.len()
    }

    /// The seq of its last event.
    fn last_seq(&self) -> u64 {
        self.first_seq + self.len() as u64 - 1
    }

    /// The events, in order.
    pub fn events(&self) -> &[Event] {
        self.events.get_or_init(|| {
            let (seq, unix_nanos) = (self.first_seq, self.unix_nanos);
            let event = |i: usize, layout, kind, tier| Event {
                seq: seq + i as u64,
                unix_nanos,
                kind,
                layout,
                tier,
            };
            match &self.body {
                Body::L2(layout, changes) => changes
                    .iter()
                    .enumerate()
                    .map(|(i, c)| {
                        let kind = match *c {
                            IndexChange::Stored { key, parent } => {
                                EventKind::Stored { key, parent }
                            }
                            IndexChange::Removed { key } => EventKind::Removed { key },
                        };
                        event(i, Some(*layout), kind, EventTier::L2Host)
                    })
                    .collect(),
                Body::Each(kinds) => kinds
                    .iter()
                    .enumerate()
                    .map(|(i, &(layout, kind, tier))| event(i, layout, kind, tier))
                    .collect(),
            }
        })
    }

    /// The events' wire entries.
    pub fn wire(&self) -> &EncodedEvents {
        self.wire.get_or_init(|| EncodedEvents::new(self.events()))
    }
}

/// The event stream of one kvtierd.
#[derive(Debug)]
pub struct EventBus {
    stream_id: u64,
    node: String,
    next_seq: u64,
    /// The last publishes, holding at least the last [`REPLAY`] events (a publish leaves
    /// whole, once the ones after it hold that many). One a stream has read also keeps its
    /// events and wire bytes until it leaves.
    ring: VecDeque<Arc<Published>>,
    /// Events in `ring`.
    ring_events: usize,
    tx: broadcast::Sender<Arc<Published>>,
    metrics: Option<EventMetrics>,
}

/// Where a new subscriber starts.
#[derive(Debug)]
pub enum Start {
    /// The events after the seq it asked for, from the ring.
    Resume(Vec<Event>),
    /// A RESYNC first (its reason for the metric), then a snapshot.
    Resync(&'static str),
}

impl EventBus {
    /// A new stream (a fresh id) for `node`.
    pub fn new(node: String) -> Self {
        let mut id = [0u8; 8];
        // An id collision only costs a resuming subscriber a resync it would have needed.
        let _ = getrandom::fill(&mut id);
        Self {
            stream_id: u64::from_le_bytes(id).max(1),
            node,
            next_seq: 1,
            ring: VecDeque::new(),
            ring_events: 0,
            tx: broadcast::channel(BACKLOG).0,
            metrics: None,
        }
    }

    /// Reports through `m` from now on.
    pub fn set_metrics(&mut self, m: EventMetrics) {
        self.metrics = Some(m);
    }

    /// The series, when set.
    pub fn metrics(&self) -> Option<&EventMetrics> {
        self.metrics.as_ref()
    }

    /// This stream's id.
    pub fn stream_id(&self) -> u64 {
        self.stream_id
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// The seq of the last event published (0 before the first).
    pub fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Publishes `changes` of the L2 pool `layout`, in order.
    pub fn publish(&mut self, layout: LayoutFingerprint, changes: Vec<IndexChange>) {
        self.push(Body::L2(layout, changes));
    }

    /// Publishes L3 changes (`layout`, what happened), in order.
    pub fn publish_l3(&mut self, changes: Vec<(Option<LayoutFingerprint>, EventKind)>) {
        self.push(Body::Each(
            changes
                .into_iter()
                .map(|(layout, kind)| (layout, kind, EventTier::L3Storage))
                .collect(),
        ));
    }

    /// Publishes that every L2 page of `layout` (every pool's, when `None`) is gone: of
    /// `tenant`'s own pool, or of every tenant's (`None`).
    pub fn cleared(&mut self, layout: Option<LayoutFingerprint>, tenant: Option<TenantTag>) {
        self.push(Body::Each(vec![(
            layout,
            EventKind::Cleared { tenant },
            EventTier::L2Host,
        )]));
    }

    /// Numbers `body`'s events, keeps it for resuming and hands it to the streams. O(1) in
    /// its events: nothing is converted or copied here.
    fn push(&mut self, body: Body) {
        let n = body.len();
        if n == 0 {
            return;
        }
        let published = Arc::new(Published {
            first_seq: self.next_seq,
            unix_nanos: now_nanos(),
            body,
            events: OnceLock::new(),
            wire: OnceLock::new(),
        });
        self.next_seq += n as u64;
        self.ring.push_back(published.clone());
        self.ring_events += n;
        while let Some(front) = self.ring.front() {
            if self.ring_events - front.len() < REPLAY {
                break;
            }
            self.ring_events -= front.len();
            self.ring.pop_front();
        }
        if let Some(m) = &self.metrics {
            m.published.inc_by(n as u64);
        }
        // No receiver is fine: the ring keeps them for the next one.
        let _ = self.tx.send(published);
    }

    /// Subscribes a reader that last saw `after_seq` of stream `stream_id`: where it starts,
    /// and the channel of what is published from now on. Called under the state lock, so
    /// nothing is published between the two.
    pub fn subscribe(
        &self,
        stream_id: u64,
        after_seq: u64,
    ) -> (Start, broadcast::Receiver<Arc<Published>>) {
        let rx = self.tx.subscribe();
        // The window is the last REPLAY events, though the ring may hold a few more.
        let oldest = self.next_seq.saturating_sub(REPLAY as u64).max(1);
        let start = if stream_id == self.stream_id
            && after_seq <= self.last_seq()
            && after_seq + 1 >= oldest
        {
            Start::Resume(
                self.ring
                    .iter()
                    .filter(|p| p.last_seq() > after_seq)
                    .flat_map(|p| p.events())
                    .filter(|e| e.seq > after_seq)
                    .copied()
                    .collect(),
            )
        } else {
            Start::Resync("new")
        };
        (start, rx)
    }
}

/// Where a new stream starts.
pub enum First {
    /// The events after the seq it asked for, from the ring.
    Replay(Vec<Event>),
    /// A RESYNC, then a snapshot.
    Snapshot(Snapshot),
}

/// A snapshot as the index scan found it (under the state lock, limited to what its
/// subscriber may see): made into events, in order, after the lock, a batch at a time as
/// the subscriber reads ([`Self::into_events`]).
pub struct Snapshot {
    seq: u64,
    parts: Vec<(LayoutFingerprint, EventTier, SnapshotPages)>,
}

impl Snapshot {
    /// A snapshot at `seq` (the last event published before it) of `parts` (per pool and
    /// tier).
    pub fn new(seq: u64, parts: Vec<(LayoutFingerprint, EventTier, SnapshotPages)>) -> Self {
        Self { seq, parts }
    }

    /// Pages in it.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|(_, _, p)| p.len()).sum()
    }

    /// Whether it holds no page.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A RESYNC at the snapshot's seq, then every page as a STORED event with seq 0, per
    /// pool and tier, parents first. Each part is put in order as the iterator reaches it.
    pub fn into_events(self) -> impl Iterator<Item = Event> {
        let unix_nanos = now_nanos();
        let resync = Event {
            seq: self.seq,
            unix_nanos,
            kind: EventKind::Resync,
            layout: None,
            tier: EventTier::L2Host,
        };
        std::iter::once(resync).chain(self.parts.into_iter().flat_map(
            move |(layout, tier, pages)| {
                pages
                    .in_order()
                    .into_iter()
                    .map(move |(key, parent)| Event {
                        seq: 0,
                        unix_nanos,
                        kind: EventKind::Stored { key, parent },
                        layout: Some(layout),
                        tier,
                    })
            },
        ))
    }
}

/// Most events in one streamed batch.
pub const MAX_BATCH_EVENTS: usize = 1_024;
#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_core::PageKey;

    fn k(i: u8) -> PageKey {
        PageKey([i; 32])
    }

    const FP: LayoutFingerprint = LayoutFingerprint([7; 16]);

    fn stored(i: u8) -> IndexChange {
        IndexChange::Stored {
            key: k(i),
            parent: None,
        }
    }

    #[test]
    fn events_are_numbered_kept_for_resuming_and_broadcast_in_batches() {
        let mut bus = EventBus::new("n1".into());
        let (start, mut early) = bus.subscribe(0, 0);
        assert!(matches!(start, Start::Resync("new")));
        bus.publish(FP, vec![stored(1), stored(2)]);
        bus.publish(FP, vec![]);
        bus.publish(FP, vec![IndexChange::Removed { key: k(1) }]);
        bus.cleared(None, None);
        assert_eq!(bus.last_seq(), 4);
        let first = early.try_recv().unwrap();
        assert_eq!(
            first.events().iter().map(|e| e.seq).collect::<Vec<_>>(),
            vec![1, 2],
            "one batch per publish"
        );
        assert_eq!(
            early.try_recv().unwrap().events()[0].kind,
            EventKind::Removed { key: k(1) }
        );
        let last = early.try_recv().unwrap();
        assert_eq!(
            (last.events()[0].kind, last.events()[0].layout),
            (EventKind::Cleared { tenant: None }, None)
        );
        // Resuming after seq 1 of this stream replays 2..=4; another stream's id, or a seq
        // not published yet, starts over.
        let (start, _) = bus.subscribe(bus.stream_id(), 1);
        match start {
            Start::Resume(evs) => {
                assert_eq!(evs.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![2, 3, 4])
            }
            other => panic!("{other:?}"),
        }
        let (start, _) = bus.subscribe(bus.stream_id(), 4);
        assert!(
            matches!(start, Start::Resume(ref v) if v.is_empty()),
            "{start:?}"
        );
        assert!(matches!(
            bus.subscribe(bus.stream_id() ^ 1, 1).0,
            Start::Resync(_)
        ));
        assert!(matches!(
            bus.subscribe(bus.stream_id(), 5).0,
            Start::Resync(_)
        ));
    }

    #[test]
    fn the_ring_keeps_the_last_events_only_and_older_resumes_resync() {
        let mut bus = EventBus::new("n1".into());
        for i in 0..(REPLAY + 10) {
            bus.publish(FP, vec![stored(i as u8)]);
        }
        let id = bus.stream_id();
        assert!(
            matches!(bus.subscribe(id, 5).0, Start::Resync(_)),
            "fell out"
        );
        match bus.subscribe(id, 10).0 {
            Start::Resume(evs) => {
                assert_eq!(evs.len(), REPLAY);
                assert_eq!(evs[0].seq, 11);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn large_publishes_keep_the_window_exact_and_resume_inside_a_batch() {
        // Publishes of 1,000 events (a commit's pages): the ring keeps whole publishes, but
        // the window is still exactly the last REPLAY events, and a resume may start in the
        // middle of one.
        let mut bus = EventBus::new("n1".into());
        let batch = 1000;
        let rounds = REPLAY / batch + 3;
        for r in 0..rounds {
            bus.publish(FP, (0..batch).map(|i| stored((r + i) as u8)).collect());
        }
        let last = bus.last_seq();
        assert_eq!(last, (rounds * batch) as u64);
        assert!(bus.ring_events >= REPLAY && bus.ring_events < REPLAY + batch);
        let id = bus.stream_id();
        let oldest = last - REPLAY as u64 + 1;
        assert!(matches!(bus.subscribe(id, oldest - 2).0, Start::Resync(_)));
        for after in [oldest - 1, oldest + 499, last - 1] {
            match bus.subscribe(id, after).0 {
                Start::Resume(evs) => {
                    let seqs: Vec<u64> = evs.iter().map(|e| e.seq).collect();
                    assert_eq!(
                        seqs,
                        ((after + 1)..=last).collect::<Vec<_>>(),
                        "after {after}"
                    );
                    // Each event is the change its seq numbers: publish r's i-th key.
                    let e = &evs[0];
                    let (r, i) = ((e.seq - 1) as usize / batch, (e.seq - 1) as usize % batch);
                    assert_eq!(
                        e.kind,
                        EventKind::Stored {
                            key: k((r + i) as u8),
                            parent: None
                        }
                    );
                }
                other => panic!("after {after}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_tenant_sees_its_own_pages_every_clear_of_all_and_its_own_pools_clears() {
        let scope = kvtier_core::TenantScope::new("a");
        let mine = scope.apply(&k(1));
        let theirs = kvtier_core::TenantScope::new("b").apply(&k(1));
        let ev = |kind| Event {
            seq: 1,
            unix_nanos: 0,
            kind,
            layout: Some(FP),
            tier: EventTier::L2Host,
        };
        let t = Some(scope.tag());
        assert!(ev(EventKind::Removed { key: mine }).visible_to(t));
        assert!(
            !ev(EventKind::Stored {
                key: theirs,
                parent: None
            })
            .visible_to(t)
        );
        assert!(
            ev(EventKind::Stored {
                key: theirs,
                parent: None
            })
            .visible_to(None)
        );
        assert!(ev(EventKind::Cleared { tenant: None }).visible_to(t));
        // A CLEARED of one tenant's own pool is that tenant's alone.
        let of = |tag| EventKind::Cleared { tenant: Some(tag) };
        let me = scope.tag();
        assert!(ev(of(me)).visible_to(t) && ev(of(me)).visible_to(None));
        assert!(!ev(of(TenantTag(me.0 ^ 1))).visible_to(t));
    }

    #[test]
    fn a_snapshot_is_a_resync_at_the_current_seq_then_every_page() {
        let mut bus = EventBus::new("n1".into());
        bus.publish(FP, vec![stored(1), stored(2)]);
        let snap: Vec<Event> = Snapshot::new(
            bus.last_seq(),
            vec![(
                FP,
                EventTier::L2Host,
                SnapshotPages::from_ordered(vec![(k(1), None), (k(2), Some(k(1)))]),
            )],
        )
        .into_events()
        .collect();
        assert_eq!((snap[0].kind, snap[0].seq), (EventKind::Resync, 2));
        assert_eq!(
            snap[2].kind,
            EventKind::Stored {
                key: k(2),
                parent: Some(k(1))
            }
        );
        assert!(snap[1..].iter().all(|e| e.seq == 0 && e.layout == Some(FP)));
    }
}
