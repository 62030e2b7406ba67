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
//! instead (counted in `kvtier_events_resyncs_total{reason}`).

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};

pub use kvtier_core::events::{Event, EventKind, EventTier};
use kvtier_core::host_index::{IndexChange, SnapshotPages};
use kvtier_core::{LayoutFingerprint, TenantTag};
use kvtier_server::metrics::MetricRegistry;
use prometheus::{IntCounter, IntCounterVec, IntGauge};
use tokio::sync::broadcast;

use kvtier_proto::events::{EncodedEvents, batch_header};

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
/// How long a stream waits for more events to send with the ones it has: fewer, larger
/// messages (a stream's wake-ups and frames cost CPU the writers share), for at most this
/// much more delivery lag.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(2);
/// Batches a stream holds ready for its caller beyond what the connection buffers: with
/// [`BACKLOG`], what one stalled subscriber can cost in memory.
const STREAM_DEPTH: usize = 4;

/// A stream's messages being put together: its header, then the entries of the events it
/// sends, at most [`MAX_BATCH_EVENTS`] a message.
///
/// A stream limited to one tenant's pages numbers what it sends itself: from 1, one more for
/// each event it sends, with its own stream id (fresh per stream). The node's numbers would
/// show, in their gaps, how many changes other tenants made and when; so its events are
/// encoded here, never copied from the node's encoding. Such a stream does not resume (its
/// id is known to no later call): a reconnect gets a RESYNC and a snapshot of the tenant's
/// pages.
struct Outgoing {
    header: Bytes,
    tenant: Option<TenantTag>,
    /// A tenant's stream: the seq of the last event it numbered.
    own_seq: u64,
    current: BytesMut,
    count: usize,
    ready: Vec<Bytes>,
}

impl Outgoing {
    fn new(stream_id: u64, node: &str, tenant: Option<TenantTag>) -> Self {
        let stream_id = match tenant {
            None => stream_id,
            Some(_) => {
                let mut id = [0u8; 8];
                let _ = getrandom::fill(&mut id);
                u64::from_le_bytes(id).max(1)
            }
        };
        let header = Bytes::from(batch_header(stream_id, node));
        Self {
            current: BytesMut::from(&header[..]),
            header,
            tenant,
            own_seq: 0,
            count: 0,
            ready: Vec::new(),
        }
    }

    /// Events waiting to be sent.
    fn pending(&self) -> usize {
        self.ready.len() * MAX_BATCH_EVENTS + self.count
    }

    /// Adds a publish's `events` (encoded as `wire`): all of them, as runs of entries copied
    /// whole, for a stream of every tenant's pages; a tenant's own, numbered anew, for a
    /// tenant's stream.
    fn add(&mut self, events: &[Event], wire: &EncodedEvents) {
        if self.tenant.is_some() {
            self.add_own(events);
        } else {
            self.add_encoded(events, wire);
        }
    }

    /// Adds `events`, encoded as `wire`, as runs of entries copied whole.
    fn add_encoded(&mut self, events: &[Event], wire: &EncodedEvents) {
        let mut i = 0;
        while i < events.len() {
            let room = MAX_BATCH_EVENTS - self.count;
            let j = (i + room).min(events.len());
            self.current.extend_from_slice(wire.entries(i, j));
            self.count += j - i;
            if self.count == MAX_BATCH_EVENTS {
                self.seal();
            }
            i = j;
        }
    }

    /// Adds events of this stream's own (a replay, a snapshot), encoded here: for a tenant's
    /// stream only those it may see, in its own numbers (a RESYNC at the last seq it sent,
    /// a snapshot's pages at 0, every other event one more).
    fn add_own(&mut self, events: &[Event]) {
        if self.tenant.is_none() {
            self.add_encoded(events, &EncodedEvents::new(events));
            return;
        }
        let seen: Vec<Event> = events
            .iter()
            .filter(|e| e.visible_to(self.tenant))
            .map(|e| {
                let seq = match e.kind {
                    EventKind::Resync => self.own_seq,
                    _ if e.seq == 0 => 0,
                    _ => {
                        self.own_seq += 1;
                        self.own_seq
                    }
                };
                Event { seq, ..*e }
            })
            .collect();
        self.add_encoded(&seen, &EncodedEvents::new(&seen));
    }

    fn seal(&mut self) {
        if self.count > 0 {
            let next = BytesMut::from(&self.header[..]);
            self.ready
                .push(std::mem::replace(&mut self.current, next).freeze());
            self.count = 0;
        }
    }

    /// The messages to send now.
    fn take(&mut self) -> Vec<Bytes> {
        self.seal();
        std::mem::take(&mut self.ready)
    }
}

/// The stream of one WatchEvents call: where the subscriber starts (a replay, or a RESYNC
/// and a snapshot), then what is published, in `EventBatch` messages (already encoded) of at
/// most [`MAX_BATCH_EVENTS`] events, limited to `tenant`'s pages when given (and then in
/// the stream's own numbers, see [`Outgoing`]). It ends when
/// the caller goes or kvtierd shuts down. A caller that reads too slowly only delays its
/// own stream: when it falls [`BACKLOG`] batches behind it gets a RESYNC and a fresh
/// snapshot.
pub fn watch(
    state: Arc<crate::state::Shared>,
    stream_id: u64,
    after_seq: u64,
    tenant: Option<TenantTag>,
    slot: crate::streams::StreamSlot,
    shutdown: tokio_util::sync::CancellationToken,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, tonic::Status>> {
    let (tx, out) = tokio::sync::mpsc::channel(STREAM_DEPTH);
    // A tenant's stream numbers its own events, so it never resumes the node's.
    let (stream_id, after_seq) = match tenant {
        None => (stream_id, after_seq),
        Some(_) => (0, 0),
    };
    let (sub, mut outgoing, metrics) = {
        let mut st = state.lock();
        let sub = st.subscribe_events(stream_id, after_seq, tenant);
        let bus = st.events();
        (
            sub,
            Outgoing::new(bus.stream_id(), bus.node(), tenant),
            bus.metrics().cloned(),
        )
    };
    tokio::spawn(async move {
        // The caller's place under its stream bound, for as long as this stream runs.
        let _slot = slot;
        let _open = metrics
            .as_ref()
            .map(|m| Subscribed::new(m.subscribers.clone()));
        let resynced = |why: Option<&'static str>| {
            if let (Some(m), Some(why)) = (&metrics, why) {
                m.resyncs.with_label_values(&[why]).inc();
            }
        };
        resynced(sub.resync);
        if !send_first(sub.first, &mut outgoing, &tx).await {
            return;
        }
        let mut rx = sub.rx;
        loop {
            let got = tokio::select! {
                () = shutdown.cancelled() => return,
                () = tx.closed() => return,
                r = rx.recv() => r,
            };
            let mut lagged = match got {
                Ok(batch) => {
                    outgoing.add(batch.events(), batch.wire());
                    false
                }
                Err(broadcast::error::RecvError::Lagged(_)) => true,
                Err(broadcast::error::RecvError::Closed) => return,
            };
            // What comes within LINGER goes in the same message: the stream sleeps it out and
            // then takes what came, rather than wake for every publish (a commit's batch)
            // while it waits: the wake-ups of 4 streams cost the commits more than their
            // bytes did. A lag is reported once, so it is remembered here, never dropped.
            if !lagged {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(LINGER) => {}
                }
            }
            while !lagged && outgoing.pending() < MAX_BATCH_EVENTS {
                match rx.try_recv() {
                    Ok(more) => outgoing.add(more.events(), more.wire()),
                    Err(broadcast::error::TryRecvError::Lagged(_)) => lagged = true,
                    Err(_) => break,
                }
            }
            if lagged {
                // What it has is still true up to the lag; then it starts over.
                let sub = state.lock().resubscribe_events(tenant);
                resynced(sub.resync);
                rx = sub.rx;
                if !send_first(sub.first, &mut outgoing, &tx).await {
                    return;
                }
                continue;
            }
            if !send_all(&tx, outgoing.take()).await {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(out)
}

type Outbox = tokio::sync::mpsc::Sender<Result<Bytes, tonic::Status>>;

/// Sends `messages` in order; false once the caller is gone.
async fn send_all(tx: &Outbox, messages: Vec<Bytes>) -> bool {
    for m in messages {
        if tx.send(Ok(m)).await.is_err() {
            return false;
        }
    }
    true
}

/// Sends where a stream starts, after what `outgoing` holds: a replay, or a snapshot a batch
/// at a time, each made into events and encoded only when the one before went out (a
/// subscriber that stops reading holds the scan's pages, never their encoding). False once
/// the caller is gone.
async fn send_first(first: First, outgoing: &mut Outgoing, tx: &Outbox) -> bool {
    match first {
        First::Replay(events) => outgoing.add_own(&events),
        First::Snapshot(snapshot) => {
            let mut chunk = Vec::with_capacity(MAX_BATCH_EVENTS);
            for e in snapshot.into_events() {
                chunk.push(e);
                if chunk.len() == MAX_BATCH_EVENTS {
                    outgoing.add_own(&chunk);
                    chunk.clear();
                    if !send_all(tx, outgoing.take()).await {
                        return false;
                    }
                }
            }
            outgoing.add_own(&chunk);
        }
    }
    send_all(tx, outgoing.take()).await
}

/// Counts an open stream in `kvtier_events_subscribers` for as long as it lives.
struct Subscribed(IntGauge);

impl Subscribed {
    fn new(g: IntGauge) -> Self {
        g.inc();
        Self(g)
    }
}

impl Drop for Subscribed {
    fn drop(&mut self) {
        self.0.dec();
    }
}

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

    /// A key of tenant `tag`: its first 8 bytes are the tag.
    fn of_tenant(tag: u64, i: u8) -> PageKey {
        let mut key = [i; 32];
        key[..8].copy_from_slice(&tag.to_be_bytes());
        PageKey(key)
    }

    #[test]
    fn a_tenants_stream_numbers_its_own_events_and_shows_no_gap_for_anothers() {
        let (acme, globex) = (0xacu64, 0x61u64);
        let mut bus = EventBus::new("n1".into());
        let mut out = Outgoing::new(bus.stream_id(), "n1", Some(TenantTag(acme)));
        let mut all = Outgoing::new(bus.stream_id(), "n1", None);
        let (_, mut rx) = bus.subscribe(0, 0);
        // A snapshot first: a RESYNC at 0 and the tenant's pages at 0.
        out.add_own(&[
            Event {
                seq: 40,
                unix_nanos: 1,
                kind: EventKind::Resync,
                layout: None,
                tier: EventTier::L2Host,
            },
            Event {
                seq: 0,
                unix_nanos: 1,
                kind: EventKind::Stored {
                    key: of_tenant(acme, 9),
                    parent: None,
                },
                layout: Some(FP),
                tier: EventTier::L2Host,
            },
        ]);
        // Globex writes between acme's writes, and an operator clears everything.
        let store = |tag, i| IndexChange::Stored {
            key: of_tenant(tag, i),
            parent: None,
        };
        bus.publish(FP, vec![store(acme, 1), store(globex, 2), store(globex, 3)]);
        bus.publish(FP, vec![store(globex, 4)]);
        bus.publish(FP, vec![store(acme, 5)]);
        bus.cleared(None, None);
        bus.publish(FP, vec![store(globex, 6), store(acme, 7)]);
        while let Ok(p) = rx.try_recv() {
            out.add(p.events(), p.wire());
            all.add(p.events(), p.wire());
        }
        let decode = |o: &mut Outgoing| -> Vec<kvtier_proto::events::EventBatch> {
            o.take()
                .iter()
                .map(|m| kvtier_proto::events::decode_batch(m).unwrap())
                .collect()
        };
        let mine = decode(&mut out);
        let seqs: Vec<u64> = mine
            .iter()
            .flat_map(|b| b.events.iter().map(|e| e.seq))
            .collect();
        // RESYNC 0, snapshot page 0, then 1, 2 (acme's), 3 (the clear), 4 (acme's): no gap
        // for globex's five.
        assert_eq!(seqs, [0, 0, 1, 2, 3, 4]);
        let keys: Vec<PageKey> = mine
            .iter()
            .flat_map(|b| &b.events)
            .filter_map(|e| match e.kind {
                EventKind::Stored { key, .. } => Some(key),
                _ => None,
            })
            .collect();
        assert!(
            keys.iter().all(|k| TenantTag::of(k) == TenantTag(acme)),
            "{keys:?}"
        );
        // Its stream id is its own, not the node's (which resumes the node's numbers).
        assert_ne!(mine[0].stream_id, bus.stream_id());
        // A stream of every tenant's pages keeps the node's numbers and id.
        let node = decode(&mut all);
        let seqs: Vec<u64> = node
            .iter()
            .flat_map(|b| b.events.iter().map(|e| e.seq))
            .collect();
        assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
        assert_eq!(node[0].stream_id, bus.stream_id());
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
    fn a_stream_that_falls_behind_gets_a_resync_and_a_snapshot_and_commits_never_wait() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let state = Arc::new(crate::state::Shared::new(
                crate::state::HostState::new(&kvtier_config::daemon::DaemonConfig::default())
                    .unwrap(),
            ));
            let m = EventMetrics::new(&MetricRegistry::new()).unwrap();
            state.lock().set_event_metrics(m.clone());
            let stop = tokio_util::sync::CancellationToken::new();
            let caps = crate::streams::StreamCaps::new(1, &MetricRegistry::new()).unwrap();
            let slot = caps
                .open("watch_events", &crate::roles::Role::Operator, None)
                .unwrap();
            let mut s = watch(state.clone(), 0, 0, None, slot, stop.clone());
            use futures::StreamExt;
            use prost::Message;
            let decode = |b: Bytes| kvtier_proto::v1::EventBatch::decode(b).unwrap();
            let first = decode(s.next().await.unwrap().unwrap());
            assert_eq!(
                first.events[0].kind,
                kvtier_proto::v1::PageEventKind::Resync as i32
            );
            assert_eq!(m.subscribers.get(), 1);
            // Far more batches than the stream and its backlog hold, while it is not read:
            // publishing never waits.
            let n = BACKLOG + (STREAM_DEPTH + 2) * MAX_BATCH_EVENTS;
            for i in 0..n {
                state.lock().publish_for_test(FP, vec![stored(i as u8)]);
                if i % 1024 == 0 {
                    tokio::task::yield_now().await;
                }
            }
            tokio::task::yield_now().await;
            let mut kinds = Vec::new();
            while let Ok(Some(b)) =
                tokio::time::timeout(std::time::Duration::from_millis(200), s.next()).await
            {
                kinds.extend(decode(b.unwrap()).events.iter().map(|e| e.kind));
            }
            let resync = kinds
                .iter()
                .position(|k| *k == kvtier_proto::v1::PageEventKind::Resync as i32)
                .expect("no resync after falling behind");
            assert!(resync > 0 && kinds.len() < n, "{} of {n}", kinds.len());
            // Still not read while it resyncs, it may fall behind again.
            assert!(m.resyncs.with_label_values(&["lagged"]).get() >= 1);
            assert_eq!(m.resyncs.with_label_values(&["new"]).get(), 1);
            stop.cancel();
            assert!(s.next().await.is_none(), "the stream ends with kvtierd");
            tokio::task::yield_now().await;
            assert_eq!(m.subscribers.get(), 0);
        });
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
