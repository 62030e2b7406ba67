//! The file backend against raw file I/O of the same bytes, in the same directory, with the
//! same sync semantics (none), in the same run: set/get of 2 MiB pages through PageStore
//! (framing, CRC32C, temp file + rename, index) vs `std::fs::write` / `std::fs::read`.
#![allow(clippy::unwrap_used)]

use std::time::Duration;

use crate::compare;
use bytes::Bytes;
use kvtier_config::l3::FileSection;
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::file::FileStore;
use kvtier_storage::{OpCtx, PageStore};

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let pages = if quick { 16 } else { 64 };
    let page_bytes = 2 << 20;
    let dir = std::env::temp_dir().join(format!("kvtier-bench-l3file-{}", std::process::id()));
    let raw_dir = dir.join("raw");
    std::fs::create_dir_all(&raw_dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let store = rt
        .block_on(FileStore::open(
            dir.join("kvtier"),
            &FileSection::unbounded(),
            &[],
        ))
        .unwrap();
    let ps = PageStore::new(store);
    let fp = LayoutFingerprint([3; 16]);
    let keys: Vec<PageKey> = (0..pages as u8).map(|i| PageKey([i; 32])).collect();
    let data: Vec<Bytes> = (0..pages)
        .map(|i| {
            Bytes::from(
                (0..page_bytes)
                    .map(|j| (i * 31 + j) as u8)
                    .collect::<Vec<u8>>(),
            )
        })
        .collect();
    let ctx = || OpCtx::timeout(Duration::from_secs(60));
    let total = (pages * page_bytes) as u64;
    let rounds = if quick { 3 } else { 9 };
    crate::say!("L3 file backend, {pages} pages of 2 MiB, ratio = kvtier / raw file I/O speed");
    let set = compare(
        "set 2 MiB pages vs std::fs::write",
        total,
        rounds,
        || {
            for (i, d) in data.iter().enumerate() {
                std::fs::write(raw_dir.join(format!("{i}")), d).unwrap();
            }
        },
        || {
            rt.block_on(async {
                for (k, d) in keys.iter().zip(&data) {
                    ps.set(&ctx(), &fp, k, d.clone()).await.unwrap();
                }
            })
        },
    );
    crate::say!("{}", set.line("GiB/s", f64::from(1 << 30)));
    let mut kv_get = || {
        rt.block_on(async {
            let mut n = 0;
            for k in &keys {
                n += ps
                    .get(&ctx(), &fp, k, Some(page_bytes))
                    .await
                    .hit()
                    .unwrap()
                    .len();
            }
            n
        })
    };
    let fs_read = || {
        (0..pages)
            .map(|i| std::fs::read(raw_dir.join(format!("{i}"))).unwrap().len())
            .sum::<usize>()
    };
    // The least a verified read can cost on one thread: the page-cache copy into a buffer
    // already mapped, each 256 KiB checksummed right after it lands. kvtier's get against
    // it is what its own overheads cost (the hop to the blocking pool, allocation, framing).
    let mut chunk_buf = vec![0u8; page_bytes];
    let mut floor = || {
        let mut x = 0u32;
        for i in 0..pages {
            let mut f = std::fs::File::open(raw_dir.join(format!("{i}"))).unwrap();
            for c in chunk_buf.chunks_mut(256 << 10) {
                std::io::Read::read_exact(&mut f, c).unwrap();
                x ^= kvtier_core::checksum::crc32c(c);
            }
        }
        x
    };
    let gib = f64::from(1 << 30);
    let get = compare(
        "get 2 MiB pages vs std::fs::read",
        total,
        rounds,
        fs_read,
        &mut kv_get,
    );
    crate::say!("{}", get.line("GiB/s", gib));
    let vs_floor = compare(
        "get vs verified-read floor (read+CRC32C, 1 thread)",
        total,
        rounds,
        &mut floor,
        &mut kv_get,
    );
    crate::say!("{}", vs_floor.line("GiB/s", gib));
    let bound = compare(
        "verified-read floor vs std::fs::read",
        total,
        rounds,
        fs_read,
        &mut floor,
    );
    crate::say!("{}", bound.line("GiB/s", gib));
    drop(ps);
    let _ = std::fs::remove_dir_all(dir);
}
