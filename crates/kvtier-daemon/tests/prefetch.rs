//! Prefetch from L3 into L2 end to end, on real kvtierd processes over a real file backend
//! (slowed on purpose with `l3.fault_get_delay`): each stop policy, revocation before any
//! slot is allocated, races with eviction, session expiry and backend failure, and the
//! metrics stream.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use kvtier_client::{HostClient, PrefetchOptions, Reserved, Session, outcome};
use kvtier_core::PageKey;
use kvtier_proto::v1::{self, PrefetchPolicy, PrefetchState};

/// A data directory whose file L3 holds `chains` (seed, pages), written by a daemon that is
/// gone: a daemon started on it has an empty L2 and everything in L3.
fn populated(name: &str, chains: &[(u32, usize)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // Its pool is not taken over after the kill: these tests start from pages in L3 only.
    let d = Daemon::start_in(
        dir.clone(),
        &["l2.pool_pages=512", "l2.take_over_after_crash=false"],
    );
    let total: usize = chains.iter().map(|c| c.1).sum();
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("writer", &layout("m")).await.unwrap();
        for &(seed, n) in chains {
            store(&mut c, &s, &chain(seed, n)).await;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.stats().await.unwrap().l3.unwrap().objects < total as u64 {
            assert!(Instant::now() < deadline, "L3 never held every page");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    d.kill()
}

async fn run(
    c: &mut HostClient,
    s: &Session,
    id: &str,
    keys: &[PageKey],
    opts: PrefetchOptions,
) -> v1::PrefetchProgress {
    let mut stream = c.prefetch(s.id, id, keys, opts).await.unwrap();
    stream
        .message()
        .await
        .unwrap()
        .expect("a first progress message")
}

/// Checks that the pages in `slots` are exactly `keys`' bytes, then releases them.
async fn verify_and_release(c: &mut HostClient, s: &Session, keys: &[PageKey], slots: &[u32]) {
    let len = s.layout.page_bytes();
    let mut buf = vec![0u8; len];
    for (i, (k, &slot)) in keys.iter().zip(slots).enumerate() {
        s.pool.read(slot, 0, &mut buf).unwrap();
        assert!(buf == page_bytes(k, len), "page {i} is not what was stored");
    }
    c.release(s.id, &keys[..slots.len()]).await.unwrap();
}

/// Writes pages into every slot that is free or can be freed, then checks after `wait` that
/// each still holds what was written: a prefetch read landing late in a freed slot would
/// show up here.
async fn fill_and_check(c: &mut HostClient, s: &Session, seed: u32, wait: Duration) {
    let keys = chain(seed, s.pool.slots() as usize);
    let r = c.reserve(s.id, None, &keys).await.unwrap();
    let mine = reserved(&keys, &r);
    assert!(!mine.is_empty());
    let len = s.layout.page_bytes();
    for (k, r) in keys.iter().zip(&r) {
        if let Reserved::Slot(slot) = r {
            s.pool.write(*slot, 0, &page_bytes(k, len)).unwrap();
        }
    }
    c.commit(s.id, &mine).await.unwrap();
    tokio::time::sleep(wait).await;
    let slots = c.acquire(s.id, &mine).await.unwrap();
    assert_eq!(slots.len(), mine.len(), "the fresh pages were evicted");
    verify_and_release(c, s, &mine, &slots).await;
}

async fn quiet(c: &mut HostClient) -> v1::PoolStats {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let p = c.stats().await.unwrap().pools.remove(0);
        if p.writing_pages == 0 && p.pins == 0 {
            return p;
        }
        assert!(
            Instant::now() < deadline,
            "pins or reservations left: {p:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[test]
fn each_stop_policy_against_a_slow_backend() {
    // 64 pages (1024 tokens) per chain; reads take 40 ms each, two at a time: ~1.3 s each.
    let dir = populated("policies", &[(1, 64), (2, 64), (3, 64)]);
    let d = Daemon::start_in(
        dir,
        &[
            "l2.pool_pages=160",
            "prefetch.budget_fraction=1.0",
            "l3.fault_get_delay=40ms",
            // Deliberately slow: never revoke for being slower than recomputing.
            "prefetch.recompute_tokens_per_second=0",
            "prefetch.concurrency=2",
            "prefetch.max_concurrency=2",
            "prefetch.batch_pages=4",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();

        // wait_complete: the take waits for every page, which are exactly what was stored.
        let keys = chain(1, 64);
        let first = run(
            &mut c,
            &s,
            "wc",
            &keys,
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        assert_eq!(first.state, PrefetchState::Running as i32, "{first:?}");
        assert_eq!((first.l2_pages, first.hit_pages), (0, 64));
        let (p, slots) = c.take_prefetch(s.id, "wc").await.unwrap();
        assert_eq!(outcome(&p), "completed");
        assert_eq!((p.landed_pages, slots.len()), (64, 64));
        verify_and_release(&mut c, &s, &keys, &slots).await;

        // best_effort: the take returns at once with what landed, a usable prefix.
        let keys = chain(2, 64);
        let p = run(
            &mut c,
            &s,
            "be",
            &keys,
            PrefetchOptions::policy(PrefetchPolicy::BestEffort),
        )
        .await;
        assert_eq!(outcome(&p), "running", "{p:?}");
        tokio::time::sleep(Duration::from_millis(400)).await;
        let t = Instant::now();
        let (p, slots) = c.take_prefetch(s.id, "be").await.unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(300),
            "best_effort waited"
        );
        assert_eq!(outcome(&p), "partial");
        assert!(p.landed_pages > 0 && p.landed_pages < 64, "{p:?}");
        assert_eq!(slots.len(), p.landed_pages as usize);
        verify_and_release(&mut c, &s, &keys, &slots).await;
        let landed = c.lookup(s.id, &keys).await.unwrap();
        assert_eq!(landed, slots.len(), "the cancelled rest became visible");

        // timeout: the daemon stops it at the deadline and keeps what landed by then.
        let keys = chain(3, 64);
        let mut opts = PrefetchOptions::policy(PrefetchPolicy::Timeout);
        opts.hints.timeout_ms = 500;
        let t = Instant::now();
        let mut stream = c.prefetch(s.id, "to", &keys, opts).await.unwrap();
        let mut last = stream.message().await.unwrap().unwrap();
        assert_eq!(last.deadline_ms, 500);
        let mut updates = 0;
        // Progress is pushed: every message lands more pages, ending with the final state.
        while let Some(p) = stream.message().await.unwrap() {
            assert!(p.landed_pages >= last.landed_pages);
            last = p;
            updates += 1;
        }
        let waited = t.elapsed();
        assert_eq!(outcome(&last), "timed_out");
        assert!(updates >= 2, "only {updates} progress messages");
        assert!(
            waited >= Duration::from_millis(450) && waited < Duration::from_secs(3),
            "stopped after {waited:?}"
        );
        assert!(last.landed_pages > 0 && last.landed_pages < 64, "{last:?}");
        // Nothing of the cancelled rest is reserved any more; reuse every free slot at once
        // and check, after reads in flight would have finished, that nothing overwrote them.
        let (p, slots) = c.take_prefetch(s.id, "to").await.unwrap();
        assert_eq!(slots.len(), p.landed_pages as usize);
        verify_and_release(&mut c, &s, &keys, &slots).await;
        quiet(&mut c).await;
        fill_and_check(&mut c, &s, 99, Duration::from_millis(300)).await;
    });
    let m = d.metrics();
    for (outcome, n) in [("completed", 1.0), ("partial", 1.0), ("timed_out", 1.0)] {
        assert_eq!(
            metric(
                &m,
                &format!("kvtier_prefetch_requests_total{{outcome=\"{outcome}\",reason=\"\"}}")
            ),
            n,
            "{outcome}"
        );
    }
    assert_eq!(
        metric(&m, "kvtier_prefetch_pages_total{stage=\"hit\"}"),
        192.0
    );
    assert!(metric(&m, "kvtier_prefetch_pages_total{stage=\"landed\"}") > 64.0);
    assert_eq!(metric(&m, "kvtier_prefetch_duration_seconds_count"), 3.0);
    assert_eq!(metric(&m, "kvtier_prefetch_wait_seconds_count"), 3.0);
    assert_eq!(
        metric(&m, "kvtier_prefetch_bandwidth_gigabytes_per_second_count"),
        3.0
    );
    assert_eq!(
        metric(&m, "kvtier_prefetch_budget_pages{state=\"used\"}"),
        0.0
    );
    assert_eq!(metric(&m, "kvtier_prefetch_inflight"), 0.0);
}

#[test]
fn revoked_prefetches_allocate_nothing() {
    // 4 pages = 64 tokens (under the 256-token threshold); 32 pages = 512 tokens.
    let dir = populated("revoke", &[(10, 4), (11, 32), (12, 32), (13, 32)]);
    // The load-versus-recompute check only where a request asks for it (a busy machine must
    // not make the other prefetches here look slower than recomputing).
    let d = Daemon::start_in(
        dir,
        &[
            "l2.pool_pages=40",
            "prefetch.budget_fraction=0.5",
            "prefetch.recompute_tokens_per_second=0",
        ],
    );
    let gets = |d: &Daemon| {
        let m = d.metrics();
        ["hit", "miss"]
            .iter()
            .map(|o| {
                metric(
                    &m,
                    &format!(
                        "kvtier_l3_backend_ops_total{{backend=\"file\",op=\"get\",outcome=\"{o}\"}}"
                    ),
                )
            })
            .sum::<f64>()
    };
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let free = |p: &v1::PoolStats| p.slots - p.ready_pages - p.writing_pages;

        let p = run(
            &mut c,
            &s,
            "short",
            &chain(10, 4),
            PrefetchOptions::default(),
        )
        .await;
        assert_eq!(outcome(&p), "revoked:below_threshold");
        // The same hit is worth it when the request lowers the threshold.
        let mut low = PrefetchOptions::default();
        low.hints.threshold_tokens = Some(16);
        let p = run(&mut c, &s, "short2", &chain(10, 4), low).await;
        assert_eq!(outcome(&p), "running", "{p:?}");
        let (p, slots) = c.take_prefetch(s.id, "short2").await.unwrap();
        assert_eq!((outcome(&p).as_str(), slots.len()), ("completed", 4));
        verify_and_release(&mut c, &s, &chain(10, 4), &slots).await;
        let before = quiet(&mut c).await;
        let gets_before = gets(&d);

        // Nothing in L3: no slot, no read.
        let p = run(
            &mut c,
            &s,
            "none",
            &chain(77, 32),
            PrefetchOptions::default(),
        )
        .await;
        assert_eq!(outcome(&p), "revoked:miss");
        // Everything already in L2.
        let p = run(&mut c, &s, "l2", &chain(10, 4), PrefetchOptions::default()).await;
        assert_eq!(outcome(&p), "revoked:in_l2");
        assert_eq!(p.l2_pages, 4);
        // Loading is known (from the prefetch above) to be slower than an engine that
        // recomputes 10^12 tokens a second.
        let mut fast_engine = PrefetchOptions::default();
        fast_engine.hints.recompute_tokens_per_second = 1_000_000_000_000;
        let p = run(&mut c, &s, "fast", &chain(11, 32), fast_engine).await;
        assert_eq!(outcome(&p), "revoked:slower_than_recompute");
        let after = quiet(&mut c).await;
        assert_eq!(free(&after), free(&before), "a revoked prefetch took slots");
        assert_eq!(gets(&d), gets_before, "a revoked prefetch read pages");

        // The budget is half of 40 slots: a 32-page hit is cut to 20 (still above the
        // threshold), and while it holds them a second prefetch finds no budget.
        let p = run(
            &mut c,
            &s,
            "big",
            &chain(11, 32),
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        assert_eq!((outcome(&p).as_str(), p.hit_pages), ("running", 20));
        let p = run(
            &mut c,
            &s,
            "second",
            &chain(12, 32),
            PrefetchOptions::default(),
        )
        .await;
        assert_eq!(outcome(&p), "revoked:budget");
        // Revoked prefetches are not open: nothing to take.
        let e = c.take_prefetch(s.id, "second").await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::NotFound));
        let (p, slots) = c.take_prefetch(s.id, "big").await.unwrap();
        assert_eq!((outcome(&p).as_str(), slots.len()), ("completed", 20));
        verify_and_release(&mut c, &s, &chain(11, 32), &slots).await;
        // With the budget back, the second one runs.
        let p = run(
            &mut c,
            &s,
            "second",
            &chain(12, 32),
            PrefetchOptions::default(),
        )
        .await;
        assert_eq!(outcome(&p), "running");
        c.release_prefetch(s.id, "second").await.unwrap();
        // Its slots are freed once its reads in flight are dropped.
        quiet(&mut c).await;

        // Bad requests are refused by field, and change nothing.
        let e = c
            .prefetch(s.id, "", &chain(13, 32), PrefetchOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument));
        assert!(e.to_string().contains("request_id"), "{e}");
        let mut raw = c.raw().clone();
        let e = raw
            .prefetch(v1::PrefetchRequest {
                session_id: s.id.to_bytes().to_vec(),
                request_id: "x".into(),
                keys: vec![vec![1, 2, 3]],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("keys[0]"), "{}", e.message());
        let e = raw
            .prefetch(v1::PrefetchRequest {
                session_id: s.id.to_bytes().to_vec(),
                request_id: "x".into(),
                keys: vec![chain(13, 1)[0].0.to_vec()],
                policy: 42,
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert!(e.message().contains("policy"), "{}", e.message());
        // The same name twice while the first is open.
        run(
            &mut c,
            &s,
            "dup",
            &chain(13, 32),
            PrefetchOptions::default(),
        )
        .await;
        let e = c
            .prefetch(s.id, "dup", &chain(13, 32), PrefetchOptions::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::InvalidArgument));
        c.release_prefetch(s.id, "dup").await.unwrap();
        quiet(&mut c).await;
    });
    let d2 = Daemon::start("revoke-none", &["l3.backend=none"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d2.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let p = run(&mut c, &s, "x", &chain(1, 32), PrefetchOptions::default()).await;
        assert_eq!(outcome(&p), "revoked:no_storage");
    });
    let m = d.metrics();
    for reason in [
        "below_threshold",
        "miss",
        "in_l2",
        "slower_than_recompute",
        "budget",
    ] {
        assert_eq!(
            metric(
                &m,
                &format!(
                    "kvtier_prefetch_requests_total{{outcome=\"revoked\",reason=\"{reason}\"}}"
                )
            ),
            1.0,
            "{reason}"
        );
    }
}

/// Overwrites the file-backend objects of `keys` with garbage of the same size.
fn corrupt(dir: &std::path::Path, keys: &[PageKey]) -> usize {
    let mut n = 0;
    let names: Vec<String> = keys.iter().map(|k| k.to_hex()).collect();
    let mut stack = vec![dir.join("l3/objects")];
    while let Some(p) = stack.pop() {
        for e in std::fs::read_dir(&p).unwrap().flatten() {
            let path = e.path();
            if path.is_dir() {
                stack.push(path);
            } else if names.iter().any(|n| {
                path.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .contains(n.as_str())
            }) {
                let len = std::fs::metadata(&path).unwrap().len() as usize;
                std::fs::write(&path, vec![0x5a; len]).unwrap();
                n += 1;
            }
        }
    }
    n
}

#[test]
fn a_failing_backend_yields_a_correct_prefix_and_no_retry_loop() {
    let dir = populated("corrupt", &[(20, 48), (21, 48)]);
    // Stale exists: the objects are still there, but from page 20 on they are garbage.
    let keys = chain(20, 48);
    assert_eq!(corrupt(&dir, &keys[20..]), 28);
    let d = Daemon::start_in(
        dir.clone(),
        &[
            "l2.pool_pages=128",
            "l3.fault_get_delay=20ms",
            "prefetch.recompute_tokens_per_second=0",
            "prefetch.concurrency=2",
            "prefetch.max_concurrency=2",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let opts = || PrefetchOptions::policy(PrefetchPolicy::WaitComplete);
        run(&mut c, &s, "a", &keys, opts()).await;
        let (p, slots) = c.take_prefetch(s.id, "a").await.unwrap();
        assert_eq!(outcome(&p), "failed:corrupt");
        assert_eq!(slots.len(), 20);
        verify_and_release(&mut c, &s, &keys, &slots).await;
        // The bad key is remembered: neither lookup nor a second prefetch goes back to it.
        assert_eq!(c.lookup_tiers(s.id, &keys, true).await.unwrap(), (20, 0));
        let p = run(&mut c, &s, "b", &keys, opts()).await;
        assert_eq!(outcome(&p), "revoked:miss");

        // The backend fails while a prefetch runs: what landed is still exactly right.
        let keys = chain(21, 48);
        let p = run(&mut c, &s, "c", &keys, opts()).await;
        assert_eq!(outcome(&p), "running", "{p:?}");
        tokio::time::sleep(Duration::from_millis(150)).await;
        corrupt(&dir, &keys);
        let (p, slots) = c.take_prefetch(s.id, "c").await.unwrap();
        assert_eq!(outcome(&p), "failed:corrupt", "{p:?}");
        assert!(slots.len() < 48);
        verify_and_release(&mut c, &s, &keys, &slots).await;
        quiet(&mut c).await;
    });
    let m = d.metrics();
    assert_eq!(
        metric(
            &m,
            "kvtier_prefetch_requests_total{outcome=\"failed\",reason=\"corrupt\"}"
        ),
        2.0
    );
    assert!(metric(&m, "kvtier_prefetch_negative_keys") >= 1.0);
}

#[test]
fn prefetch_races_with_eviction_and_session_expiry() {
    let dir = populated("race", &[(30, 48), (31, 48)]);
    let d = Daemon::start_in(
        dir,
        &[
            "l2.pool_pages=96",
            "prefetch.budget_fraction=1.0",
            "l3.fault_get_delay=30ms",
            "prefetch.recompute_tokens_per_second=0",
            "prefetch.concurrency=2",
            "prefetch.max_concurrency=2",
            "sessions.ttl=400ms",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let mut w = HostClient::connect(&d.target()).await.unwrap();
        let ws = w.register("writer", &layout("m")).await.unwrap();

        // Another worker keeps storing fresh pages, forcing evictions, while a prefetch
        // loads; both end up with exactly their own bytes.
        let keys = chain(30, 48);
        let p = run(
            &mut c,
            &s,
            "ev",
            &keys,
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        assert_eq!(outcome(&p), "running", "{p:?}");
        let mut seed = 1000;
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(600) {
            let mine = chain(seed, 8);
            seed += 1;
            store(&mut w, &ws, &mine).await;
            let slots = w.acquire(ws.id, &mine).await.unwrap();
            verify_and_release(&mut w, &ws, &mine, &slots).await;
            c.heartbeat(s.id).await.unwrap();
        }
        let (p, slots) = c.take_prefetch(s.id, "ev").await.unwrap();
        assert_eq!(outcome(&p), "completed");
        verify_and_release(&mut c, &s, &keys, &slots).await;

        // The engine's session expires mid-prefetch: its slots and pins are freed once the
        // reads in flight are dropped, and nothing lands in them later.
        let keys = chain(31, 48);
        let p = run(
            &mut c,
            &s,
            "exp",
            &keys,
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        assert_eq!(outcome(&p), "running", "{p:?}");
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            w.heartbeat(ws.id).await.unwrap();
            let st = w.stats().await.unwrap();
            if st.sessions.len() == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the silent session never expired"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let e = c.take_prefetch(s.id, "exp").await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::NotFound));
        quiet(&mut w).await;
        fill_and_check(&mut w, &ws, 3000, Duration::from_millis(300)).await;
    });
    let m = d.metrics();
    assert_eq!(
        metric(
            &m,
            "kvtier_prefetch_requests_total{outcome=\"failed\",reason=\"session_closed\"}"
        ),
        1.0
    );
    assert!(metric(&m, "kvtier_l2_evictions_total") > 0.0);
    assert_eq!(
        metric(&m, "kvtier_prefetch_budget_pages{state=\"used\"}"),
        0.0
    );
}

#[test]
fn status_polls_and_release_cancels() {
    let dir = populated("status", &[(40, 32)]);
    let d = Daemon::start_in(
        dir,
        &[
            "l2.pool_pages=64",
            "l3.fault_get_delay=50ms",
            "prefetch.recompute_tokens_per_second=0",
            "prefetch.concurrency=1",
            "prefetch.max_concurrency=1",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let keys = chain(40, 32);
        // The stream is not needed: dropping it does not cancel the prefetch.
        drop(
            c.prefetch(s.id, "p", &keys, PrefetchOptions::default())
                .await
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
        let p = c.prefetch_status(s.id, "p").await.unwrap();
        assert_eq!(outcome(&p), "running");
        assert!(p.landed_pages > 0, "{p:?}");
        c.release_prefetch(s.id, "p").await.unwrap();
        let e = c.prefetch_status(s.id, "p").await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::NotFound));
        let e = c.release_prefetch(s.id, "p").await.unwrap_err();
        assert_eq!(e.code(), Some(tonic::Code::NotFound));
        quiet(&mut c).await;
        // Pages that landed before the release stay in L2, unpinned.
        assert!(c.lookup(s.id, &keys).await.unwrap() > 0);
    });
}

#[test]
fn watch_metrics_matches_the_prometheus_endpoint() {
    let dir = populated("watch", &[(50, 32)]);
    let d = Daemon::start_in(dir, &["l2.pool_pages=64"]);
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("engine", &layout("m")).await.unwrap();
        let keys = chain(50, 32);
        assert_eq!(c.lookup_tiers(s.id, &keys, true).await.unwrap(), (0, 32));
        run(
            &mut c,
            &s,
            "w",
            &keys,
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        let (_, slots) = c.take_prefetch(s.id, "w").await.unwrap();
        verify_and_release(&mut c, &s, &keys, &slots).await;

        let e = c
            .watch_metrics(Duration::from_millis(10))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("interval_ms"), "{e}");
        let mut stream = c.watch_metrics(Duration::from_millis(150)).await.unwrap();
        let a = stream.message().await.unwrap().unwrap();
        let b = stream.message().await.unwrap().unwrap();
        assert_eq!((a.seq, b.seq), (1, 2));
        assert!(
            b.unix_ms >= a.unix_ms + 100,
            "snapshots closer than the interval"
        );
        // Quiet daemon: the text endpoint shows the same counters and histograms.
        let text = d.metrics();
        let mut compared = 0;
        for sample in &b.samples {
            let labels: Vec<String> = sample
                .labels
                .iter()
                .map(|l| format!("{}=\"{}\"", l.name, l.value))
                .collect();
            let series = |suffix: &str| {
                if labels.is_empty() {
                    format!("{}{suffix}", sample.name)
                } else {
                    format!("{}{suffix}{{{}}}", sample.name, labels.join(","))
                }
            };
            match v1::MetricKind::try_from(sample.kind).unwrap() {
                v1::MetricKind::Counter => {
                    assert_eq!(metric(&text, &series("")), sample.value, "{}", series(""));
                    compared += 1;
                }
                v1::MetricKind::Histogram => {
                    assert_eq!(
                        metric(&text, &series("_count")),
                        sample.count as f64,
                        "{}",
                        series("_count")
                    );
                    compared += 1;
                }
                _ => {}
            }
        }
        assert!(compared > 20, "only {compared} series compared");
        let get = |name: &str, label: &str| {
            b.samples
                .iter()
                .find(|s| s.name == name && s.labels.iter().any(|l| l.value == label))
                .map(|s| s.value)
        };
        assert_eq!(get("kvtier_prefetch_pages_total", "landed"), Some(32.0));
        assert_eq!(get("kvtier_lookup_pages_total", "l3"), Some(32.0));
    });
}

#[test]
fn a_chain_running_from_l3_into_l2_is_found_and_loaded_whole() {
    // With L3 attached, L2 may evict a page whose later pages it keeps: the chain then starts
    // in L3 and goes on in L2, where its last pages may not be in L3 at all yet. Lookup counts
    // it whole, and a prefetch fetches only what L2 lacks, pinning the rest where it is.
    let d = Daemon::start(
        "holes",
        &[
            "l2.pool_pages=8",
            "l2.dirty_fraction=1.0",
            "l3.write_policy=write_through_selective",
            "l3.write_threshold=1",
            "prefetch.threshold_tokens=0",
            "prefetch.budget_fraction=1.0",
            // Every write to L3 takes 2 s: the flusher, which writes the chain's unwritten
            // tail once the pool is full, cannot land it before the next pages evict (else
            // the tail would be the first to go, a leaf L3 holds, and the test would race).
            "l3.fault_set_delay=2s",
        ],
    );
    rt().block_on(async {
        let mut c = HostClient::connect(&d.target()).await.unwrap();
        let s = c.register("w", &layout("m")).await.unwrap();
        let a = chain(70, 8);
        // The first six pages are hit once, so L3 gets them; the last two are not.
        store(&mut c, &s, &a[..6]).await;
        assert_eq!(c.acquire(s.id, &a[..6]).await.unwrap().len(), 6);
        c.release(s.id, &a[..6]).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        while c.stats().await.unwrap().l3.unwrap().written_pages < 6 {
            assert!(Instant::now() < deadline, "L3 never got the chain");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = c.reserve(s.id, Some(&a[5]), &a[6..]).await.unwrap();
        let len = s.layout.page_bytes();
        for (k, r) in a[6..].iter().zip(&r) {
            let Reserved::Slot(slot) = r else {
                panic!("no slot for the chain's tail: {r:?}")
            };
            s.pool.write(*slot, 0, &page_bytes(k, len)).unwrap();
        }
        c.commit(s.id, &a[6..]).await.unwrap();
        // The pool is full; two more pages make two of the chain's interior pages (held by
        // L3) leave. Hit once, L3 gets them too, so a prefetch may make room among them.
        let b = chain(71, 2);
        store(&mut c, &s, &b).await;
        assert_eq!(c.acquire(s.id, &b).await.unwrap().len(), 2);
        c.release(s.id, &b).await.unwrap();
        while c.stats().await.unwrap().l3.unwrap().written_pages < 8 {
            assert!(Instant::now() < deadline, "L3 never got the other pages");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (l2, rest) = c.lookup_tiers(s.id, &a, true).await.unwrap();
        assert!(l2 < 6, "nothing of the chain's head left L2 ({l2})");
        assert_eq!(
            l2 + rest,
            8,
            "the chain was not found whole ({l2} + {rest})"
        );
        let p = run(
            &mut c,
            &s,
            "whole",
            &a,
            PrefetchOptions::policy(PrefetchPolicy::WaitComplete),
        )
        .await;
        assert_eq!(
            (p.l2_pages as usize, p.hit_pages as usize),
            (l2, 8 - l2),
            "{p:?}"
        );
        let (p, slots) = c.take_prefetch(s.id, "whole").await.unwrap();
        assert_eq!((outcome(&p).as_str(), slots.len()), ("completed", 8));
        verify_and_release(&mut c, &s, &a, &slots).await;
        // Only the pages L2 lacked were read from L3.
        let m = d.metrics();
        let read = metric(&m, "kvtier_prefetch_pages_total{stage=\"hit\"}");
        assert_eq!(read, 2.0, "pages read from L3");
        quiet(&mut c).await;
    });
}
