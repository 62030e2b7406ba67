//! The conformance suite on every backend available without a server, and the file backend's
//! own guarantees: restart, crash leftovers, capacity, TTL, free-space guard.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvtier_config::l3::{FileIo, FileSection, RocksdbSection};
use kvtier_config::{ByteSize, Capacity, Dur};
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_storage::file::FileStore;
use kvtier_storage::memory::MemoryStore;
use kvtier_storage::{Fetch, OpCtx, PageStore, StorageError, Store, conformance};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-storage-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn ctx() -> OpCtx {
    OpCtx::timeout(Duration::from_secs(30))
}

#[tokio::test]
async fn memory_conforms() {
    conformance::run_all(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn file_conforms() {
    let dir = tmpdir("conf");
    conformance::run_all(
        FileStore::open(&dir, &FileSection::unbounded(), &[])
            .await
            .unwrap(),
    )
    .await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// `l3.file.io = "direct"`: the same contract through `O_DIRECT`.
#[tokio::test]
async fn file_conforms_with_direct_io() {
    let dir = tmpdir("conf-direct");
    let cfg = FileSection {
        io: FileIo::Direct,
        ..FileSection::unbounded()
    };
    conformance::run_all(FileStore::open(&dir, &cfg, &[]).await.unwrap()).await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// Direct and buffered I/O share one format on disk: a store switched from one to the other
/// serves every page the other wrote, at every length around the alignment, and a byte
/// flipped on disk is a miss under both.
#[tokio::test]
async fn direct_and_buffered_stores_serve_each_others_pages_and_refuse_corrupt_ones() {
    let dir = tmpdir("direct-switch");
    let fp = LayoutFingerprint([6; 16]);
    let lens = [
        1usize,
        4023,
        4024,
        4025,
        8192,
        (2 << 20) - 72,
        2 << 20,
        (4 << 20) + 5,
    ];
    let page = |i: usize, len: usize| {
        Bytes::from(
            (0..len)
                .map(|j| (j * 7 + i * 13) as u8)
                .collect::<Vec<u8>>(),
        )
    };
    let open = |io: FileIo| {
        let dir = dir.clone();
        async move {
            let cfg = FileSection {
                io,
                ..FileSection::unbounded()
            };
            PageStore::new(FileStore::open(&dir, &cfg, &[]).await.unwrap())
        }
    };
    for (writer, reader) in [
        (FileIo::Direct, FileIo::Buffered),
        (FileIo::Buffered, FileIo::Direct),
        (FileIo::Direct, FileIo::Direct),
    ] {
        let w = open(writer).await;
        for (i, &len) in lens.iter().enumerate() {
            w.set(&ctx(), &fp, &PageKey([i as u8; 32]), page(i, len))
                .await
                .unwrap();
        }
        drop(w);
        let r = open(reader).await;
        for (i, &len) in lens.iter().enumerate() {
            let k = PageKey([i as u8; 32]);
            assert_eq!(
                r.get(&ctx(), &fp, &k, Some(len)).await.hit(),
                Some(page(i, len)),
                "{writer:?} wrote, {reader:?} read, {len} bytes"
            );
            assert_eq!(
                r.get(&ctx(), &fp, &k, None).await.hit(),
                Some(page(i, len)),
                "{writer:?} wrote, {reader:?} read, {len} bytes, length not given"
            );
        }
    }
    let r = open(FileIo::Direct).await;
    let k = PageKey([6; 32]);
    let victim = FileStore::open(&dir, &FileSection::unbounded(), &[])
        .await
        .unwrap()
        .path_of(&kvtier_storage::format::object_name(&fp, &k));
    let mut raw = std::fs::read(&victim).unwrap();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    std::fs::write(&victim, raw).unwrap();
    assert!(matches!(r.get(&ctx(), &fp, &k, None).await, Fetch::Miss(_)));
    std::fs::remove_dir_all(dir).unwrap();
}

/// A FIFO (or anything but a regular file) planted at an object's name is refused at once,
/// under both I/O modes: it never holds a reading thread waiting for a writer. (Its own
/// runtime, shut down without waiting: a read stuck on the FIFO fails the test, not hangs it.)
#[test]
fn a_fifo_at_an_object_name_is_refused_without_blocking() {
    let dir = tmpdir("fifo");
    let fp = LayoutFingerprint([7; 16]);
    let key = PageKey([9; 32]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let outcomes = rt.block_on(async {
        let mut outcomes = Vec::new();
        for io in [FileIo::Buffered, FileIo::Direct] {
            let cfg = FileSection {
                io,
                ..FileSection::unbounded()
            };
            let store = FileStore::open(&dir, &cfg, &[]).await.unwrap();
            let name = kvtier_storage::format::object_name(&fp, &key);
            let path = store.path_of(&name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            let _ = std::fs::remove_file(&path);
            rustix::fs::mknodat(
                rustix::fs::CWD,
                &path,
                rustix::fs::FileType::Fifo,
                rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR,
                0,
            )
            .unwrap();
            let raw = tokio::time::timeout(Duration::from_secs(5), store.get(&name))
                .await
                .map(|r| r.is_err());
            let page = tokio::time::timeout(
                Duration::from_secs(5),
                PageStore::new(store).get(&ctx(), &fp, &key, None),
            )
            .await
            .map(|f| matches!(f, Fetch::Miss(_)));
            outcomes.push((io, raw, page));
        }
        outcomes
    });
    rt.shutdown_timeout(Duration::from_millis(100));
    for (io, raw, page) in outcomes {
        assert_eq!(raw, Ok(true), "{io:?}: the store's read (Err: blocked)");
        assert_eq!(page, Ok(true), "{io:?}: the page read (Err: blocked)");
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A destination of a page's size that refuses bytes past its end, as an L2 slot does.
struct Slot(parking_lot::Mutex<Vec<u8>>);

impl kvtier_storage::ObjectSink for Slot {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        let mut g = self.0.lock();
        let end = offset as usize + bytes.len();
        if end > g.len() {
            return Err(format!("{end} bytes into a {}-byte slot", g.len()));
        }
        g[offset as usize..end].copy_from_slice(bytes);
        Ok(())
    }
}

/// A page file grown on disk, by a byte or by blocks, is a bad object when read into a slot
/// of the page's size (which refuses the extra bytes): counted corrupt and deleted, under
/// both I/O modes, never a plain failure that leaves it to be found again.
#[tokio::test]
async fn a_grown_page_file_read_into_a_slot_is_corrupt_and_deleted() {
    let dir = tmpdir("grown");
    let fp = LayoutFingerprint([8; 16]);
    for io in [FileIo::Buffered, FileIo::Direct] {
        for (i, grow) in [1usize, 4096, 3 << 20].into_iter().enumerate() {
            let cfg = FileSection {
                io,
                ..FileSection::unbounded()
            };
            let store = FileStore::open(&dir, &cfg, &[]).await.unwrap();
            let ps = PageStore::new(store.clone());
            let key = PageKey([i as u8; 32]);
            let len = 64 * 1024;
            ps.set(&ctx(), &fp, &key, Bytes::from(vec![3u8; len]))
                .await
                .unwrap();
            let path = store.path_of(&kvtier_storage::format::object_name(&fp, &key));
            let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.set_len(f.metadata().unwrap().len() + grow as u64)
                .unwrap();
            let slot = Arc::new(Slot(parking_lot::Mutex::new(vec![0u8; len])));
            let got = ps.get_into(&ctx(), &fp, &key, Some(len), slot).await;
            assert!(
                matches!(
                    got,
                    kvtier_storage::Landed::Miss(kvtier_storage::MissReason::Corrupt(_))
                ),
                "{io:?}, grown by {grow}: {got:?}"
            );
            assert!(!path.exists(), "{io:?}, grown by {grow}: the file stayed");
        }
    }
    std::fs::remove_dir_all(dir).unwrap();
}

/// A store pointed at a directory it did not make deletes nothing there: it refuses one with
/// other files in it, and its clean-ups in its own follow no symlink and spare what kvtier
/// did not name.
#[tokio::test]
async fn a_file_store_never_deletes_what_it_did_not_write() {
    let dir = tmpdir("foreign");
    std::fs::create_dir_all(dir.join("tmp/keep")).unwrap();
    std::fs::write(dir.join("precious.txt"), b"mine").unwrap();
    std::fs::write(dir.join("tmp/keep/notes"), b"mine").unwrap();
    let e = FileStore::open(&dir, &FileSection::unbounded(), &[])
        .await
        .unwrap_err();
    assert!(
        matches!(&e, StorageError::Invalid(m) if m.contains("precious.txt") && m.contains(".kvtier-file-store")),
        "{e}"
    );
    assert!(dir.join("precious.txt").exists() && dir.join("tmp/keep/notes").exists());

    // Its own directory, where someone planted a symlink to theirs and a file of their own.
    let outside = tmpdir("foreign-outside");
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(outside.join(".hidden"), b"mine").unwrap();
    std::fs::write(outside.join("abcd"), b"mine").unwrap();
    let own = tmpdir("foreign-own");
    let store = FileStore::open(&own, &FileSection::unbounded(), &[])
        .await
        .unwrap();
    assert!(own.join(kvtier_storage::file::MARKER).is_file());
    store
        .set(
            "ab/cdef",
            Bytes::from_static(b"h"),
            Bytes::from_static(b"page"),
        )
        .await
        .unwrap();
    std::os::unix::fs::symlink(&outside, own.join("objects/ab/ef")).unwrap();
    std::fs::write(own.join("objects/ab/NOTES.txt"), b"mine").unwrap();
    drop(store);
    // Reopened: the index rebuild walks no symlink (the temp-looking file outside stays).
    let store = FileStore::open(&own, &FileSection::unbounded(), &[])
        .await
        .unwrap();
    assert_eq!(store.clear().await.unwrap(), 1, "only the one object goes");
    for kept in [outside.join(".hidden"), outside.join("abcd")] {
        assert!(kept.exists(), "{} was deleted", kept.display());
    }
    assert!(own.join("objects/ab/NOTES.txt").exists());
    for d in [dir, outside, own] {
        std::fs::remove_dir_all(d).unwrap();
    }
}

#[tokio::test]
async fn file_pages_survive_restart_and_crash_leftovers_are_never_served() {
    let dir = tmpdir("restart");
    let fp = LayoutFingerprint([5; 16]);
    let keys: Vec<PageKey> = (0..20u8).map(|i| PageKey([i; 32])).collect();
    let page = |k: &PageKey| Bytes::from(vec![k.0[0]; 64 * 1024]);
    {
        let ps = PageStore::new(
            FileStore::open(&dir, &FileSection::unbounded(), &[])
                .await
                .unwrap(),
        );
        for k in &keys {
            ps.set(&ctx(), &fp, k, page(k)).await.unwrap();
        }
    }
    // A write cut short by a crash: a temp file beside the objects that never got its final
    // name (and one where versions before 0.2 kept them).
    let name = kvtier_storage::format::object_name(&fp, &PageKey([99; 32]));
    let probe_dir = tmpdir("restart-probe");
    let probe = FileStore::open(&probe_dir, &FileSection::unbounded(), &[])
        .await
        .unwrap();
    let rel = probe.path_of(&name);
    let rel = rel.strip_prefix(&probe_dir).unwrap();
    let temp = dir.join(rel).with_file_name(".t999-0");
    std::fs::create_dir_all(temp.parent().unwrap()).unwrap();
    std::fs::write(&temp, b"half a page").unwrap();
    // Left by a process that crashed a minute ago (a fresher temp file may be a write still
    // running in another process, and is left).
    std::fs::File::options()
        .write(true)
        .open(&temp)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(60))
        .unwrap();
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    std::fs::write(dir.join("tmp/999-0.tmp"), b"half a page").unwrap();
    let store = FileStore::open(&dir, &FileSection::unbounded(), &[])
        .await
        .unwrap();
    assert!(!dir.join("tmp").exists(), "the old temp directory stayed");
    let ps = PageStore::new(store.clone());
    for k in &keys {
        assert_eq!(
            ps.get(&ctx(), &fp, k, Some(64 * 1024)).await.hit(),
            Some(page(k))
        );
    }
    // The index is rebuilt in the background and then accounts for every object.
    for _ in 0..200 {
        if store.stats().objects == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(store.stats().objects, 20);
    assert_eq!(store.stats().bytes, 20 * (64 * 1024 + 72));
    assert!(!temp.exists(), "a stale temp file was not removed");
    assert!(matches!(
        ps.get(&ctx(), &fp, &PageKey([99; 32]), None).await,
        Fetch::Miss(_)
    ));
    // Bytes corrupted on disk are a miss, and the file is removed.
    let victim = store.path_of(&kvtier_storage::format::object_name(&fp, &keys[3]));
    let mut raw = std::fs::read(&victim).unwrap();
    raw[1000] ^= 0xff;
    std::fs::write(&victim, raw).unwrap();
    assert!(matches!(
        ps.get(&ctx(), &fp, &keys[3], None).await,
        Fetch::Miss(_)
    ));
    assert!(!victim.exists());
    std::fs::remove_dir_all(dir).unwrap();
}

/// `capacity_bytes = "N%"`: N% of the filesystem's free space at start plus what the store
/// already holds, resolved once the index is rebuilt and shown in its stats. Reopened over the
/// pages of an earlier run, the bound counts them as the store's own space.
#[tokio::test]
async fn file_capacity_as_a_share_counts_the_free_space_and_what_the_store_holds() {
    let dir = tmpdir("cap-share");
    let n = |i: u32| format!("ab/{i:04x}");
    {
        let s = FileStore::open(&dir, &FileSection::unbounded(), &[])
            .await
            .unwrap();
        for i in 0..3 {
            s.set(&n(i), Bytes::new(), Bytes::from(vec![7u8; 100_000]))
                .await
                .unwrap();
        }
    }
    let free = {
        let st = rustix::fs::statvfs(&dir).unwrap();
        st.f_bavail * st.f_frsize
    };
    let cfg = FileSection {
        capacity_bytes: Capacity::Percent(50.0),
        ..FileSection::unbounded()
    };
    let s = FileStore::open(&dir, &cfg, &[]).await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while s.stats().capacity == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the share was never resolved"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = s.stats();
    assert_eq!(
        (st.objects, st.bytes),
        (3, 300_000),
        "the earlier run's pages"
    );
    let want = (free + st.bytes) as f64 / 2.0;
    // Other processes write to the same filesystem meanwhile: within 5%.
    assert!(
        (st.capacity as f64 - want).abs() < want * 0.05,
        "capacity {} for {free} free + {} held",
        st.capacity,
        st.bytes
    );
    // Nothing was evicted: the bound is far above what it holds.
    assert!(s.exists(&n(0)).await.unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn file_capacity_evicts_least_recently_used() {
    let dir = tmpdir("cap");
    let cfg = FileSection {
        capacity_bytes: Capacity::Bytes(4 * 1000),
        ..FileSection::unbounded()
    };
    let s = FileStore::open(&dir, &cfg, &[]).await.unwrap();
    let n = |i: u32| format!("ab/{i:04x}");
    for i in 0..4 {
        s.set(&n(i), Bytes::new(), Bytes::from(vec![0u8; 1000]))
            .await
            .unwrap();
    }
    // Touch 0, so 1 is now the least recently used.
    assert!(s.get(&n(0)).await.unwrap().is_some());
    s.set(&n(4), Bytes::new(), Bytes::from(vec![0u8; 1000]))
        .await
        .unwrap();
    assert!(s.exists(&n(0)).await.unwrap());
    assert!(!s.exists(&n(1)).await.unwrap(), "LRU object survived");
    assert!(s.exists(&n(4)).await.unwrap());
    let st = s.stats();
    assert_eq!((st.objects, st.bytes, st.evictions), (4, 4000, 1));
    // The eviction is reported once, by name (kvtierd's L3 events).
    let removed = s.take_removed();
    assert_eq!((removed.names, removed.overflowed), (vec![n(1)], false));
    assert_eq!(s.take_removed(), kvtier_storage::Removed::default());
    // An object larger than the whole capacity is refused.
    assert!(matches!(
        s.set(&n(9), Bytes::new(), Bytes::from(vec![0u8; 5000]))
            .await,
        Err(StorageError::NoSpace(_))
    ));
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn file_ttl_and_free_space_guard() {
    let dir = tmpdir("ttl");
    let cfg = FileSection {
        ttl: Dur(Duration::from_millis(50)),
        ..FileSection::unbounded()
    };
    let s = FileStore::open(&dir, &cfg, &[]).await.unwrap();
    s.set("ab/01", Bytes::new(), Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert!(s.exists("ab/01").await.unwrap());
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(
        !s.exists("ab/01").await.unwrap(),
        "expired object still exists"
    );
    assert!(
        s.get("ab/01").await.unwrap().is_none(),
        "expired object served"
    );

    let cfg = FileSection {
        min_free_bytes: ByteSize(u64::MAX / 2),
        ..FileSection::unbounded()
    };
    let s = FileStore::open(dir.join("guard"), &cfg, &[]).await.unwrap();
    let e = s
        .set("ab/02", Bytes::new(), Bytes::from_static(b"x"))
        .await
        .unwrap_err();
    assert!(matches!(e, StorageError::NoSpace(_)), "{e}");
    assert!(!s.exists("ab/02").await.unwrap());
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn deadlines_and_cancellation_become_misses() {
    /// A store whose every call hangs.
    #[derive(Debug)]
    struct Hang;
    #[async_trait::async_trait]
    impl Store for Hang {
        fn kind(&self) -> &'static str {
            "hang"
        }
        async fn get(&self, _: &str) -> Result<Option<Bytes>, StorageError> {
            std::future::pending().await
        }
        async fn set(&self, _: &str, _: Bytes, _: Bytes) -> Result<(), StorageError> {
            std::future::pending().await
        }
        async fn exists(&self, _: &str) -> Result<bool, StorageError> {
            std::future::pending().await
        }
        async fn delete(&self, _: &str) -> Result<(), StorageError> {
            std::future::pending().await
        }
        async fn clear(&self) -> Result<u64, StorageError> {
            std::future::pending().await
        }
        fn take_removed(&self) -> kvtier_storage::Removed {
            kvtier_storage::Removed::default()
        }
        fn stats(&self) -> kvtier_storage::StoreStats {
            Default::default()
        }
    }
    let ps = PageStore::new(Arc::new(Hang));
    let fp = LayoutFingerprint([1; 16]);
    let key = PageKey([2; 32]);
    let short = OpCtx::timeout(Duration::from_millis(30));
    assert!(matches!(
        ps.get(&short, &fp, &key, None).await,
        Fetch::Miss(kvtier_storage::MissReason::Timeout)
    ));
    let c = OpCtx::timeout(Duration::from_secs(60));
    c.cancel.cancel();
    assert!(matches!(
        ps.set(&c, &fp, &key, Bytes::new()).await,
        Err(StorageError::Cancelled)
    ));
    assert_eq!(ps.stats().failed, 1);
    assert_eq!(ps.stats().set_failures, 1);
}

#[tokio::test]
async fn rocksdb_conforms() {
    use kvtier_storage::rocks::RocksStore;
    let dir = tmpdir("rocks");
    conformance::run_all(
        RocksStore::open(&dir, &RocksdbSection::default(), &[])
            .await
            .unwrap(),
    )
    .await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn rocksdb_pages_survive_reopen_and_capacity_holds() {
    use kvtier_storage::rocks::RocksStore;
    let dir = tmpdir("rocks-reopen");
    let fp = LayoutFingerprint([6; 16]);
    let keys: Vec<PageKey> = (0..10u8).map(|i| PageKey([i; 32])).collect();
    let page = |k: &PageKey| Bytes::from(vec![k.0[0]; 32 * 1024]);
    let obj = (32 * 1024 + 72) as u64;
    {
        let cfg = RocksdbSection {
            capacity_bytes: ByteSize(8 * obj),
            ..RocksdbSection::default()
        };
        let s = RocksStore::open(&dir, &cfg, &[]).await.unwrap();
        let ps = PageStore::new(s.clone());
        for k in &keys {
            ps.set(&ctx(), &fp, k, page(k)).await.unwrap();
        }
        // Ten pages into a capacity of eight: the two least recently used went.
        let st = s.stats();
        assert_eq!((st.objects, st.bytes, st.evictions), (8, 8 * obj, 2));
        let removed = s.take_removed().names;
        let first = |k: &PageKey| removed.iter().any(|n| n.ends_with(&k.to_hex()));
        assert_eq!(removed.len(), 2);
        assert!(first(&keys[0]) && first(&keys[1]), "{removed:?}");
        assert!(ps.get(&ctx(), &fp, &keys[0], None).await.hit().is_none());
    }
    let s = RocksStore::open(&dir, &RocksdbSection::default(), &[])
        .await
        .unwrap();
    assert_eq!(
        s.stats().objects,
        8,
        "the index was not rebuilt from the sizes family"
    );
    let ps = PageStore::new(s);
    for k in &keys[2..] {
        assert_eq!(
            ps.get(&ctx(), &fp, k, Some(32 * 1024)).await.hit(),
            Some(page(k))
        );
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn a_rocksdb_blob_corrupted_on_disk_is_a_miss_never_wrong_bytes() {
    // RocksDB's own blob checksum is off on reads (kvtier's page CRC covers every byte), so
    // this is what stands between a flipped bit on disk and the engine.
    use kvtier_storage::rocks::RocksStore;
    let dir = tmpdir("rocks-corrupt");
    let fp = LayoutFingerprint([8; 16]);
    let keys: Vec<PageKey> = (0..4u8).map(|i| PageKey([i + 1; 32])).collect();
    let page = |k: &PageKey| {
        Bytes::from(
            (0..256 * 1024)
                .map(|j| (j as u8).wrapping_mul(k.0[0]))
                .collect::<Vec<u8>>(),
        )
    };
    {
        let ps = PageStore::new(
            RocksStore::open(&dir, &RocksdbSection::default(), &[])
                .await
                .unwrap(),
        );
        for k in &keys {
            ps.set(&ctx(), &fp, k, page(k)).await.unwrap();
        }
    }
    // Reopening replays the log and flushes it, so the pages now sit in blob files.
    drop(
        RocksStore::open(&dir, &RocksdbSection::default(), &[])
            .await
            .unwrap(),
    );
    let blobs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "blob"))
        .collect();
    assert!(!blobs.is_empty(), "no blob file in {dir:?}");
    for b in &blobs {
        let mut bytes = std::fs::read(b).unwrap();
        // Flip a byte in every page-sized stretch of the file.
        let mut at = 128 * 1024;
        while at < bytes.len() {
            bytes[at] ^= 0x5a;
            at += 256 * 1024;
        }
        std::fs::write(b, bytes).unwrap();
    }
    let ps = PageStore::new(
        RocksStore::open(&dir, &RocksdbSection::default(), &[])
            .await
            .unwrap(),
    );
    let mut corrupt = 0;
    for k in &keys {
        match ps.get(&ctx(), &fp, k, Some(256 * 1024)).await {
            Fetch::Hit(b) => assert_eq!(b, page(k), "wrong bytes served for {k:?}"),
            Fetch::Miss(why) => {
                assert_eq!(why.label(), "corrupt", "{why:?}");
                corrupt += 1;
            }
        }
    }
    assert!(corrupt > 0, "no page read the flipped bytes");
    assert_eq!(ps.stats().corrupt, corrupt);
    std::fs::remove_dir_all(dir).unwrap();
}
