//! Per-tenant byte quotas of the file and RocksDB backends: under concurrent writes of three
//! tenants, one past its quota evicts only its own least recently used objects, the others
//! keep every byte, and the usage is rebuilt from disk on reopen.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvtier_config::l3::{FileSection, RocksdbSection};
use kvtier_core::{LayoutFingerprint, PageKey, TenantScope, TenantTag};
use kvtier_storage::file::FileStore;
use kvtier_storage::rocks::RocksStore;
use kvtier_storage::{OpCtx, PageStore, StorageError, Store, TenantBytes};

const PAGE: usize = 4096;
const OBJ: u64 = PAGE as u64 + 72;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-quota-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn ctx() -> OpCtx {
    OpCtx::timeout(Duration::from_secs(30))
}

fn keys(tenant: &str, n: u8) -> Vec<PageKey> {
    let s = TenantScope::new(tenant);
    (0..n).map(|i| s.apply(&PageKey([i; 32]))).collect()
}

fn page(k: &PageKey) -> Bytes {
    Bytes::from(vec![k.0[31]; PAGE])
}

fn usage(s: &dyn Store, tag: TenantTag) -> TenantBytes {
    s.stats()
        .tenants
        .into_iter()
        .find(|t| t.tag == tag)
        .unwrap()
}

/// Writes 24 pages of acme (quota 8 pages), 16 of globex (counted, no quota) and 16 of a
/// tenant nobody tracks, all at once; checks what stayed; reopens and checks again.
async fn quotas_hold<S, F>(dir: &Path, open: impl Fn(Vec<(TenantTag, u64)>) -> F)
where
    S: Store,
    F: Future<Output = Arc<S>>,
{
    let fp = LayoutFingerprint([3; 16]);
    let (acme, globex) = (
        TenantScope::new("acme").tag(),
        TenantScope::new("globex").tag(),
    );
    let quotas = vec![(acme, 8 * OBJ), (globex, 0)];
    let (a, g, o) = (keys("acme", 24), keys("globex", 16), keys("other", 16));
    {
        let s = open(quotas.clone()).await;
        let ps = PageStore::new(s.clone());
        let c = ctx();
        // Acme's first 8 land before the rest, so they are its least recently used.
        let first = a[..8].iter().map(|k| ps.set(&c, &fp, k, page(k)));
        for r in futures::future::join_all(first).await {
            r.unwrap();
        }
        let rest = a[8..].iter().chain(&g).chain(&o);
        let writes = rest.map(|k| ps.set(&c, &fp, k, page(k)));
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
        let u = usage(&*s, acme);
        assert_eq!((u.objects, u.bytes, u.quota), (8, 8 * OBJ, 8 * OBJ));
        assert_eq!(u.evictions, 16);
        let ug = usage(&*s, globex);
        assert_eq!((ug.objects, ug.bytes, ug.evictions), (16, 16 * OBJ, 0));
        assert_eq!(s.stats().objects, 8 + 16 + 16);
        for k in g.iter().chain(&o) {
            let hit = ps.get(&ctx(), &fp, k, Some(PAGE)).await.hit();
            assert_eq!(
                hit,
                Some(page(k)),
                "another tenant lost a page to acme's quota"
            );
        }
        for k in &a[..8] {
            assert!(ps.get(&ctx(), &fp, k, None).await.hit().is_none());
        }
        // A page larger than the whole quota is refused, not stored.
        let big = Bytes::from(vec![1u8; 9 * PAGE]);
        let e = ps.set(&ctx(), &fp, &a[0], big).await.unwrap_err();
        assert!(
            matches!(e, StorageError::NoSpace(ref m) if m.contains("quota")),
            "{e}"
        );
    }
    // Reopened: usage is counted again from what is on disk.
    let s = open(quotas).await;
    for _ in 0..500 {
        if s.stats().objects == 40 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let u = usage(&*s, acme);
    assert_eq!((u.objects, u.bytes), (8, 8 * OBJ));
    assert_eq!(usage(&*s, globex).objects, 16);
    let ps = PageStore::new(s.clone());
    let more = keys("acme", 30);
    for k in &more[24..] {
        ps.set(&ctx(), &fp, k, page(k)).await.unwrap();
    }
    assert_eq!(usage(&*s, acme).objects, 8);
    assert_eq!(usage(&*s, globex).objects, 16);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_tenant_quotas_evict_only_the_tenants_own_objects() {
    let dir = tmpdir("file");
    quotas_hold(&dir, |q| {
        let dir = dir.clone();
        async move {
            FileStore::open(dir, &FileSection::unbounded(), &q)
                .await
                .unwrap()
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rocksdb_tenant_quotas_evict_only_the_tenants_own_objects() {
    let dir = tmpdir("rocks");
    quotas_hold(&dir, |q| {
        let dir = dir.clone();
        async move {
            RocksStore::open(dir, &RocksdbSection::default(), &q)
                .await
                .unwrap()
        }
    })
    .await;
}
