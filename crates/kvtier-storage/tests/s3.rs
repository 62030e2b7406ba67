//! The s3 backend against a real S3-compatible server: a single-node Ceph cluster with its
//! RGW gateway, started by `scripts/ceph-s3` in a temp directory for this test and stopped
//! after it. The conformance suite runs on it, then an outage: the gateway is stopped
//! mid-run, the breaker opens and calls keep answering (misses) within their deadlines, and
//! when the gateway returns the breaker closes and writes resume.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::s3::S3Store;
use kvtier_storage::wrappers::{Breaker, BreakerConfig, BreakerState};
use kvtier_storage::{Fetch, OpCtx, PageStore, Store, conformance};

#[path = "ceph/mod.rs"]
mod ceph;
use ceph::Ceph;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_on_ceph_rgw_conforms_and_survives_an_outage() {
    let ceph = Ceph::start();
    ceph.bucket_ready("kvtier-test").await;

    // The conformance suite, under a key prefix.
    let store =
        Arc::new(S3Store::new(&ceph.config("kvtier-test", "conformance"), ceph::TIMEOUT).unwrap());
    conformance::run_all(store.clone()).await;
    // A clear removes its own prefix and nothing beside it.
    let other =
        Arc::new(S3Store::new(&ceph.config("kvtier-test", "other"), ceph::TIMEOUT).unwrap());
    other
        .set("ab/cd", Bytes::new(), Bytes::from_static(b"kept"))
        .await
        .unwrap();
    store
        .set("ab/cd", Bytes::new(), Bytes::from_static(b"gone"))
        .await
        .unwrap();
    assert_eq!(store.clear().await.unwrap(), 1);
    assert!(
        other.exists("ab/cd").await.unwrap(),
        "a clear crossed its prefix"
    );
    other.delete("ab/cd").await.unwrap();

    // An outage.
    // Outage settings: a short request timeout, so the breaker sees failures quickly (the
    // client itself never retries).
    let outage = ceph.config("kvtier-test", "outage");
    let s3 = Arc::new(S3Store::new(&outage, Duration::from_secs(2)).unwrap());
    let breaker = Arc::new(Breaker::new(
        s3,
        BreakerConfig {
            failure_rate: 0.5,
            min_calls: 2,
            window: Duration::from_secs(30),
            cooldown: Duration::from_millis(300),
            timeout: Duration::from_secs(3),
        },
    ));
    let ps = PageStore::new(breaker.clone());
    let (fp, key) = (LayoutFingerprint([9; 16]), PageKey([8; 32]));
    let page = Bytes::from(vec![7u8; 256 * 1024]);
    let ctx = || OpCtx::timeout(Duration::from_secs(5));
    ps.set(&ctx(), &fp, &key, page.clone()).await.unwrap();
    assert_eq!(
        ps.get(&ctx(), &fp, &key, None).await.hit(),
        Some(page.clone())
    );

    ceph.script("stop-rgw");
    for _ in 0..2 {
        let t = Instant::now();
        assert!(matches!(
            ps.get(&ctx(), &fp, &key, None).await,
            Fetch::Miss(_)
        ));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "a miss took {:?}",
            t.elapsed()
        );
    }
    assert_eq!(breaker.state(), BreakerState::Open);
    let t = Instant::now();
    for _ in 0..50 {
        assert!(matches!(
            ps.get(&ctx(), &fp, &key, None).await,
            Fetch::Miss(_)
        ));
        assert!(ps.set(&ctx(), &fp, &key, page.clone()).await.is_err());
    }
    assert!(
        t.elapsed() < Duration::from_secs(2),
        "open-breaker calls took {:?}",
        t.elapsed()
    );

    ceph.script("start-rgw");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        tokio::time::sleep(Duration::from_millis(350)).await;
        if let Fetch::Hit(b) = ps.get(&ctx(), &fp, &key, None).await {
            assert_eq!(b, page);
            break;
        }
        assert!(Instant::now() < deadline, "the breaker never closed again");
    }
    assert_eq!(breaker.state(), BreakerState::Closed);
    let key2 = PageKey([7; 32]);
    ps.set(&ctx(), &fp, &key2, page.clone()).await.unwrap();
    assert_eq!(ps.get(&ctx(), &fp, &key2, None).await.hit(), Some(page));
}
