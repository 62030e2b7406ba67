//! kvtierd's event stream (`WatchEvents`, docs/routing.md) against a real daemon: the events
//! rebuild exactly what L2 holds through commits, eviction and a clear; a resume replays
//! what was missed; a restart is a new stream; and a subscriber that never reads does not
//! slow commits down, and catches up when it reads; L3's events follow write-through, the
//! backend's evictions and a clear.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use kvtier_client::{EventStream, HostClient};
use kvtier_core::PageKey;
use kvtier_core::events::{Event, EventKind, EventTier};
use kvtier_proto::v1;

/// What a router keeps from one node's events: each page held, with its parent, in L2
/// (`pages`) and in L3 (`l3`).
#[derive(Default, Debug)]
struct Held {
    pages: HashMap<PageKey, Option<PageKey>>,
    l3: HashMap<PageKey, Option<PageKey>>,
    last_seq: u64,
    stream_id: u64,
    resyncs: usize,
}

impl Held {
    fn apply(&mut self, stream_id: u64, events: &[Event]) {
        self.stream_id = stream_id;
        for e in events {
            let tier = match e.tier {
                EventTier::L2Host => &mut self.pages,
                EventTier::L3Storage => &mut self.l3,
            };
            match e.kind {
                EventKind::Resync => {
                    self.pages.clear();
                    self.l3.clear();
                    self.resyncs += 1;
                }
                EventKind::Cleared { .. } => tier.clear(),
                EventKind::Stored { key, parent } => {
                    tier.insert(key, parent);
                }
                EventKind::Removed { key } => {
                    assert!(tier.remove(&key).is_some(), "removed before stored: {e:?}");
                }
            }
            if e.seq != 0 {
                assert!(
                    e.seq > self.last_seq || e.kind == EventKind::Resync,
                    "{e:?}"
                );
                self.last_seq = e.seq;
            }
        }
    }

    /// Reads until the node has nothing more to say for a while.
    async fn catch_up(&mut self, s: &mut EventStream) {
        while let Ok(Some(b)) = tokio::time::timeout(Duration::from_millis(300), s.next())
            .await
            .map(|r| r.unwrap())
        {
            self.apply(b.stream_id, &b.events);
        }
    }
}

/// The keys L2 holds of `keys`, from a lookup of each.
async fn in_l2(c: &mut HostClient, sid: kvtier_core::SessionId, keys: &[PageKey]) -> Vec<PageKey> {
    let mut out = Vec::new();
    for k in keys {
        if c.lookup(sid, std::slice::from_ref(k)).await.unwrap() == 1 {
            out.push(*k);
        }
    }
    out
}

#[test]
fn events_rebuild_what_l2_holds_through_commits_evictions_and_a_clear() {
    // No L3: a full pool evicts leaves, each a removed event.
    let d = Daemon::start("events", &["l2.pool_pages=32", "l3.backend=none"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let first = chain(1, 8);
        store(&mut c, &s, &first).await;
        // A new subscriber starts from a snapshot of what is there.
        let mut w = c.watch_events(0, 0).await.unwrap();
        let mut held = Held::default();
        held.catch_up(&mut w).await;
        assert_eq!(held.resyncs, 1);
        assert_eq!(held.pages.len(), 8);
        assert_eq!(
            held.pages[&first[3]],
            Some(first[2]),
            "parents come with pages"
        );
        // Concurrent writers fill the pool past its size: events follow every commit and
        // eviction, in order.
        let mut all = first.clone();
        let mut tasks = Vec::new();
        for w in 0..4u32 {
            let keys = chain(100 + w, 12);
            all.extend(&keys);
            let target = d.target();
            tasks.push(tokio::spawn(async move {
                let mut c = HostClient::connect(&target).await.unwrap();
                let s = c.register(&format!("w{w}"), &layout("m")).await.unwrap();
                store(&mut c, &s, &keys).await;
                c.close(s.id).await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        held.catch_up(&mut w).await;
        let mut want = in_l2(&mut c, s.id, &all).await;
        let mut got: Vec<PageKey> = held.pages.keys().copied().collect();
        want.sort();
        got.sort();
        assert!(
            want.len() <= 32 && want.len() < all.len(),
            "some were evicted"
        );
        assert_eq!(got, want, "the events say what L2 holds");
        // The operator's clear removes every idle page: one removed event each.
        let ch = kvtier_client::connect(&d.target()).await.unwrap();
        let r = v1::admin_client::AdminClient::new(ch)
            .clear(v1::ClearRequest {
                tier: v1::Tier::Host as i32,
                dry_run: false,
            })
            .await
            .unwrap()
            .into_inner();
        assert!(r.removed > 0);
        held.catch_up(&mut w).await;
        assert!(held.pages.is_empty(), "{:?}", held.pages.len());
        assert_eq!(held.resyncs, 1, "a reader that keeps up never resyncs");
    });
}

#[test]
fn a_resume_replays_what_was_missed_and_a_restart_is_a_new_stream() {
    let d = Daemon::start("events-resume", &["l2.pool_pages=64", "l3.backend=none"]);
    let dir = rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let mut w = c.watch_events(0, 0).await.unwrap();
        let mut held = Held::default();
        held.catch_up(&mut w).await;
        let a = chain(1, 4);
        store(&mut c, &s, &a).await;
        held.catch_up(&mut w).await;
        drop(w);
        // While nobody listens: four more pages.
        let b = chain(2, 4);
        store(&mut c, &s, &b).await;
        let mut w = c.watch_events(held.stream_id, held.last_seq).await.unwrap();
        let batch = w.next().await.unwrap().unwrap();
        assert!(
            batch
                .events
                .iter()
                .all(|e| matches!(e.kind, EventKind::Stored { .. }) && e.seq > 0),
            "a replay, not a snapshot: {batch:?}"
        );
        let fp = s.layout.fingerprint();
        assert!(
            batch.events.iter().all(|e| e.layout == Some(fp)),
            "events name the layout's fingerprint"
        );
        held.apply(batch.stream_id, &batch.events);
        held.catch_up(&mut w).await;
        assert_eq!(held.pages.len(), 8);
        assert_eq!(held.resyncs, 1);
        (held.stream_id, held.last_seq)
    });
    let (old_stream, old_seq) = dir;
    let dir = d.stop_keeping_dir();
    let d = Daemon::start_in(dir, &["l2.pool_pages=64", "l3.backend=none"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let mut w = c.watch_events(old_stream, old_seq).await.unwrap();
        let b = w.next().await.unwrap().unwrap();
        assert_ne!(b.stream_id, old_stream, "a restart is a new stream");
        assert_eq!(b.events[0].kind, EventKind::Resync, "{b:?}");
        // The new run's first event says it holds nothing of the old one's.
        let mut w = c.watch_events(b.stream_id, 0).await.unwrap();
        let b = w.next().await.unwrap().unwrap();
        assert_eq!(
            (b.events[0].seq, b.events[0].kind),
            (1, EventKind::Cleared { tenant: None })
        );
    });
}

#[test]
fn a_subscriber_that_never_reads_does_not_slow_commits_and_catches_up_when_it_reads() {
    // No L3 and a small pool: every store past 256 pages evicts one, so each store is two
    // batches of events (the eviction at reserve, the page at commit).
    let d = Daemon::start("events-stalled", &["l2.pool_pages=256", "l3.backend=none"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        // Distinct pages, each the first of its prompt.
        let mut next = 0u64;
        let mut stores = |n: usize| -> Vec<PageKey> {
            (0..n)
                .map(|_| {
                    next += 1;
                    let mut k = [0xe7u8; 32];
                    k[..8].copy_from_slice(&next.to_le_bytes());
                    PageKey(k)
                })
                .collect()
        };
        let first = stores(1000);
        let t = std::time::Instant::now();
        for k in &first {
            store(&mut c, &s, std::slice::from_ref(k)).await;
        }
        let alone = t.elapsed();
        // A subscriber that reads nothing while far more batches than its backlog go by.
        let mut stalled = c.watch_events(0, 0).await.unwrap();
        let more = stores(3000);
        let t = std::time::Instant::now();
        for k in &more[..1000] {
            store(&mut c, &s, std::slice::from_ref(k)).await;
        }
        let with = t.elapsed();
        for k in &more[1000..] {
            store(&mut c, &s, std::slice::from_ref(k)).await;
        }
        assert!(
            with.as_secs_f64() < alone.as_secs_f64() * 3.0,
            "commits slowed by a stalled subscriber: {alone:?} for 1000 alone, {with:?} with it"
        );
        // When it reads again it catches up to what L2 holds (through the connection's
        // buffers here; one that falls further behind resyncs: events.rs's unit tests).
        let mut held = Held::default();
        held.catch_up(&mut stalled).await;
        let ready = c.stats().await.unwrap().pools[0].ready_pages as usize;
        assert_eq!(held.pages.len(), ready);
        assert_eq!(ready, 256);
    });
}

#[test]
fn locate_answers_per_tier_with_no_session_and_names_bad_input() {
    // File L3, written through: after L2 is cleared, the pages are in L3 only.
    let d = Daemon::start("locate", &["l2.pool_pages=64"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let fp = s.layout.fingerprint();
        let keys = chain(3, 6);
        store(&mut c, &s, &keys[..5]).await;
        let mut router = HostClient::connect(&d.target()).await.unwrap();
        let got = router.locate(&fp, &keys, true).await.unwrap();
        assert_eq!((got.l2_pages, got.l3_pages), (5, 0));
        assert!(!got.node.is_empty());
        // By tokens: kvtierd hashes them as the engine did (chain's tokens, 16 a page).
        let tokens: Vec<u32> = (0..6 * 16).map(|i| 3 * 1_000_003 + i).collect();
        let by_tokens = router
            .raw()
            .locate(v1::LocateRequest {
                layout: fp.to_hex(),
                tokens: tokens.clone(),
                page_size: 16,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(by_tokens.l2_pages, 5);
        // Another layout holds nothing.
        let other = kvtier_core::LayoutFingerprint([9; 16]);
        assert_eq!(
            router.locate(&other, &keys, true).await.unwrap().l2_pages,
            0
        );
        // Once L3 holds them and L2 is cleared: all in L3.
        eventually("5 pages in L3", Duration::from_secs(20), || {
            l3_files(&d.dir) >= 5
        });
        v1::admin_client::AdminClient::new(kvtier_client::connect(&d.target()).await.unwrap())
            .clear(v1::ClearRequest {
                tier: v1::Tier::Host as i32,
                dry_run: false,
            })
            .await
            .unwrap();
        let got = router.locate(&fp, &keys, true).await.unwrap();
        assert_eq!((got.l2_pages, got.l3_pages), (0, 5));
        // Bad input is refused by name.
        let raw = router.raw().clone();
        let bad = |req: v1::LocateRequest, field: &'static str| {
            let mut r = raw.clone();
            async move {
                let e = r.locate(req).await.unwrap_err();
                assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
                assert!(e.message().contains(field), "{field}: {}", e.message());
            }
        };
        bad(
            v1::LocateRequest {
                layout: "xyz".into(),
                ..Default::default()
            },
            "layout",
        )
        .await;
        bad(
            v1::LocateRequest {
                layout: fp.to_hex(),
                tokens: tokens.clone(),
                ..Default::default()
            },
            "page_size",
        )
        .await;
        bad(
            v1::LocateRequest {
                layout: fp.to_hex(),
                tokens,
                page_size: 16,
                packed_keys: kvtier_proto::pack_keys(&keys),
                ..Default::default()
            },
            "tokens",
        )
        .await;
    });
}

#[test]
fn l3_events_follow_write_through_the_backends_evictions_and_a_clear() {
    // A file L3 bounded to 10 pages: write-through lands each committed page there (STORED,
    // tier L3), the bound evicts the oldest (REMOVED, tier L3), and the operator's clear of
    // L3 is a CLEARED of that tier only.
    let object = 16_384 + 72;
    let cap = format!("l3.file.capacity_bytes={}", 10 * object);
    let d = Daemon::start(
        "events-l3",
        &["l2.pool_pages=64", "l3.write_policy=write_through", &cap],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        let (first, second) = (chain(1, 8), chain(2, 8));
        store(&mut c, &s, &first).await;
        let mut w = c.watch_events(0, 0).await.unwrap();
        let mut held = Held::default();
        held.catch_up(&mut w).await;
        assert_eq!(held.pages.len(), 8);
        let l3: Vec<PageKey> = first
            .iter()
            .filter(|k| held.l3.contains_key(k))
            .copied()
            .collect();
        assert_eq!(
            l3, first,
            "every page landed in L3: in the snapshot or after it"
        );
        assert_eq!(
            held.l3[&first[3]],
            Some(first[2]),
            "parents come with L3 pages too"
        );
        // Eight more: L3 keeps 10, six of the first eight go (the least recently written;
        // their writes landed in no set order), each a REMOVED of L3.
        store(&mut c, &s, &second).await;
        eventually("the L3 writes", Duration::from_secs(10), || {
            l3_files(&d.dir) == 10
        });
        held.catch_up(&mut w).await;
        assert_eq!(held.pages.len(), 16, "L2 keeps them all");
        assert_eq!(held.l3.len(), 10, "{:?}", held.l3.len());
        assert_eq!(first.iter().filter(|k| held.l3.contains_key(k)).count(), 2);
        assert!(second.iter().all(|k| held.l3.contains_key(k)));
        // The operator clears L3: a CLEARED of L3; L2's pages stay.
        let ch = kvtier_client::connect(&d.target()).await.unwrap();
        v1::admin_client::AdminClient::new(ch)
            .clear(v1::ClearRequest {
                tier: v1::Tier::Storage as i32,
                dry_run: false,
            })
            .await
            .unwrap();
        held.catch_up(&mut w).await;
        assert!(held.l3.is_empty());
        assert_eq!(held.pages.len(), 16);
    });
}

/// Issue 62: each new stream's snapshot was built and encoded whole under kvtierd's state
/// lock, and streams had no bound: one tenant opening streams slowed every other's writes
/// and held 12 to 31 MB per stalled stream. Now a caller holds at most
/// `server.max_streams_per_caller` streams of each kind (refused past it, and its place back
/// when a stream ends), and a snapshot larger than one message goes out a batch at a time,
/// parents first, built after the lock.
#[test]
fn a_caller_holds_a_bounded_number_of_streams_and_a_big_snapshot_streams_in_order() {
    let d = Daemon::start(
        "events-bounded",
        &[
            "l2.pool_pages=2048",
            "l3.backend=none",
            "server.max_streams_per_caller=2",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        // More pages than one message carries (1,024 events).
        let keys = chain(9, 1500);
        store(&mut c, &s, &keys).await;
        let mut a = c.watch_events(0, 0).await.unwrap();
        let b = c.watch_events(0, 0).await.unwrap();
        let e = c.watch_events(0, 0).await.err().expect("a third stream");
        assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
        assert!(e.to_string().contains("max_streams_per_caller"), "{e}");
        // Another kind is bounded on its own.
        let _m = c.watch_metrics(Duration::from_secs(1)).await.unwrap();
        // The snapshot: several messages, each page after its parent.
        let mut held = Held::default();
        let mut seen = std::collections::HashSet::new();
        let mut messages = 0;
        while let Ok(Ok(Some(batch))) =
            tokio::time::timeout(Duration::from_millis(500), a.next()).await
        {
            messages += 1;
            for ev in &batch.events {
                if let EventKind::Stored { key, parent } = ev.kind
                    && ev.tier == EventTier::L2Host
                {
                    assert!(
                        parent.is_none_or(|p| seen.contains(&p)),
                        "a child before its parent"
                    );
                    seen.insert(key);
                }
            }
            held.apply(batch.stream_id, &batch.events);
        }
        assert!(messages >= 2, "{messages} messages");
        assert_eq!(held.pages.len(), keys.len());
        // A stream that ends gives its caller's place back.
        drop(b);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            match c.watch_events(0, 0).await {
                Ok(_) => break,
                Err(e) => {
                    assert_eq!(e.code(), Some(tonic::Code::ResourceExhausted), "{e}");
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the place never came back"
                    );
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
}
