//! The file backend against raw file I/O of the same bytes, in the same directory, with the
//! same sync semantics (none), in the same run: set/get of 2 MiB pages through PageStore
//! (framing, CRC32C, temp file + rename, index) vs `std::fs::write` / `std::fs::read`; then
//! the same from the disk rather than the page cache (`l3_file_cold`).
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
    let ps = PageStore::new(store.clone());
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
        (0..pages)
            .map(|i| read_verified(&raw_dir.join(format!("{i}")), 0, &mut chunk_buf))
            .fold(0u32, |x, c| x ^ c)
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
    // The same floor as an async caller has it: each page's verified read in a blocking task
    // (the hop every tokio file read pays; `--diag` prints it alone), into the same reused
    // buffer. What kvtier's get costs beyond this is its own.
    let shared_buf = std::sync::Arc::new(parking_lot::Mutex::new(vec![0u8; page_bytes]));
    let mut async_floor = || {
        rt.block_on(async {
            let mut x = 0u32;
            for i in 0..pages {
                let (p, b) = (raw_dir.join(format!("{i}")), shared_buf.clone());
                x ^= tokio::task::spawn_blocking(move || read_verified(&p, 0, &mut b.lock()))
                    .await
                    .unwrap();
            }
            x
        })
    };
    let vs_async = compare(
        "get vs the verified-read floor behind one blocking hop",
        total,
        rounds,
        &mut async_floor,
        &mut kv_get,
    );
    crate::say!("{}", vs_async.line("GiB/s", gib));
    if crate::diag::wanted() {
        let objects: Vec<std::path::PathBuf> = keys
            .iter()
            .map(|k| store.path_of(&kvtier_storage::format::object_name(&fp, k)))
            .collect();
        diagnose(&rt, &ps, &fp, &keys, &raw_dir, &objects, page_bytes, rounds);
    }
    drop(ps);
    crate::scenarios::l3_file_cold::run(quick, &dir);
    let _ = std::fs::remove_dir_all(dir);
}

/// Reads `path` from byte `at` into `dst` 256 KiB at a time, checksumming each piece as it
/// lands (the verified-read floor's loop).
fn read_verified(path: &std::path::Path, at: u64, dst: &mut [u8]) -> u32 {
    let mut f = std::fs::File::open(path).unwrap();
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(at)).unwrap();
    let mut x = 0u32;
    for c in dst.chunks_mut(256 << 10) {
        std::io::Read::read_exact(&mut f, c).unwrap();
        x = kvtier_core::checksum::crc32c_append(x, c);
    }
    x
}

/// Reads `path` from byte `at` to its end into `buf` (its spare capacity: not zeroed first,
/// one read), then checksums it: what kvtier's get does with a file since it stopped zeroing.
fn read_whole_verified(path: &std::path::Path, at: u64, buf: &mut Vec<u8>) -> u32 {
    let mut f = std::fs::File::open(path).unwrap();
    std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(at)).unwrap();
    std::io::Read::read_to_end(&mut f, buf).unwrap();
    kvtier_core::checksum::crc32c(buf)
}

/// A destination kvtier reads into in place, reused from page to page (what an L2 slot or
/// SGLang's recycled buffer is to the daemon).
struct Reused(parking_lot::Mutex<Vec<u8>>);

impl kvtier_storage::ObjectSink for Reused {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let o = offset as usize;
        self.0.lock()[o..o + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn fill_at(
        &self,
        offset: u64,
        len: usize,
        fill: kvtier_storage::Fill<'_>,
    ) -> Option<Result<(), String>> {
        let o = offset as usize;
        Some(fill(&mut self.0.lock()[o..o + len]))
    }
}

/// `--diag`: the get row split into its costs, one rung at a time (benches/diag.rs).
#[allow(clippy::too_many_arguments)]
fn diagnose(
    rt: &tokio::runtime::Runtime,
    ps: &PageStore,
    fp: &LayoutFingerprint,
    keys: &[PageKey],
    raw_dir: &std::path::Path,
    objects: &[std::path::PathBuf],
    page_bytes: usize,
    rounds: usize,
) {
    let pages = keys.len();
    let at = kvtier_storage::format::HEADER_LEN as u64;
    let path = |i: usize| raw_dir.join(format!("{i}"));
    let ctx = || OpCtx::timeout(Duration::from_secs(60));
    let (mut b1, mut b2, mut b3) = (
        vec![0u8; page_bytes],
        vec![0u8; page_bytes],
        vec![0u8; page_bytes],
    );
    let sink = std::sync::Arc::new(Reused(parking_lot::Mutex::new(vec![0u8; page_bytes])));
    crate::diag::Ladder::new("l3_file get of one 2 MiB page", pages)
        .rung(
            "std::fs::read (a new buffer per page; the row's baseline)",
            || {
                for i in 0..pages {
                    std::hint::black_box(std::fs::read(path(i)).unwrap());
                }
            },
        )
        .rung(
            "open + read into one reused buffer (the copy alone)",
            || {
                for i in 0..pages {
                    let mut f = std::fs::File::open(path(i)).unwrap();
                    std::io::Read::read_exact(&mut f, &mut b1).unwrap();
                }
            },
        )
        .rung("+ the payload at byte 72, after kvtier's header", || {
            for o in objects {
                let mut f = std::fs::File::open(o).unwrap();
                std::io::Seek::seek(&mut f, std::io::SeekFrom::Start(at)).unwrap();
                std::io::Read::read_exact(&mut f, &mut b2).unwrap();
            }
        })
        .rung(
            "+ CRC32C of each 256 KiB as it lands (verified floor)",
            || {
                for o in objects {
                    std::hint::black_box(read_verified(o, at, &mut b3));
                }
            },
        )
        .rung("+ a new buffer per page, read whole, then CRC32C", || {
            for o in objects {
                let mut b = Vec::with_capacity(page_bytes);
                std::hint::black_box(read_whole_verified(o, at, &mut b));
            }
        })
        .rung(
            "+ that read in a blocking task (tokio spawn_blocking)",
            || {
                rt.block_on(async {
                    for o in objects {
                        let (o, mut b) = (o.clone(), Vec::with_capacity(page_bytes));
                        let b = tokio::task::spawn_blocking(move || {
                            std::hint::black_box(read_whole_verified(&o, at, &mut b));
                            b
                        })
                        .await
                        .unwrap();
                        std::hint::black_box(b);
                    }
                })
            },
        )
        .rung("PageStore::get (the row)", || {
            rt.block_on(async {
                for k in keys {
                    let b = ps.get(&ctx(), fp, k, Some(page_bytes)).await.hit();
                    std::hint::black_box(b.unwrap());
                }
            })
        })
        .aside("the hop alone: an empty blocking task per page", || {
            rt.block_on(async {
                for _ in 0..pages {
                    tokio::task::spawn_blocking(|| ()).await.unwrap();
                }
            })
        })
        .aside(
            "PageStore::get_into one reused buffer, lent piece by piece",
            || {
                rt.block_on(async {
                    for k in keys {
                        let s: std::sync::Arc<dyn kvtier_storage::ObjectSink> = sink.clone();
                        let l = ps.get_into(&ctx(), fp, k, Some(page_bytes), s).await;
                        assert!(matches!(l, kvtier_storage::Landed::Hit(_)));
                    }
                })
            },
        )
        .run(rounds);
}
