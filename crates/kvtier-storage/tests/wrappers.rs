//! The circuit breaker and the fault injector: both conform when healthy; a failing or hanging
//! backend becomes fast misses, and a probe closes the breaker once the backend is back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::memory::MemoryStore;
use kvtier_storage::wrappers::{
    Breaker, BreakerConfig, BreakerState, Delayed, Fault, Faulty, Flaky,
};
use kvtier_storage::{Fetch, MissReason, OpCtx, PageStore, StorageError, Store, conformance};

fn cfg() -> BreakerConfig {
    BreakerConfig {
        failure_rate: 0.5,
        min_calls: 3,
        window: Duration::from_secs(10),
        cooldown: Duration::from_millis(100),
        timeout: Duration::from_millis(50),
    }
}

#[tokio::test]
async fn healthy_wrappers_conform() {
    let faulty = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    conformance::run_all(Arc::new(Breaker::new(faulty, cfg()))).await;
}

#[tokio::test]
async fn failures_open_the_breaker_and_a_probe_closes_it() {
    let faulty = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    let breaker = Arc::new(Breaker::new(faulty.clone(), cfg()));
    let ps = PageStore::new(breaker.clone());
    let (fp, key) = (LayoutFingerprint([1; 16]), PageKey([2; 32]));
    let ctx = || OpCtx::timeout(Duration::from_secs(5));
    ps.set(&ctx(), &fp, &key, Bytes::from_static(b"page"))
        .await
        .unwrap();

    faulty.set_fault(Some(Fault::Error));
    // One success and two failures: the window holds min_calls (3) at a rate of 2/3, over
    // the 0.5 that opens it.
    for _ in 0..2 {
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert!(matches!(
            ps.get(&ctx(), &fp, &key, None).await,
            Fetch::Miss(MissReason::Failed(_))
        ));
    }
    assert_eq!(breaker.state(), BreakerState::Open);
    // Open: calls are refused without touching the backend.
    let before = faulty.calls();
    assert!(matches!(
        ps.get(&ctx(), &fp, &key, None).await,
        Fetch::Miss(MissReason::Throttled)
    ));
    assert!(matches!(
        ps.set(&ctx(), &fp, &key, Bytes::new()).await,
        Err(StorageError::Unavailable(_))
    ));
    assert_eq!(faulty.calls(), before, "an open breaker let a call through");

    // After the cooldown one probe goes through; it fails, so the breaker opens again.
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(matches!(
        ps.get(&ctx(), &fp, &key, None).await,
        Fetch::Miss(MissReason::Failed(_))
    ));
    assert_eq!(breaker.state(), BreakerState::Open);

    // The backend recovers: the next probe succeeds and closes the breaker.
    faulty.set_fault(None);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        ps.get(&ctx(), &fp, &key, None).await.hit().unwrap(),
        Bytes::from_static(b"page")
    );
    assert_eq!(breaker.state(), BreakerState::Closed);
    let c = breaker.counts();
    assert_eq!((c.opened, c.probes, c.closed), (1, 2, 1), "{c:?}");
}

#[tokio::test]
async fn isolated_errors_never_open_the_breaker() {
    // One call in twenty fails, as a throttling S3 or a busy remote node would: the breaker
    // judges the rate, so it stays closed through hundreds of calls.
    let flaky = Arc::new(Flaky::new(Arc::new(MemoryStore::new()), 0.05, 11));
    let breaker = Arc::new(Breaker::new(flaky, cfg()));
    let mut failed = 0;
    for i in 0..600 {
        if breaker.exists(&format!("{i:x}")).await.is_err() {
            failed += 1;
        }
    }
    assert!(failed > 10, "the injector failed {failed} calls");
    assert_eq!(breaker.state(), BreakerState::Closed);
    assert_eq!(breaker.counts().opened, 0);
}

#[tokio::test]
async fn a_hanging_backend_costs_at_most_the_timeout_then_nothing() {
    let faulty = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    let breaker = Arc::new(Breaker::new(faulty.clone(), cfg()));
    let ps = PageStore::new(breaker.clone());
    let (fp, key) = (LayoutFingerprint([1; 16]), PageKey([2; 32]));
    faulty.set_fault(Some(Fault::Hang));
    let ctx = OpCtx::timeout(Duration::from_secs(10));
    for _ in 0..3 {
        let t = Instant::now();
        assert!(matches!(
            ps.get(&ctx, &fp, &key, None).await,
            Fetch::Miss(MissReason::Timeout)
        ));
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "a hung call was not cut at the timeout"
        );
    }
    assert_eq!(breaker.state(), BreakerState::Open);
    let t = Instant::now();
    for _ in 0..100 {
        assert!(matches!(
            ps.exists(&ctx, &fp, &key).await,
            Err(StorageError::Unavailable(_))
        ));
    }
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "open-breaker calls are not fast"
    );
}

#[tokio::test]
async fn bad_requests_do_not_open_the_breaker() {
    let breaker = Breaker::new(Arc::new(MemoryStore::new()), cfg());
    for _ in 0..10 {
        assert!(breaker.get("NOT A NAME").await.is_err());
    }
    assert_eq!(breaker.state(), BreakerState::Closed);
}

#[tokio::test]
async fn metered_reports_every_call_with_outcome_and_bytes() {
    use kvtier_storage::wrappers::{Metered, StoreObserver};
    use parking_lot::Mutex;

    #[derive(Debug, Default)]
    struct Log(Mutex<Vec<(&'static str, &'static str, &'static str, u64)>>);
    impl StoreObserver for Log {
        fn observe(
            &self,
            backend: &'static str,
            op: &'static str,
            outcome: &'static str,
            bytes: u64,
            seconds: f64,
        ) {
            assert!(seconds >= 0.0);
            self.0.lock().push((backend, op, outcome, bytes));
        }
    }
    let log = Arc::new(Log::default());
    let faulty = Arc::new(Faulty::new(Arc::new(MemoryStore::new())));
    let m = Metered::new(faulty.clone(), log.clone());
    conformance::round_trip(&m).await;
    m.set(
        "ab/01",
        Bytes::from_static(b"hd"),
        Bytes::from_static(b"body"),
    )
    .await
    .unwrap();
    assert!(m.get("ab/01").await.unwrap().is_some());
    assert!(m.get("ab/02").await.unwrap().is_none());
    faulty.set_fault(Some(Fault::Error));
    assert!(m.exists("ab/01").await.is_err());
    let log = log.0.lock();
    let tail: Vec<_> = log.iter().rev().take(4).rev().cloned().collect();
    assert_eq!(
        tail,
        vec![
            ("memory", "set", "ok", 6),
            ("memory", "get", "hit", 6),
            ("memory", "get", "miss", 0),
            ("memory", "exists", "io", 0),
        ]
    );
    assert!(log.iter().any(|r| r.1 == "delete"));
}

#[tokio::test]
async fn delayed_reads_wait_and_deadlines_cut_them_short() {
    let delay = Duration::from_millis(150);
    let slow = Arc::new(Delayed::new(Arc::new(MemoryStore::new()), delay));
    conformance::run_all(slow.clone()).await;
    let ps = PageStore::new(slow);
    let (fp, key) = (LayoutFingerprint([3; 16]), PageKey([4; 32]));
    let ctx = |t| OpCtx::timeout(Duration::from_millis(t));
    ps.set(&ctx(5000), &fp, &key, Bytes::from_static(b"page"))
        .await
        .unwrap();
    let t = Instant::now();
    let hit = ps.get(&ctx(5000), &fp, &key, None).await.hit().unwrap();
    assert_eq!(&hit[..], b"page");
    assert!(t.elapsed() >= delay, "the read did not wait");
    // Writes and existence checks are not slowed.
    let t = Instant::now();
    assert!(ps.exists(&ctx(5000), &fp, &key).await.unwrap());
    ps.set(&ctx(5000), &fp, &key, Bytes::from_static(b"page"))
        .await
        .unwrap();
    assert!(t.elapsed() < delay);
    // Unless asked to: then every write waits too.
    let slow_writes = PageStore::new(Arc::new(Delayed::with_writes(
        Arc::new(MemoryStore::new()),
        Duration::ZERO,
        delay,
    )));
    let t = Instant::now();
    slow_writes
        .set(&ctx(5000), &fp, &key, Bytes::from_static(b"page"))
        .await
        .unwrap();
    assert!(t.elapsed() >= delay, "the write did not wait");
    // A deadline shorter than the delay turns the read into a timely miss.
    let t = Instant::now();
    let miss = ps.get(&ctx(20), &fp, &key, None).await;
    assert!(matches!(miss, Fetch::Miss(MissReason::Timeout)), "{miss:?}");
    assert!(t.elapsed() < delay);
}

#[tokio::test]
async fn flaky_fails_at_its_rate_and_never_serves_wrong_bytes() {
    conformance::run_all(Arc::new(Flaky::new(Arc::new(MemoryStore::new()), 0.0, 1))).await;
    let inner: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let ps_ok = PageStore::new(inner.clone());
    let fp = LayoutFingerprint([5; 16]);
    let keys: Vec<PageKey> = (0..200u8).map(|i| PageKey([i; 32])).collect();
    let ctx = || OpCtx::timeout(Duration::from_secs(5));
    for k in &keys {
        ps_ok
            .set(&ctx(), &fp, k, Bytes::from(vec![k.0[0]; 64]))
            .await
            .unwrap();
    }
    let flaky = PageStore::new(Arc::new(Flaky::new(inner, 0.3, 7)));
    let (mut hits, mut misses) = (0, 0);
    for k in &keys {
        match flaky.get(&ctx(), &fp, k, Some(64)).await {
            Fetch::Hit(b) => {
                assert!(b.iter().all(|&x| x == k.0[0]), "wrong bytes served");
                hits += 1;
            }
            Fetch::Miss(MissReason::Failed(_)) => misses += 1,
            Fetch::Miss(other) => panic!("unexpected miss: {other:?}"),
        }
    }
    assert!(
        (30..=90).contains(&misses),
        "{misses} failures of 200 at rate 0.3"
    );
    assert_eq!(hits + misses, 200);
    let always = PageStore::new(Arc::new(Flaky::new(Arc::new(MemoryStore::new()), 1.0, 7)));
    assert!(always.exists(&ctx(), &fp, &keys[0]).await.is_err());
}

#[tokio::test]
async fn a_faulted_store_fails_every_method_batched_ones_included() {
    let faulty = Faulty::new(Arc::new(MemoryStore::new()));
    faulty
        .set("a", Bytes::from_static(b"h"), Bytes::from_static(b"b"))
        .await
        .unwrap();
    let names = vec!["a".to_string()];
    assert_eq!(faulty.exists_prefix(&names).await.unwrap(), 1);
    faulty.set_fault(Some(Fault::Error));
    let before = faulty.calls();
    assert!(faulty.exists_prefix(&names).await.is_err());
    assert!(faulty.exists("a").await.is_err());
    assert!(faulty.get("a").await.is_err());
    assert!(faulty.clear().await.is_err());
    // One gated call each: the batched lookup is not split into per-name calls behind it.
    assert_eq!(faulty.calls() - before, 4);
    faulty.set_fault(None);
    assert!(
        faulty.exists("a").await.unwrap(),
        "a failed clear removed nothing"
    );
}
