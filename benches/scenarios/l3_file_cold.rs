//! The file backend against the disk, not the page cache (part of `l3_file`): what an L3 hit
//! costs when the page is not in memory. The baseline is a raw `O_DIRECT` transfer of the
//! same bytes on the same device, in the same run: one aligned read (or write) per page,
//! straight into (or from) an aligned buffer, no framing, no checksum, no rename.
//! - `l3.file.io = "direct"` against it, one page at a time and 8 in flight;
//! - `l3.file.io = "buffered"` with the store's files dropped from the page cache before
//!   each round (`posix_fadvise(DONTNEED)` after they reached the disk): a cold buffered read,
//!   with the kernel's read-ahead;
//! - sets with `O_DIRECT` against raw `O_DIRECT` writes.
#![allow(clippy::unwrap_used)]

use std::os::unix::fs::{FileExt as _, OpenOptionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::compare;
use bytes::Bytes;
use kvtier_config::l3::{FileIo, FileSection};
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::file::FileStore;
use kvtier_storage::{OpCtx, PageStore};

const ALIGN: usize = 4096;
/// Pages read at once in the "in flight" rows: a prefetch of a few pages' worth.
const DEPTH: usize = 8;

/// An aligned window of `len` bytes into `v` (found, not made: no `unsafe`).
fn aligned(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if v.len() < len + ALIGN {
        v.resize(len + ALIGN, 0);
    }
    let off = v.as_ptr().align_offset(ALIGN);
    &mut v[off..off + len]
}

fn direct_flag() -> i32 {
    rustix::fs::OFlags::DIRECT.bits() as i32
}

/// Reads all of `path` with one `O_DIRECT` read into `buf`: the raw cold read.
fn raw_read(path: &Path, len: usize, buf: &mut Vec<u8>) -> usize {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(direct_flag())
        .open(path)
        .unwrap();
    let want = len.div_ceil(ALIGN) * ALIGN;
    let b = aligned(buf, want);
    let mut got = 0;
    while got < len {
        let n = f.read_at(&mut b[got..], got as u64).unwrap();
        assert!(n > 0, "{} ended at {got}", path.display());
        got += n;
    }
    got
}

thread_local! {
    static RAW_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// [`raw_read`] into this thread's reused buffer: the raw cold read of an object file
/// (`len` bytes) as a reader on a blocking pool does it.
pub(crate) fn raw_read_reused(path: &Path, len: usize) -> usize {
    RAW_BUF.with_borrow_mut(|b| raw_read(path, len, b))
}

/// Writes `bytes` (padded to the alignment, then cut back) to `path` with `O_DIRECT`: the raw
/// write.
fn raw_write(path: &Path, bytes: &[u8], buf: &mut Vec<u8>) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(direct_flag())
        .open(path)
        .unwrap();
    let padded = bytes.len().div_ceil(ALIGN) * ALIGN;
    let b = aligned(buf, padded);
    b[..bytes.len()].copy_from_slice(bytes);
    f.write_all_at(b, 0).unwrap();
    f.set_len(bytes.len() as u64).unwrap();
}

/// Drops `paths` from the page cache (after writing back anything dirty).
fn drop_cached(paths: &[PathBuf]) {
    for p in paths {
        let f = std::fs::File::open(p).unwrap();
        f.sync_data().unwrap();
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed).unwrap();
    }
}

/// Runs the rows in a directory beside the other `l3_file` rows' (`quick`: fewer pages and
/// rounds).
pub fn run(quick: bool, dir: &Path) {
    let pages = if quick { 16 } else { 64 };
    let page_bytes = 2usize << 20;
    let rounds = if quick { 3 } else { 7 };
    let raw_dir = dir.join("raw-direct");
    std::fs::create_dir_all(&raw_dir).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let open = |io: FileIo, sub: &str| {
        let cfg = FileSection {
            io,
            ..FileSection::unbounded()
        };
        rt.block_on(FileStore::open(dir.join(sub), &cfg, &[]))
    };
    let store = match open(FileIo::Direct, "direct") {
        Ok(s) => s,
        Err(e) => {
            crate::say!("L3 file backend from the disk: not run, {e}");
            return;
        }
    };
    let buffered = open(FileIo::Buffered, "buffered").unwrap();
    let (direct_ps, buffered_ps) = (
        PageStore::new(store.clone()),
        PageStore::new(buffered.clone()),
    );
    let fp = LayoutFingerprint([4; 16]);
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
    let raw_path = |i: usize| raw_dir.join(format!("{i}"));
    let object =
        |s: &FileStore, k: &PageKey| s.path_of(&kvtier_storage::format::object_name(&fp, k));
    let object_len = page_bytes + kvtier_storage::format::HEADER_LEN;
    let gib = f64::from(1 << 30);
    crate::say!(
        "L3 file backend from the disk, {pages} pages of 2 MiB, ratio = kvtier / raw O_DIRECT \
         of the same bytes"
    );
    // Raw pages the length of kvtier's objects, so both sides move the same bytes.
    let raw_bytes: Vec<Vec<u8>> = data
        .iter()
        .map(|d| {
            let mut v = vec![0u8; kvtier_storage::format::HEADER_LEN];
            v.extend_from_slice(d);
            v
        })
        .collect();
    let mut wbuf = Vec::new();
    let set = compare(
        "set 2 MiB pages, io = direct, vs raw O_DIRECT write",
        total,
        rounds,
        || {
            for (i, d) in raw_bytes.iter().enumerate() {
                raw_write(&raw_path(i), d, &mut wbuf);
            }
        },
        || {
            rt.block_on(async {
                for (k, d) in keys.iter().zip(&data) {
                    direct_ps.set(&ctx(), &fp, k, d.clone()).await.unwrap();
                }
            })
        },
    );
    crate::say!("{}", set.line("GiB/s", gib));
    rt.block_on(async {
        for (k, d) in keys.iter().zip(&data) {
            buffered_ps.set(&ctx(), &fp, k, d.clone()).await.unwrap();
        }
    });
    let buffered_files: Vec<PathBuf> = keys.iter().map(|k| object(&buffered, k)).collect();
    let mut rbuf = Vec::new();
    let mut raw_cold = || {
        (0..pages)
            .map(|i| raw_read(&raw_path(i), object_len, &mut rbuf))
            .sum::<usize>()
    };
    let get = |ps: &PageStore| {
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
    let direct = compare(
        "cold get 2 MiB pages, io = direct, vs raw O_DIRECT read",
        total,
        rounds,
        &mut raw_cold,
        || get(&direct_ps),
    );
    crate::say!("{}", direct.line("GiB/s", gib));
    let cold_buffered = compare(
        "cold get 2 MiB pages, io = buffered (dropped from the page cache), vs raw O_DIRECT read",
        total,
        rounds,
        &mut raw_cold,
        || {
            drop_cached(&buffered_files);
            get(&buffered_ps)
        },
    );
    crate::say!("{}", cold_buffered.line("GiB/s", gib));
    // DEPTH pages at once: the device's queue, as a prefetch of several pages fills it.
    let mut bufs: Vec<Vec<u8>> = (0..DEPTH).map(|_| Vec::new()).collect();
    let raw_in_flight = |bufs: &mut Vec<Vec<u8>>| {
        std::thread::scope(|s| {
            let handles: Vec<_> = bufs
                .iter_mut()
                .enumerate()
                .map(|(t, b)| {
                    let raw_path = &raw_path;
                    s.spawn(move || {
                        (t..pages)
                            .step_by(DEPTH)
                            .map(|i| raw_read(&raw_path(i), object_len, b))
                            .sum::<usize>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum::<usize>()
        })
    };
    let get_in_flight = |ps: &PageStore| {
        rt.block_on(async {
            let mut n = 0;
            let op = ctx();
            for chunk in keys.chunks(DEPTH) {
                let gets = chunk.iter().map(|k| ps.get(&op, &fp, k, Some(page_bytes)));
                for f in futures::future::join_all(gets).await {
                    n += f.hit().unwrap().len();
                }
            }
            n
        })
    };
    let deep = compare(
        &format!("cold get, {DEPTH} pages in flight, io = direct, vs raw O_DIRECT reads"),
        total,
        rounds,
        || raw_in_flight(&mut bufs),
        || get_in_flight(&direct_ps),
    );
    crate::say!("{}", deep.line("GiB/s", gib));
    let deep_buffered = compare(
        &format!(
            "cold get, {DEPTH} pages in flight, io = buffered (dropped from the page cache), vs \
             raw O_DIRECT reads"
        ),
        total,
        rounds,
        || raw_in_flight(&mut bufs),
        || {
            drop_cached(&buffered_files);
            get_in_flight(&buffered_ps)
        },
    );
    crate::say!("{}", deep_buffered.line("GiB/s", gib));
}
