//! The s3 backend against raw object_store put/get of the same 2 MiB objects on the same
//! server, in the same run. The server is a real Ceph RGW started by `scripts/ceph-s3` (Debian's
//! Ceph packages; `scripts/setup` installs them) and stopped at the end.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::compare;
use bytes::Bytes;
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::s3::S3Store;
use kvtier_storage::{OpCtx, PageStore};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

/// Reads every object at `paths` with the raw client.
async fn raw_get_all(raw: &impl ObjectStoreExt, paths: &[Path]) {
    for p in paths {
        raw.get(p).await.unwrap().bytes().await.unwrap();
    }
}

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let pages = if quick { 8 } else { 16 };
    let page_bytes = 2 << 20;
    let c = crate::shared_ceph();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(c.bucket_ready("bench"));
    let cfg = c.config("bench", "kvtier");
    let s3 = std::sync::Arc::new(S3Store::new(&cfg, crate::ceph::TIMEOUT).unwrap());
    let ps = PageStore::new(s3.clone());
    let raw = AmazonS3Builder::new()
        .with_endpoint(c.endpoint())
        .with_region(c.region())
        .with_bucket_name("bench")
        .with_access_key_id(c.access_key())
        .with_secret_access_key(c.secret_key())
        .with_allow_http(true)
        .build()
        .unwrap();
    let fp = LayoutFingerprint([1; 16]);
    let keys: Vec<PageKey> = (0..pages as u8).map(|i| PageKey([i; 32])).collect();
    let data: Vec<Bytes> = (0..pages)
        .map(|i| {
            Bytes::from(
                (0..page_bytes)
                    .map(|j| (i * 13 + j) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let raw_paths: Vec<Path> = (0..pages).map(|i| Path::from(format!("raw/{i}"))).collect();
    let ctx = || OpCtx::timeout(Duration::from_secs(60));
    let total = (pages * page_bytes) as u64;
    let rounds = if quick { 3 } else { 5 };
    crate::say!(
        "L3 s3 on Ceph RGW, {pages} objects of 2 MiB, ratio = kvtier / raw object_store speed"
    );
    let set = compare(
        "set 2 MiB pages vs object_store put",
        total,
        rounds,
        || {
            rt.block_on(async {
                for (p, d) in raw_paths.iter().zip(&data) {
                    raw.put(p, PutPayload::from(d.clone())).await.unwrap();
                }
            })
        },
        || {
            rt.block_on(async {
                for (k, d) in keys.iter().zip(&data) {
                    ps.set(&ctx(), &fp, k, d.clone()).await.unwrap();
                }
            })
        },
    );
    crate::say!("{}", set.line("MiB/s", f64::from(1 << 20)));
    let get = compare(
        "get 2 MiB pages vs object_store get",
        total,
        rounds,
        || rt.block_on(raw_get_all(&raw, &raw_paths)),
        || {
            rt.block_on(async {
                for k in &keys {
                    ps.get(&ctx(), &fp, k, Some(page_bytes))
                        .await
                        .hit()
                        .unwrap();
                }
            })
        },
    );
    crate::say!("{}", get.line("MiB/s", f64::from(1 << 20)));
    // Diagnostics for the get path: the same objects through the bare backend (no framing, no
    // checksum), the raw client on kvtier's objects, and on raw objects of kvtier's size. They
    // found the old gap (0.35-0.6): RGW's beast frontend without `tcp_nodelay=1` held the last
    // segment of every object whose size is not a whole number of segments (Nagle), 3-7 ms a
    // get; `--sizes` shows it per size. `scripts/ceph-s3` now sets it.
    let bare = compare(
        "get: S3Store alone vs object_store get",
        total,
        rounds,
        || rt.block_on(raw_get_all(&raw, &raw_paths)),
        || {
            rt.block_on(async {
                use kvtier_storage::Store as _;
                for k in &keys {
                    let name = kvtier_storage::format::object_name(&fp, k);
                    s3.get(&name).await.unwrap().unwrap();
                }
            })
        },
    );
    crate::say!("{}", bare.line("MiB/s", f64::from(1 << 20)));
    let same = compare(
        "get: raw client on kvtier's objects vs raw",
        total,
        rounds,
        || rt.block_on(raw_get_all(&raw, &raw_paths)),
        || {
            rt.block_on(async {
                for k in &keys {
                    let p = Path::from(format!(
                        "kvtier/{}",
                        kvtier_storage::format::object_name(&fp, k)
                    ));
                    raw.get(&p).await.unwrap().bytes().await.unwrap();
                }
            })
        },
    );
    crate::say!("{}", same.line("MiB/s", f64::from(1 << 20)));
    // Same shape as kvtier's objects (2 MiB + the 72-byte header), written by the raw client.
    let odd: Vec<Bytes> = data
        .iter()
        .map(|d| {
            let mut v = d.to_vec();
            v.extend_from_slice(&[0u8; 72]);
            Bytes::from(v)
        })
        .collect();
    let odd_paths: Vec<Path> = (0..pages).map(|i| Path::from(format!("odd/{i}"))).collect();
    rt.block_on(async {
        for (p, d) in odd_paths.iter().zip(&odd) {
            raw.put(p, PutPayload::from(d.clone())).await.unwrap();
        }
    });
    let shape = compare(
        "get: raw, 2 MiB + 72 B objects vs 2 MiB",
        total,
        rounds,
        || rt.block_on(raw_get_all(&raw, &raw_paths)),
        || rt.block_on(raw_get_all(&raw, &odd_paths)),
    );
    crate::say!("{}", shape.line("MiB/s", f64::from(1 << 20)));
    // `--sizes`: latency of one raw get by object size and name, to tell the server's cost of
    // an object's shape from kvtier's.
    if std::env::args().any(|a| a == "--sizes") {
        let name = kvtier_storage::format::object_name(&fp, &keys[0]);
        for size in [
            (2 << 20) - 4096,
            (2 << 20) - 72,
            2 << 20,
            (2 << 20) + 72,
            (2 << 20) + 4096,
            4 << 20,
        ] {
            for path in [
                Path::from("sizes/a"),
                Path::from(format!("kvtier/sizes/{name}")),
            ] {
                let body = Bytes::from(vec![5u8; size]);
                rt.block_on(async {
                    raw.put(&path, PutPayload::from(body)).await.unwrap();
                    raw.get(&path).await.unwrap().bytes().await.unwrap();
                    let n = 20;
                    let t = std::time::Instant::now();
                    for _ in 0..n {
                        raw.get(&path).await.unwrap().bytes().await.unwrap();
                    }
                    crate::say!("raw get {size} B at {path}: {:?} each", t.elapsed() / n);
                });
            }
        }
    }
}
