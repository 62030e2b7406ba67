//! The conformance suite every backend must pass, exported so each backend's tests (and other
//! crates' backends) run the same checks. Each function panics with a message naming the
//! broken rule of the [`Store`] contract.
//!
//! Call [`run_all`] with a fresh, empty store. The page-level checks use [`PageStore`], so the
//! framing guarantees (corrupt objects are misses and get deleted) are checked over every
//! backend too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvtier_core::{LayoutFingerprint, PageKey};

use crate::format::object_name;
use crate::{Fetch, Landed, MissReason, ObjectSink, OpCtx, PageStore, Store};

fn name(i: u32) -> String {
    format!("c0ffee/{i:064x}")
}

fn bytes(seed: u32, len: usize) -> Bytes {
    let mut x = u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    Bytes::from(
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect::<Vec<u8>>(),
    )
}

fn concat(a: &Bytes, b: &Bytes) -> Bytes {
    let mut v = a.to_vec();
    v.extend_from_slice(b);
    Bytes::from(v)
}

/// Set, get, exists and delete of objects from empty to 2 MiB.
pub async fn round_trip(store: &dyn Store) {
    for (i, len) in [0usize, 1, 4095, 4096, 65_537, 2 << 20]
        .into_iter()
        .enumerate()
    {
        let n = name(i as u32);
        assert!(!store.exists(&n).await.unwrap(), "exists before set");
        assert!(
            store.get(&n).await.unwrap().is_none(),
            "get before set is not a miss"
        );
        let head = bytes(i as u32, 72.min(len));
        let body = bytes(i as u32 + 100, len - head.len());
        store.set(&n, head.clone(), body.clone()).await.unwrap();
        assert!(store.exists(&n).await.unwrap(), "exists after set");
        let got = store.get(&n).await.unwrap().expect("get after set");
        assert_eq!(
            got,
            concat(&head, &body),
            "bytes differ for a {len}-byte object"
        );
        store.delete(&n).await.unwrap();
        assert!(!store.exists(&n).await.unwrap(), "exists after delete");
        assert!(store.get(&n).await.unwrap().is_none(), "get after delete");
    }
}

/// Setting again replaces; setting the same bytes and deleting twice are idempotent.
pub async fn idempotence(store: &dyn Store) {
    let n = name(1000);
    let (a, b) = (bytes(1, 300), bytes(2, 500));
    store.set(&n, Bytes::new(), a.clone()).await.unwrap();
    store.set(&n, Bytes::new(), a.clone()).await.unwrap();
    assert_eq!(store.get(&n).await.unwrap().unwrap(), a);
    store.set(&n, Bytes::new(), b.clone()).await.unwrap();
    assert_eq!(
        store.get(&n).await.unwrap().unwrap(),
        b,
        "a set does not replace"
    );
    store.delete(&n).await.unwrap();
    store.delete(&n).await.unwrap();
    store.delete(&name(1001)).await.unwrap();
}

/// `exists_prefix` counts leading present names.
pub async fn prefix(store: &dyn Store) {
    let names: Vec<String> = (2000..2006).map(name).collect();
    for n in &names[..3] {
        store.set(n, Bytes::new(), bytes(7, 64)).await.unwrap();
    }
    store
        .set(&names[4], Bytes::new(), bytes(7, 64))
        .await
        .unwrap();
    assert_eq!(store.exists_prefix(&names).await.unwrap(), 3);
    assert_eq!(store.exists_prefix(&names[3..]).await.unwrap(), 0);
    assert_eq!(store.exists_prefix(&[]).await.unwrap(), 0);
    for n in &names {
        store.delete(n).await.unwrap();
    }
}

/// Concurrent sets of one name never produce a mixed object: readers see one version whole.
pub async fn concurrent_sets_are_atomic(store: Arc<dyn Store>) {
    let n = name(3000);
    let versions: Vec<Bytes> = (0..4).map(|v| bytes(v, 256 * 1024)).collect();
    let mut tasks = Vec::new();
    for round in 0..8 {
        for v in &versions {
            let (s, n, v) = (store.clone(), n.clone(), v.clone());
            tasks.push(tokio::spawn(
                async move { s.set(&n, Bytes::new(), v).await },
            ));
        }
        let (s, n) = (store.clone(), n.clone());
        let vs = versions.clone();
        tasks.push(tokio::spawn(async move {
            if let Some(got) = s.get(&n).await? {
                assert!(
                    vs.contains(&got),
                    "round {round}: a torn or mixed object was read"
                );
            }
            Ok(())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let last = store.get(&n).await.unwrap().unwrap();
    assert!(
        versions.contains(&last),
        "final object is not one of the versions"
    );
    store.delete(&n).await.unwrap();
}

/// Names outside the contract are refused, not stored somewhere unexpected.
pub async fn bad_names(store: &dyn Store) {
    for bad in ["", "/abs", "../escape", "a//b", "UPPER", "x y"] {
        assert!(
            store.set(bad, Bytes::new(), bytes(1, 8)).await.is_err(),
            "name {bad:?} was accepted"
        );
        assert!(store.get(bad).await.is_err(), "name {bad:?} was read");
    }
}

/// Pages: verified hits; corrupt, truncated and foreign objects are misses and get deleted.
pub async fn pages(store: Arc<dyn Store>) {
    let ps = PageStore::new(store.clone());
    let ctx = OpCtx::timeout(Duration::from_secs(30));
    let fp = LayoutFingerprint([0x11; 16]);
    let other_fp = LayoutFingerprint([0x22; 16]);
    let key = PageKey([0x33; 32]);
    let payload = bytes(42, 128 * 1024);
    ps.set(&ctx, &fp, &key, payload.clone()).await.unwrap();
    match ps.get(&ctx, &fp, &key, Some(payload.len())).await {
        Fetch::Hit(b) => assert_eq!(b, payload, "page bytes differ"),
        Fetch::Miss(r) => panic!("stored page missed: {r:?}"),
    }
    assert_eq!(
        ps.exists_prefix(&ctx, &fp, &[key, PageKey([0x34; 32])])
            .await
            .unwrap(),
        1
    );
    // Another layout never sees it.
    assert!(matches!(
        ps.get(&ctx, &other_fp, &key, None).await,
        Fetch::Miss(MissReason::Absent)
    ));
    // Corrupt the stored object: flip one payload byte through the raw store.
    let n = object_name(&fp, &key);
    let mut raw = store.get(&n).await.unwrap().unwrap().to_vec();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    store
        .set(&n, Bytes::new(), Bytes::from(raw.clone()))
        .await
        .unwrap();
    // Asked with its length, as kvtierd asks (a file is then read whole into a buffer that
    // is not zeroed first), and without.
    assert!(
        matches!(
            ps.get(&ctx, &fp, &key, Some(payload.len())).await,
            Fetch::Miss(MissReason::Corrupt(_))
        ),
        "a corrupted page was served"
    );
    assert!(
        !store.exists(&n).await.unwrap(),
        "the corrupt object was not deleted"
    );
    // A truncated object (a torn write) is a miss too.
    raw[last] ^= 1;
    for expected in [None, Some(payload.len())] {
        store
            .set(&n, Bytes::new(), Bytes::from(raw[..raw.len() / 2].to_vec()))
            .await
            .unwrap();
        assert!(matches!(
            ps.get(&ctx, &fp, &key, expected).await,
            Fetch::Miss(MissReason::Corrupt(_))
        ));
    }
    // An object stored under one key but holding another key's page is refused.
    let key2 = PageKey([0x44; 32]);
    ps.set(&ctx, &fp, &key2, payload.clone()).await.unwrap();
    let other = store.get(&object_name(&fp, &key2)).await.unwrap().unwrap();
    store.set(&n, Bytes::new(), other).await.unwrap();
    assert!(matches!(
        ps.get(&ctx, &fp, &key, None).await,
        Fetch::Miss(MissReason::Corrupt(_))
    ));
    assert!(ps.stats().corrupt >= 3);
    ps.delete(&ctx, &fp, &key2).await.unwrap();
}

/// A sink collecting what it is given, refusing writes past `limit` bytes.
struct VecSink {
    buf: parking_lot::Mutex<Vec<u8>>,
    limit: usize,
}

impl VecSink {
    fn new(limit: usize) -> Arc<Self> {
        Arc::new(Self {
            buf: parking_lot::Mutex::new(Vec::new()),
            limit,
        })
    }
    fn bytes(&self) -> Vec<u8> {
        self.buf.lock().clone()
    }
}

impl ObjectSink for VecSink {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let end = offset as usize + bytes.len();
        if end > self.limit {
            return Err(format!("{end} bytes do not fit in {}", self.limit));
        }
        let mut b = self.buf.lock();
        if b.len() < end {
            b.resize(end, 0);
        }
        b[offset as usize..end].copy_from_slice(bytes);
        Ok(())
    }
}

/// `read_into` and `PageStore::get_into`: the same bytes as `get`, split where asked; the
/// same verification (corrupt, torn and misplaced pages are misses and get deleted); a sink
/// that refuses stops the read with an error, not a hit.
pub async fn pages_into(store: Arc<dyn Store>) {
    let ps = PageStore::new(store.clone());
    let ctx = OpCtx::timeout(Duration::from_secs(30));
    let fp = LayoutFingerprint([0x55; 16]);
    let key = PageKey([0x66; 32]);
    // Larger than one streaming chunk, and not a multiple of it.
    let payload = bytes(7, 600 * 1024 + 13);
    ps.set(&ctx, &fp, &key, payload.clone()).await.unwrap();
    let sink = VecSink::new(usize::MAX);
    match ps
        .get_into(&ctx, &fp, &key, Some(payload.len()), sink.clone())
        .await
    {
        Landed::Hit(v) => {
            assert_eq!(v.len, payload.len() as u64);
            assert_eq!(v.crc32c, kvtier_core::checksum::crc32c(&payload));
        }
        Landed::Miss(r) => panic!("stored page missed through get_into: {r:?}"),
    }
    assert!(sink.bytes() == payload.to_vec(), "get_into bytes differ");
    // Raw split: the head comes back, the rest goes to the sink.
    let n = object_name(&fp, &key);
    let whole = store.get(&n).await.unwrap().unwrap();
    let sink = VecSink::new(usize::MAX);
    let (head, rest) = store
        .read_into(&n, 10, sink.clone())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((&head[..], rest), (&whole[..10], (whole.len() - 10) as u64));
    assert!(
        sink.bytes() == whole[10..].to_vec(),
        "read_into rest differs"
    );
    // A split past the end: everything in the head.
    let sink = VecSink::new(usize::MAX);
    let (head, rest) = store
        .read_into(&n, whole.len() + 5, sink.clone())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((head.len(), rest), (whole.len(), 0));
    // Absent.
    let sink = VecSink::new(usize::MAX);
    assert!(
        store
            .read_into(&name(999_999), 10, sink.clone())
            .await
            .unwrap()
            .is_none()
    );
    assert!(matches!(
        ps.get_into(&ctx, &fp, &PageKey([0x67; 32]), None, sink)
            .await,
        Landed::Miss(MissReason::Absent)
    ));
    // A sink that refuses: an error, never a hit.
    let small = VecSink::new(1000);
    assert!(matches!(
        ps.get_into(&ctx, &fp, &key, None, small).await,
        Landed::Miss(MissReason::Failed(_))
    ));
    // Corrupt payload: a miss, and the object is deleted.
    let mut raw = whole.to_vec();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    store
        .set(&n, Bytes::new(), Bytes::from(raw.clone()))
        .await
        .unwrap();
    assert!(
        matches!(
            ps.get_into(&ctx, &fp, &key, None, VecSink::new(usize::MAX))
                .await,
            Landed::Miss(MissReason::Corrupt(_))
        ),
        "a corrupted page landed"
    );
    assert!(
        !store.exists(&n).await.unwrap(),
        "the corrupt object was not deleted"
    );
    // Torn (truncated) and misplaced (another key's page) objects are misses too.
    raw[last] ^= 1;
    store
        .set(&n, Bytes::new(), Bytes::from(raw[..raw.len() / 3].to_vec()))
        .await
        .unwrap();
    assert!(matches!(
        ps.get_into(&ctx, &fp, &key, None, VecSink::new(usize::MAX))
            .await,
        Landed::Miss(MissReason::Corrupt(_))
    ));
    let key2 = PageKey([0x77; 32]);
    ps.set(&ctx, &fp, &key2, payload.clone()).await.unwrap();
    let other = store.get(&object_name(&fp, &key2)).await.unwrap().unwrap();
    store.set(&n, Bytes::new(), other).await.unwrap();
    assert!(matches!(
        ps.get_into(&ctx, &fp, &key, None, VecSink::new(usize::MAX))
            .await,
        Landed::Miss(MissReason::Corrupt(_))
    ));
    // A wrong expected length (another layout's page size) is refused.
    assert!(matches!(
        ps.get_into(&ctx, &fp, &key2, Some(4096), VecSink::new(usize::MAX))
            .await,
        Landed::Miss(MissReason::Corrupt(_))
    ));
    ps.delete(&ctx, &fp, &key2).await.unwrap();
}

/// `clear` removes every object and the store works after it; a store that cannot clear
/// (remote) refuses with `Invalid` and keeps everything.
pub async fn clear(store: &dyn Store) {
    let names: Vec<String> = (900..905).map(name).chain(["ab/cd".to_string()]).collect();
    for (i, n) in names.iter().enumerate() {
        store
            .set(n, Bytes::new(), bytes(i as u32, 300))
            .await
            .unwrap();
    }
    match store.clear().await {
        Ok(n) => {
            assert!(
                n >= names.len() as u64,
                "clear reported {n} objects removed"
            );
            for n in &names {
                assert!(!store.exists(n).await.unwrap(), "{n} survived a clear");
                assert!(
                    store.get(n).await.unwrap().is_none(),
                    "{n} readable after a clear"
                );
            }
            let st = store.stats();
            assert_eq!((st.objects, st.bytes), (0, 0), "stats after a clear");
            store
                .set(&names[0], Bytes::new(), bytes(1, 10))
                .await
                .unwrap();
            assert!(store.exists(&names[0]).await.unwrap(), "set after a clear");
            assert_eq!(store.clear().await.unwrap(), 1, "second clear");
        }
        Err(crate::StorageError::Invalid(why)) => {
            assert!(!why.is_empty());
            for n in &names {
                assert!(
                    store.exists(n).await.unwrap(),
                    "a refused clear removed {n}"
                );
                store.delete(n).await.unwrap();
            }
        }
        Err(e) => panic!("clear failed: {e}"),
    }
}

/// Every check, in order, on a fresh empty store.
pub async fn run_all(store: Arc<dyn Store>) {
    round_trip(store.as_ref()).await;
    idempotence(store.as_ref()).await;
    prefix(store.as_ref()).await;
    bad_names(store.as_ref()).await;
    concurrent_sets_are_atomic(store.clone()).await;
    pages(store.clone()).await;
    pages_into(store.clone()).await;
    clear(store.as_ref()).await;
}
