//! Prefetch throughput (L3 → L2, end to end through kvtierd) against the backend's raw read
//! throughput of the same objects, with the same concurrency, in the same run.
//!
//! For each backend (file; s3 on a local Ceph RGW unless `--no-s3`), a first in-process kvtierd
//! writes `rounds × pages` 2 MiB pages through to L3 and stops; a second one, on the same L3
//! and with an empty L2, then runs one prefetch per round (wait_complete: Prefetch, TakePrefetch,
//! Release), each on pages it has never seen. Before each prefetch, the baseline reads the same
//! objects with the raw API (std::fs::read / object_store get) at the prefetch's concurrency.
//! Both sides read warm data (page cache / RGW memstore), so the ratio is kvtier's overhead:
//! framing check (CRC32C), the copy into the shared pool, index updates and RPCs.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{InProcessDaemon, median};
use futures::StreamExt;
use kvtier_client::{HostClient, PrefetchOptions, Reserved, outcome};
use kvtier_core::{DType, KvKind, Layout, LayoutSpec, Namespace, PageHasher, PageKey};
use kvtier_proto::v1::PrefetchPolicy;

/// Concurrency of both the prefetch (kvtierd's default) and the raw baseline.
const CONCURRENCY: usize = 16;

/// A Llama-3-8B-like layout: 32 layers, 8 KV heads of 128, bf16, 16-token pages = 2 MiB.
fn layout() -> LayoutSpec {
    LayoutSpec {
        model_id: "bench-8b".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 32,
        kind: KvKind::Mha {
            kv_heads: 8,
            head_dim: 128,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    }
}

fn chain(seed: u32, pages: usize) -> Vec<PageKey> {
    let tokens: Vec<u32> = crate::tokens(pages * 16, u64::from(seed));
    PageHasher::new(16, &Namespace::default())
        .unwrap()
        .keys(&tokens)
}

/// Writes `chains` through a daemon with L3 settings `l3`, and waits until L3 has them all.
async fn populate(l3: &[String], chains: &[Vec<PageKey>]) {
    let total: usize = chains.iter().map(Vec::len).sum();
    let mut sets: Vec<String> = l3.to_vec();
    sets.push(format!("l2.pool_pages={}", total + 8));
    // Every page is stored at once, before any write to L3 lands: no dirty limit.
    sets.push("l2.dirty_fraction=1.0".into());
    sets.push("l3.queue_pages=65536".into());
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let d = InProcessDaemon::start("prefetch-src", &sets);
    let target = d.ready.socket.display().to_string();
    let mut c = HostClient::connect(&target).await.unwrap();
    let s = c.register("writer", &layout()).await.unwrap();
    let len = s.layout.page_bytes();
    for (i, keys) in chains.iter().enumerate() {
        let r = c.reserve(s.id, None, keys).await.unwrap();
        for (j, (k, r)) in keys.iter().zip(&r).enumerate() {
            let Reserved::Slot(slot) = r else {
                panic!("no slot for page {j}")
            };
            let byte = (i * 31 + j) as u8;
            let mut page = vec![byte; len];
            page[..32].copy_from_slice(&k.0);
            s.pool.write(*slot, 0, &page).unwrap();
        }
        c.commit(s.id, keys).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let st = c.stats().await.unwrap().l3.unwrap();
        if st.written_pages + st.skipped_pages >= total as u64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "L3 never held every page: {st:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(c);
    d.stop();
}

/// One row of results.
struct Row {
    pages: usize,
    prefetch: Vec<f64>,
    raw: Vec<f64>,
    /// The floor's time, where the backend has one (file).
    floor: Vec<f64>,
}

impl Row {
    fn print(self, name: &str, page_bytes: usize) {
        self.print_as(name, "raw backend reads", page_bytes)
    }

    /// [`Row::print`] with the baseline named.
    fn print_as(self, name: &str, baseline: &str, page_bytes: usize) {
        let bytes = (self.pages * page_bytes) as f64;
        let (p, r) = (median(self.prefetch), median(self.raw));
        crate::record(
            &format!("prefetch {} x 2 MiB from {name}", self.pages),
            bytes / p / 1e9,
            "GB/s",
            baseline,
            bytes / r / 1e9,
            Some(r / p),
        );
        crate::say!(
            "{name:<6} prefetch {:>7.0} pages/s {:>6.3} GB/s   raw read {:>7.0} pages/s {:>6.3} GB/s   ratio {:.3}",
            self.pages as f64 / p,
            bytes / p / 1e9,
            self.pages as f64 / r,
            bytes / r / 1e9,
            r / p
        );
        if !self.floor.is_empty() {
            let f = median(self.floor);
            crate::record(
                &format!("prefetch from {name} vs its floor (read + CRC32C + copy into a slot)"),
                bytes / p / 1e9,
                "GB/s",
                "the floor, same rounds",
                bytes / f / 1e9,
                Some(f / p),
            );
        }
    }
}

/// Prefetches each chain through a fresh daemon on the same L3, timing each against
/// `raw` reading the same objects just before, and `floor` (the least a verified read into
/// shared memory does with them) when given.
async fn measure<F, Fut, G, GFut>(
    name: &str,
    l3: &[String],
    chains: &[Vec<PageKey>],
    raw: F,
    floor: Option<G>,
) -> Row
where
    F: Fn(Vec<PageKey>) -> Fut,
    Fut: std::future::Future<Output = usize>,
    G: Fn(Vec<PageKey>) -> GFut,
    GFut: std::future::Future<Output = usize>,
{
    let pages = chains[0].len();
    let mut sets: Vec<String> = l3.to_vec();
    sets.extend([
        format!("l2.pool_pages={}", pages + 8),
        "prefetch.budget_fraction=1.0".into(),
        "prefetch.threshold_tokens=0".into(),
        "prefetch.recompute_tokens_per_second=0".into(),
        // Pinned, so the raw baseline reads with the same number in flight.
        format!("prefetch.concurrency={CONCURRENCY}"),
        format!("prefetch.max_concurrency={CONCURRENCY}"),
    ]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    // As many runtime threads as kvtierd itself runs with.
    let d = InProcessDaemon::start_with(&format!("prefetch-{name}"), &sets, 0);
    let target = d.ready.socket.display().to_string();
    let mut c = HostClient::connect(&target).await.unwrap();
    let s = c.register("engine", &layout()).await.unwrap();
    let mut row = Row {
        pages,
        prefetch: Vec::new(),
        raw: Vec::new(),
        floor: Vec::new(),
    };
    for (i, keys) in chains.iter().enumerate() {
        let t = Instant::now();
        let n = raw(keys.clone()).await;
        row.raw.push(t.elapsed().as_secs_f64());
        assert_eq!(n, pages, "the raw read missed objects");
        if let Some(floor) = &floor {
            let t = Instant::now();
            let n = floor(keys.clone()).await;
            row.floor.push(t.elapsed().as_secs_f64());
            assert_eq!(n, pages, "the floor's read missed objects");
        }
        let t = Instant::now();
        let opts = PrefetchOptions::policy(PrefetchPolicy::WaitComplete);
        let id = format!("r{i}");
        let mut stream = c.prefetch(s.id, &id, keys, opts).await.unwrap();
        let first = stream.message().await.unwrap().unwrap();
        let planned = t.elapsed();
        assert_eq!(outcome(&first), "running", "{first:?}");
        let (p, slots) = c.take_prefetch(s.id, &id).await.unwrap();
        let taken = t.elapsed();
        c.release(s.id, &keys[..slots.len()]).await.unwrap();
        if std::env::args().any(|a| a == "--diag") {
            crate::say!(
                "diag   {name} round {i}: planned after {planned:?}, taken after {taken:?}, \
                 released after {:?}",
                t.elapsed()
            );
        }
        row.prefetch.push(t.elapsed().as_secs_f64());
        assert_eq!((outcome(&p).as_str(), slots.len()), ("completed", pages));
        let mut buf = vec![0u8; 32];
        s.pool.read(slots[0], 0, &mut buf).unwrap();
        assert_eq!(buf, keys[0].0, "the first page is not what was stored");
    }
    drop(c);
    d.stop();
    row
}

/// Reads the file store's objects of `keys` with `read` (returning the bytes read), each in a
/// blocking task, [`CONCURRENCY`] at a time: the raw baseline. Counts the objects read.
fn raw_reads<R>(
    store: &Arc<kvtier_storage::file::FileStore>,
    fp: kvtier_core::LayoutFingerprint,
    keys: Vec<PageKey>,
    read: R,
) -> impl std::future::Future<Output = usize> + use<R>
where
    R: Fn(&std::path::Path) -> usize + Copy + Send + 'static,
{
    let store = store.clone();
    async move {
        futures::stream::iter(keys)
            .map(|k| {
                let path = store.path_of(&kvtier_storage::format::object_name(&fp, &k));
                tokio::task::spawn_blocking(move || read(&path))
            })
            .buffer_unordered(CONCURRENCY)
            .filter(|r| std::future::ready(r.as_ref().is_ok_and(|&n| n > 0)))
            .count()
            .await
    }
}

/// Runs the scenario (`quick`: fewer pages and rounds).
pub fn run(quick: bool) {
    let no_s3 = std::env::args().any(|a| a == "--no-s3");
    let (pages, rounds) = if quick { (16, 3) } else { (64, 5) };
    let page_bytes = Layout::new(layout()).unwrap().page_bytes();
    let fp = Layout::new(layout()).unwrap().fingerprint();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    crate::say!(
        "prefetch L3 -> L2, {pages} pages of {} MiB per prefetch, {rounds} rounds (medians), \
         concurrency {CONCURRENCY}; ratio = prefetch / raw read speed",
        page_bytes >> 20
    );

    // File backend.
    let root: PathBuf =
        std::env::temp_dir().join(format!("kvtier-bench-prefetch-l3-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let l3 = vec![
        "l3.backend=file".to_string(),
        format!("l3.file.path={}", root.display()),
    ];
    let chains: Vec<Vec<PageKey>> = (0..rounds as u32).map(|r| chain(r + 1, pages)).collect();
    rt.block_on(populate(&l3, &chains));
    let store = rt
        .block_on(kvtier_storage::file::FileStore::open(
            root.clone(),
            &kvtier_config::l3::FileSection::unbounded(),
            &[],
        ))
        .unwrap();
    // The floor of a verified read into shared memory at the same concurrency: each page
    // read whole, checksummed, and copied into its slot (kvtier-shm lends no references into
    // shared memory, so the slot cannot be a read's destination), in one blocking task.
    let floor_pool = Arc::new(crate::scenarios::gpu::host_pool(
        page_bytes,
        pages as u32,
        "prefetch-floor",
    ));
    let floor = |keys: Vec<PageKey>| {
        let (store, pool) = (store.clone(), floor_pool.clone());
        let at = kvtier_storage::format::HEADER_LEN;
        async move {
            futures::stream::iter(keys.into_iter().enumerate())
                .map(|(i, k)| {
                    let path = store.path_of(&kvtier_storage::format::object_name(&fp, &k));
                    let pool = pool.clone();
                    tokio::task::spawn_blocking(move || {
                        let b = std::fs::read(path).unwrap();
                        std::hint::black_box(kvtier_core::checksum::crc32c(&b[at..]));
                        pool.write(i as u32, 0, &b[at..]).unwrap();
                        b.len()
                    })
                })
                .buffer_unordered(CONCURRENCY)
                .filter(|r| std::future::ready(r.as_ref().is_ok_and(|&n| n > 0)))
                .count()
                .await
        }
    };
    let row = rt.block_on(measure(
        "file",
        &l3,
        &chains,
        |keys| raw_reads(&store, fp, keys, |p| std::fs::read(p).unwrap().len()),
        Some(floor),
    ));
    let row_page = median(row.prefetch.clone()) / pages as f64;
    row.print("file", page_bytes);
    if crate::diag::wanted() {
        diagnose(&rt, &store, &fp, &chains[0], page_bytes, rounds, row_page);
    }
    // The same from the disk (issue 65): kvtierd reads with O_DIRECT, so no page of the
    // store is served from the page cache, against raw O_DIRECT reads of the same files at
    // the same concurrency.
    let mut direct = l3.clone();
    direct.push("l3.file.io=direct".into());
    let object_len = page_bytes + kvtier_storage::format::HEADER_LEN;
    let row = rt.block_on(measure(
        "file-direct",
        &direct,
        &chains,
        |keys| {
            raw_reads(&store, fp, keys, move |p| {
                crate::scenarios::l3_file_cold::raw_read_reused(p, object_len)
            })
        },
        None::<fn(Vec<PageKey>) -> std::future::Ready<usize>>,
    ));
    row.print_as(
        "the disk (file, io = direct)",
        "raw O_DIRECT reads",
        page_bytes,
    );
    let _ = std::fs::remove_dir_all(&root);

    if no_s3 {
        return;
    }
    // S3 backend on a local Ceph RGW (memstore: keep the data small).
    let c = crate::shared_ceph();
    rt.block_on(c.bucket_ready("prefetch"));
    let (ceph_endpoint, ceph_access_key, ceph_secret_key) =
        (c.endpoint(), c.access_key(), c.secret_key());
    let l3 = vec![
        "l3.backend=s3".to_string(),
        format!("l3.s3.endpoint={}", ceph_endpoint),
        "l3.s3.bucket=prefetch".into(),
        "l3.s3.prefix=bench".into(),
        format!("l3.s3.access_key={}", ceph_access_key),
        format!("l3.s3.secret_key={}", ceph_secret_key),
        "l3.timeout=60s".into(),
        "l3.concurrency=16".into(),
    ];
    let pages = pages.min(32);
    let chains: Vec<Vec<PageKey>> = (0..rounds as u32).map(|r| chain(100 + r, pages)).collect();
    rt.block_on(populate(&l3, &chains));
    let raw = Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_endpoint(c.endpoint())
            .with_region(c.region())
            .with_bucket_name("prefetch")
            .with_access_key_id(c.access_key())
            .with_secret_access_key(c.secret_key())
            .with_allow_http(true)
            .build()
            .unwrap(),
    );
    let no_floor: Option<fn(Vec<PageKey>) -> std::future::Ready<usize>> = None;
    let row = rt.block_on(measure(
        "s3",
        &l3,
        &chains,
        |keys| {
            let raw = raw.clone();
            async move {
                use object_store::ObjectStoreExt;
                futures::stream::iter(keys)
                    .map(|k| {
                        let raw = raw.clone();
                        async move {
                            let path = object_store::path::Path::from(format!(
                                "bench/{}",
                                kvtier_storage::format::object_name(&fp, &k)
                            ));
                            raw.get(&path).await.unwrap().bytes().await.unwrap().len()
                        }
                    })
                    .buffer_unordered(CONCURRENCY)
                    .filter(|&n| std::future::ready(n > 0))
                    .count()
                    .await
            }
        },
        no_floor,
    ));
    row.print("s3", page_bytes);
}

/// A shared-memory slot as a backend read's destination, the way kvtierd's prefetch writes one
/// (kvtier-shm lends no references into shared memory: bytes arrive through `write_at`).
struct ShmSlot {
    pool: Arc<kvtier_shm::ShmPool>,
    slot: u32,
}

impl kvtier_storage::ObjectSink for ShmSlot {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.pool
            .write(self.slot, offset as usize, bytes)
            .map_err(|e| e.to_string())
    }
}

/// One page's work in a blocking task: (its index, its object's path).
type PageWork = Arc<dyn Fn(usize, &std::path::Path) + Send + Sync>;

/// `--diag`: the prefetch row split into its costs, 16 reads in flight as in the row
/// (benches/diag.rs), then the row's own time per page for comparison.
fn diagnose(
    rt: &tokio::runtime::Runtime,
    store: &Arc<kvtier_storage::file::FileStore>,
    fp: &kvtier_core::LayoutFingerprint,
    keys: &[PageKey],
    page_bytes: usize,
    rounds: usize,
    row_page: f64,
) {
    let paths: Vec<PathBuf> = keys
        .iter()
        .map(|k| store.path_of(&kvtier_storage::format::object_name(fp, k)))
        .collect();
    let pool = Arc::new(crate::scenarios::gpu::host_pool(
        page_bytes,
        keys.len() as u32,
        "prefetch-diag",
    ));
    let ps = kvtier_storage::PageStore::new(store.clone());
    let at = kvtier_storage::format::HEADER_LEN;
    // Runs `f(page index, path)` for every page in a blocking task, 16 in flight.
    let in_flight = |f: PageWork| {
        rt.block_on(
            futures::stream::iter(paths.iter().cloned().enumerate())
                .map(|(i, p)| {
                    let f = f.clone();
                    tokio::task::spawn_blocking(move || f(i, &p))
                })
                .buffer_unordered(CONCURRENCY)
                .count(),
        )
    };
    let slot_pool = pool.clone();
    crate::diag::Ladder::new(
        &format!("prefetch of one 2 MiB page from file, {CONCURRENCY} in flight"),
        keys.len(),
    )
    .rung(
        "std::fs::read in a blocking task (the row's baseline)",
        || {
            in_flight(Arc::new(|_, p| {
                std::hint::black_box(std::fs::read(p).unwrap());
            }));
        },
    )
    .rung("+ CRC32C of the page in the same task", || {
        in_flight(Arc::new(move |_, p| {
            std::hint::black_box(kvtier_core::checksum::crc32c(
                &std::fs::read(p).unwrap()[at..],
            ));
        }));
    })
    .rung("+ the page copied into its shared-memory slot", || {
        let pool = slot_pool.clone();
        in_flight(Arc::new(move |i, p| {
            let b = std::fs::read(p).unwrap();
            std::hint::black_box(kvtier_core::checksum::crc32c(&b[at..]));
            pool.write(i as u32, 0, &b[at..]).unwrap();
        }));
    })
    .rung("PageStore::get_into the slot (kvtierd's L3 read)", || {
        rt.block_on(
            futures::stream::iter(keys.iter().copied().enumerate())
                .map(|(i, k)| {
                    let (ps, fp) = (ps.clone(), *fp);
                    let sink = Arc::new(ShmSlot {
                        pool: pool.clone(),
                        slot: i as u32,
                    });
                    tokio::spawn(async move {
                        let ctx = kvtier_storage::OpCtx::timeout(Duration::from_secs(60));
                        let l = ps.get_into(&ctx, &fp, &k, Some(page_bytes), sink).await;
                        assert!(matches!(l, kvtier_storage::Landed::Hit(_)), "{l:?}");
                    })
                })
                .buffer_unordered(CONCURRENCY)
                .count(),
        );
    })
    .aside("the hop alone: empty blocking tasks, 16 in flight", || {
        in_flight(Arc::new(|_, _| {}));
    })
    .run(rounds);
    crate::say!(
        "diag     {:<58} {:>9.1} µs     (the row)",
        "prefetch -> take -> release through kvtierd",
        row_page * 1e6
    );
}
