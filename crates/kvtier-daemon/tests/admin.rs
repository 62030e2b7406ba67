//! kvtierd's tier operations end to end, through kvtierctl's functions and the raw Admin
//! client, against a real daemon with a file backend and clients writing and reading at the
//! same time: flush (everything L3 lacked lands), drain (new work refused, what was
//! committed lands, then "safe to stop"), clear of L2 and L3 (with confirmation; pages in
//! use are never freed under a reader).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use kvtier_client::{HostClient, Reserved};
use kvtier_core::PageKey;
use kvtier_ctl::{ClearArgs, DrainArgs, FlushArgs, TierArg};
use kvtier_proto::v1;

/// Runs a blocking kvtierctl call off the test's runtime.
async fn ctl<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    tokio::task::spawn_blocking(f).await.unwrap()
}

async fn admin(d: &Daemon) -> v1::admin_client::AdminClient<tonic::transport::Channel> {
    v1::admin_client::AdminClient::new(kvtier_client::connect(&d.target()).await.unwrap())
}

/// `kvtierctl drain` with `cancel` / `wait_secs`; returns its output and progress lines.
async fn drain(d: &Daemon, cancel: bool, wait_secs: u64) -> (anyhow::Result<String>, Vec<u8>) {
    let socket = d.target();
    ctl(move || {
        let mut progress = Vec::new();
        let args = DrainArgs {
            socket,
            status: false,
            cancel,
            wait_secs,
        };
        (kvtier_ctl::tiers::drain(&args, &mut progress), progress)
    })
    .await
}

/// `kvtierctl flush`, waiting up to a minute.
async fn flush(d: &Daemon) -> anyhow::Result<String> {
    let socket = d.target();
    ctl(move || {
        kvtier_ctl::tiers::flush(&FlushArgs {
            socket,
            wait_secs: 60,
        })
    })
    .await
}

/// A client that stores chains `seeds` one after another until the daemon refuses a
/// reservation (it drains). Returns the keys it committed, and the refusal if there was one.
async fn writer(target: String, seeds: Vec<u32>) -> (Vec<PageKey>, Option<tonic::Code>) {
    let mut c = HostClient::connect(&target).await.unwrap();
    let s = c.register("writer", &layout("m")).await.unwrap();
    let page = s.layout.page_bytes();
    let mut committed = Vec::new();
    for seed in seeds {
        let keys = chain(seed, 8);
        let r = match c.reserve(s.id, None, &keys).await {
            Ok(r) => r,
            Err(e) => return (committed, e.code()),
        };
        let mine = reserved(&keys, &r);
        assert!(!r.contains(&Reserved::NoSpace), "the pool is sized for all");
        for (k, r) in keys.iter().zip(&r) {
            if let Reserved::Slot(slot) = r {
                s.pool.write(*slot, 0, &page_bytes(k, page)).unwrap();
            }
        }
        // Committing what was reserved goes on while draining: it is work in flight.
        c.commit(s.id, &mine).await.unwrap();
        committed.extend(mine);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (committed, None)
}

#[test]
fn flush_writes_what_l3_lacked_while_writers_keep_storing() {
    // Write-back with a pool far from full: nothing is written to L3 until asked.
    let d = Daemon::start(
        "flush",
        &["l2.pool_pages=2048", "l3.write_policy=write_back"],
    );
    rt().block_on(async {
        let first: Vec<_> = (0..4u32)
            .map(|w| {
                tokio::spawn(writer(
                    d.target(),
                    (0..3).map(|i| 100 + w * 10 + i).collect(),
                ))
            })
            .collect();
        let mut before = Vec::new();
        for t in first {
            let (keys, refused) = t.await.unwrap();
            assert_eq!(refused, None);
            before.extend(keys);
        }
        assert_eq!(before.len(), 96);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(l3_files(&d.dir), 0, "write_back wrote before any pressure");

        // Flush while a second wave of writers stores new pages.
        let second: Vec<_> = (0..4u32)
            .map(|w| {
                tokio::spawn(writer(
                    d.target(),
                    (0..3).map(|i| 500 + w * 10 + i).collect(),
                ))
            })
            .collect();
        let out = flush(&d).await.unwrap();
        for t in second {
            assert_eq!(t.await.unwrap().1, None);
        }
        assert!(out.starts_with("flushed: "), "{out}");
        let flushed: usize = out
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse().ok())
            .unwrap();
        assert!(flushed >= before.len(), "{out}");
        assert!(l3_files(&d.dir) >= before.len());
        // Every page of the first wave is in L3: a new daemon on the same directory finds
        // each chain whole there.
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let st = c.stats().await.unwrap().l3.unwrap();
        assert_eq!((st.failed_pages, st.deferred_pages), (0, 0));

        // Bad input: a wait of 0 names its field.
        let e = admin(&d)
            .await
            .flush(v1::FlushRequest { wait_ms: 0 })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("wait_ms"), "{}", e.message());
    });
    // Killed, and restarted without taking its pools over: only L3 can have them.
    let dir = d.kill();
    let d2 = Daemon::start_in(
        dir,
        &["l2.pool_pages=2048", "l2.take_over_after_crash=false"],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d2.target()).await.unwrap();
        let s = c.register("reader", &layout("m")).await.unwrap();
        for w in 0..4u32 {
            for i in 0..3 {
                let keys = chain(100 + w * 10 + i, 8);
                assert_eq!(
                    c.lookup_tiers(s.id, &keys, true).await.unwrap(),
                    (0, 8),
                    "chain {w}/{i} is not whole in L3 after the flush"
                );
            }
        }
    });
}

#[test]
fn flush_without_l3_is_refused_with_a_reason() {
    let d = Daemon::start("flush-none", &["l3.backend=none"]);
    let socket = d.target();
    let e = std::thread::spawn(move || {
        kvtier_ctl::tiers::flush(&FlushArgs {
            socket,
            wait_secs: 5,
        })
    })
    .join()
    .unwrap()
    .unwrap_err();
    assert!(format!("{e:#}").contains("no L3 tier is attached"), "{e:#}");
}

#[test]
fn drain_refuses_new_work_writes_what_was_committed_and_says_when_safe() {
    let d = Daemon::start(
        "drain",
        &[
            "l2.pool_pages=4096",
            "l3.write_policy=write_back",
            // Slow writes, so the drain has something to wait for.
            "l3.fault_set_delay=5ms",
        ],
    );
    rt().block_on(async {
        // A client with a reservation it has not committed yet.
        let mut held = HostClient::connect(&d.target()).await.unwrap();
        let hs = held.register("held", &layout("m")).await.unwrap();
        let held_keys = chain(9, 4);
        let r = held.reserve(hs.id, None, &held_keys).await.unwrap();
        assert_eq!(reserved(&held_keys, &r).len(), 4);

        // Writers run until the drain refuses them.
        let writers: Vec<_> = (0..6u32)
            .map(|w| {
                tokio::spawn(writer(
                    d.target(),
                    (0..40).map(|i| 1000 + w * 100 + i).collect(),
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(150)).await;
        let started = drain(&d, false, 0).await.0.unwrap();
        assert!(started.starts_with("draining"), "{started}");
        assert!(
            started.contains("being written by clients"),
            "the held reservation must keep the drain unsafe: {started}"
        );
        let mut committed = Vec::new();
        for t in writers {
            let (keys, refused) = t.await.unwrap();
            committed.extend(keys);
            assert_eq!(
                refused,
                Some(tonic::Code::Unavailable),
                "a writer was never refused"
            );
        }
        assert!(!committed.is_empty());

        // New sessions and prefetches are refused, with the reason; reads go on.
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let e = c.register("late", &layout("m")).await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::Unavailable));
        assert!(e.to_string().contains("draining"), "{e}");
        let first = &committed[..8];
        assert_eq!(held.lookup(hs.id, first).await.unwrap(), 8);
        let slots = held.acquire(hs.id, first).await.unwrap();
        assert_eq!(slots.len(), 8);
        let mut buf = vec![0u8; hs.layout.page_bytes()];
        hs.pool.read(slots[0], 0, &mut buf).unwrap();
        assert_eq!(buf, page_bytes(&first[0], buf.len()));
        held.release(hs.id, first).await.unwrap();
        let e = held
            .prefetch(
                hs.id,
                "p",
                &chain(77, 4),
                kvtier_client::PrefetchOptions::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::Unavailable));
        assert_eq!(
            kvtier_client::health(&d.target()).await.unwrap(),
            "NOTSERVING"
        );
        assert_eq!(metric(&d.metrics(), "kvtier_l2_draining"), 1.0);

        // The held reservation is committed: then the drain completes.
        let page = hs.layout.page_bytes();
        for (k, r) in held_keys.iter().zip(&r) {
            if let Reserved::Slot(slot) = r {
                hs.pool.write(*slot, 0, &page_bytes(k, page)).unwrap();
            }
        }
        held.commit(hs.id, &held_keys).await.unwrap();
        let out = drain(&d, false, 60).await.0.unwrap();
        assert!(out.starts_with("drained: safe to stop"), "{out}");
        assert!(out.contains("unwritten 0"), "{out}");
        // Nothing committed was left behind.
        let total = committed.len() + held_keys.len();
        assert_eq!(l3_files(&d.dir), total, "pages committed before the drain");
        let st = c.stats().await.unwrap().l3.unwrap();
        assert_eq!(st.failed_pages, 0);

        // Bad input names the field.
        let e = admin(&d)
            .await
            .drain(v1::DrainRequest { action: 0 })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("action"), "{}", e.message());

        // Cancel: admitted again.
        let out = drain(&d, true, 0).await.0.unwrap();
        assert!(out.contains("cancelled"), "{out}");
        c.register("again", &layout("m")).await.unwrap();
        assert_eq!(kvtier_client::health(&d.target()).await.unwrap(), "SERVING");
        assert_eq!(metric(&d.metrics(), "kvtier_l2_draining"), 0.0);
    });
}

#[test]
fn clear_asks_first_and_never_frees_a_page_in_use() {
    let d = Daemon::start(
        "clear",
        &["l2.pool_pages=256", "l3.write_policy=write_through"],
    );
    let args = |tier: TierArg, yes: bool, dry_run: bool| ClearArgs {
        tier,
        socket: d.target(),
        yes,
        dry_run,
    };
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("w", &layout("m")).await.unwrap();
        let mut all = Vec::new();
        for seed in 0..4 {
            let keys = chain(seed, 8);
            store(&mut c, &s, &keys).await;
            all.extend(keys);
        }
        eventually(
            "write-through wrote every page",
            Duration::from_secs(20),
            || l3_files(&d.dir) == 32,
        );

        // L3: a refusal changes nothing; a yes deletes every object.
        let a = args(TierArg::L3, false, false);
        let mut asked = String::new();
        let e = ctl(move || {
            kvtier_ctl::tiers::clear(&a, &mut |q| {
                asked = q.to_string();
                Ok("no".to_string())
            })
            .map(|_| asked.clone())
            .map_err(|e| (e, asked))
        })
        .await
        .unwrap_err();
        assert!(e.0.to_string().contains("not cleared"), "{}", e.0);
        assert!(e.1.contains("32 objects"), "{}", e.1);
        assert!(e.1.contains("Type 'clear l3'"), "{}", e.1);
        assert_eq!(l3_files(&d.dir), 32);
        let a = args(TierArg::L3, false, false);
        let out = ctl(move || kvtier_ctl::tiers::clear(&a, &mut |_| Ok("clear l3\n".into())))
            .await
            .unwrap();
        assert_eq!(
            out,
            "cleared l3: 32 objects deleted; 32 L2 pages will be written again\n"
        );
        assert_eq!(l3_files(&d.dir), 0);
        // L2 forgot L3 held them: a flush writes them all again.
        let out = flush(&d).await.unwrap();
        assert_eq!(out, "flushed: 32 pages are in L3\n");
        assert_eq!(l3_files(&d.dir), 32);

        // L2, while readers pin and read the first two chains: pages in use stay and read
        // right; the other two chains are idle and go.
        let readers: Vec<_> = (0..2usize)
            .map(|r| {
                let target = d.target();
                let keys = all[r * 8..r * 8 + 8].to_vec();
                tokio::spawn(async move {
                    let mut c = HostClient::connect(&target).await.unwrap();
                    let s = c.register("r", &layout("m")).await.unwrap();
                    let mut buf = vec![0u8; s.layout.page_bytes()];
                    let mut reads = 0;
                    let until = std::time::Instant::now() + Duration::from_millis(600);
                    while std::time::Instant::now() < until {
                        let slots = c.acquire(s.id, &keys).await.unwrap();
                        for (k, slot) in keys.iter().zip(&slots) {
                            tokio::time::sleep(Duration::from_micros(200)).await;
                            s.pool.read(*slot, 0, &mut buf).unwrap();
                            assert_eq!(buf, page_bytes(k, buf.len()), "a pinned page changed");
                            reads += 1;
                        }
                        c.release(s.id, &keys[..slots.len()]).await.unwrap();
                    }
                    reads
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        let a = args(TierArg::L2, false, true);
        let dry = ctl(move || kvtier_ctl::tiers::clear(&a, &mut |_| unreachable!()))
            .await
            .unwrap();
        assert!(dry.starts_with("This removes "), "{dry}");
        assert_eq!(
            c.lookup(s.id, &all[..8]).await.unwrap(),
            8,
            "a dry run removed"
        );
        let a = args(TierArg::L2, true, false);
        let out = ctl(move || kvtier_ctl::tiers::clear(&a, &mut |_| unreachable!()))
            .await
            .unwrap();
        assert!(out.starts_with("cleared l2: "), "{out}");
        assert!(out.contains("(0 were not in L3)"), "{out}");
        for r in readers {
            assert!(r.await.unwrap() > 0);
        }
        let page = metric(&d.metrics(), "kvtier_l2_cleared_pages_total");
        assert!((16.0..=32.0).contains(&page), "{page}");
        assert_eq!(
            metric(
                &d.metrics(),
                "kvtier_l2_lost_pages_total{reason=\"cleared\"}"
            ),
            0.0
        );
        // Once nobody pins them, a second clear takes the rest; L3 still has every page.
        let a = args(TierArg::L2, true, false);
        ctl(move || kvtier_ctl::tiers::clear(&a, &mut |_| unreachable!()))
            .await
            .unwrap();
        let ready: u32 = c
            .stats()
            .await
            .unwrap()
            .pools
            .iter()
            .map(|p| p.ready_pages)
            .sum();
        assert_eq!(ready, 0);
        for k in all.chunks(8) {
            assert_eq!(c.lookup_tiers(s.id, k, true).await.unwrap(), (0, 8));
        }

        // Bad input names the field.
        let mut a = admin(&d).await;
        for (tier, dry_run, field) in [
            (v1::Tier::Device, false, "tier"),
            (v1::Tier::Unspecified, false, "tier"),
            (v1::Tier::Storage, true, "dry_run"),
        ] {
            let e = a
                .clear(v1::ClearRequest {
                    tier: tier as i32,
                    dry_run,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(field), "{}", e.message());
        }
        assert_eq!(l3_files(&d.dir), 32, "a bad request removed something");
    });
}
