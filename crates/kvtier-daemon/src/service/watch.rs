//! One `WatchEvents` call's stream (docs/routing.md): where its subscriber starts on the
//! node's [`EventBus`](crate::events::EventBus) (a replay, or a RESYNC and a snapshot),
//! then what is published, encoded into `EventBatch` messages, limited to one tenant's pages
//! where the caller is a tenant. The bus owns what L2 holds as events; this service layer
//! owns a stream's life (its caller's slot, lingering, lag and resync).

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use kvtier_core::TenantTag;
use kvtier_proto::events::{EncodedEvents, batch_header};
use prometheus::IntGauge;
use tokio::sync::broadcast;

use crate::events::{Event, EventKind, First, MAX_BATCH_EVENTS};

/// How long a stream waits for more events to send with the ones it has: fewer, larger
/// messages (a stream's wake-ups and frames cost CPU the writers share), for at most this
/// much more delivery lag.
const LINGER: std::time::Duration = std::time::Duration::from_millis(2);
/// Batches a stream holds ready for its caller beyond what the connection buffers: with
/// [`BACKLOG`](crate::events::BACKLOG), what one stalled subscriber can cost in memory.
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
/// own stream: when it falls [`BACKLOG`](crate::events::BACKLOG) batches behind it gets a RESYNC and a fresh
/// snapshot.
pub(crate) fn watch(
    state: Arc<crate::state::Shared>,
    stream_id: u64,
    after_seq: u64,
    tenant: Option<TenantTag>,
    slot: crate::streams::StreamSlot,
    tasks: &kvtier_server::tasks::Tasks,
) -> tokio_stream::wrappers::ReceiverStream<Result<Bytes, tonic::Status>> {
    let shutdown = tasks.shutdown.clone();
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
    tasks.spawn(async move {
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
    use crate::events::{BACKLOG, EventBus, EventMetrics, EventTier};
    use kvtier_core::host_index::IndexChange;
    use kvtier_core::{LayoutFingerprint, PageKey};
    use kvtier_server::metrics::MetricRegistry;

    const FP: LayoutFingerprint = LayoutFingerprint([7; 16]);

    fn stored(i: u8) -> IndexChange {
        IndexChange::Stored {
            key: PageKey([i; 32]),
            parent: None,
        }
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
            let tasks = kvtier_server::tasks::Tasks::new(stop.clone());
            let mut s = watch(state.clone(), 0, 0, None, slot, &tasks);
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
}
