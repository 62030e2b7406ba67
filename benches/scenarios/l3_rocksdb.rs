//! The rocksdb backend against the file backend, same pages, same run: a report (how the
//! two local backends compare here), not a target.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use kvtier_config::l3::{FileSection, RocksdbSection};
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::file::FileStore;
use kvtier_storage::rocks::RocksStore;
use kvtier_storage::{OpCtx, PageStore};

use crate::compare;

/// Runs the scenario.
pub fn run(quick: bool) {
    let pages = if quick { 16 } else { 64 };
    let page_bytes = 2 << 20;
    let dir = std::env::temp_dir().join(format!("kvtier-bench-rocks-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (file, rocks) = rt.block_on(async {
        let f = FileStore::open(dir.join("file"), &FileSection::unbounded(), &[])
            .await
            .unwrap();
        let r = RocksStore::open(dir.join("rocks"), &RocksdbSection::default(), &[])
            .await
            .unwrap();
        (PageStore::new(f), PageStore::new(r))
    });
    let fp = LayoutFingerprint([9; 16]);
    let keys: Vec<PageKey> = (0..pages as u8).map(|i| PageKey([i; 32])).collect();
    let data: Vec<Bytes> = (0..pages)
        .map(|i| {
            Bytes::from(
                (0..page_bytes)
                    .map(|j| (i * 17 + j) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let ctx = || OpCtx::timeout(Duration::from_secs(60));
    let total = (pages * page_bytes) as u64;
    let rounds = if quick { 3 } else { 7 };
    crate::say!("L3 rocksdb vs file backend, {pages} pages of 2 MiB, ratio = rocksdb / file speed");
    let set_all = |ps: &PageStore| {
        rt.block_on(async {
            for (k, d) in keys.iter().zip(&data) {
                ps.set(&ctx(), &fp, k, d.clone()).await.unwrap();
            }
        })
    };
    let get_all = |ps: &PageStore| {
        rt.block_on(async {
            for k in &keys {
                ps.get(&ctx(), &fp, k, Some(page_bytes))
                    .await
                    .hit()
                    .unwrap();
            }
        })
    };
    let set = compare(
        "rocksdb set vs file set",
        total,
        rounds,
        || set_all(&file),
        || set_all(&rocks),
    );
    crate::say!("{}", set.line("GiB/s", f64::from(1 << 30)));
    let get = compare(
        "rocksdb get vs file get",
        total,
        rounds,
        || get_all(&file),
        || get_all(&rocks),
    );
    crate::say!("{}", get.line("GiB/s", f64::from(1 << 30)));
    drop((file, rocks));
    drop(rt);
    let _ = std::fs::remove_dir_all(&dir);
}
