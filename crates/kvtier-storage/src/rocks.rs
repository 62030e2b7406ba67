//! `rocksdb`: pages in a RocksDB database, tuned for large values.
//!
//! Values go to blob files (RocksDB's integrated BlobDB: `enable_blob_files`, values of 4 KiB
//! and more stored out of the LSM tree), so compactions move keys, not pages. A small `sizes`
//! column family holds each object's length: `exists` reads it instead of a page, and the
//! capacity index is rebuilt from it at open without touching a blob. Object and size are
//! written in one atomic write batch.
//!
//! The capacity bound is the same LRU as the file backend's (recency starts afresh after a
//! restart). Every RocksDB call is blocking and runs on tokio's blocking pool.

use parking_lot::Mutex;
use std::path::PathBuf;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use kvtier_config::l3::RocksdbSection;
use kvtier_core::TenantTag;
use rocksdb::{
    ColumnFamilyDescriptor, DB, DBCompressionType, IteratorMode, Options, ReadOptions, WriteBatch,
    WriteOptions,
};

use crate::lru::{Index, blocking, check_fits, now_ns};
use crate::{Removed, StorageError, Store, StoreStats, check_name};

const SIZES: &str = "sizes";

/// How a value is read. RocksDB's own checksum of the blob record is off: every object kvtier
/// stores is a page with its own CRC32C, which `PageStore` verifies on every read (a corrupt
/// page is a miss), so RocksDB's check would read every byte a second time. And it is slow
/// where it matters: Debian's portable librocksdb computes it with a lookup table, which perf
/// showed as the largest user-space cost of a 2 MiB get (get: 0.20 → 0.75 of the file
/// backend). Reads of the `sizes` family and compactions still verify RocksDB's checksums.
fn value_read_opts() -> ReadOptions {
    let mut o = ReadOptions::default();
    o.set_verify_checksums(false);
    o
}

/// The RocksDB backend.
pub struct RocksStore {
    db: Arc<DB>,
    /// The database directory.
    path: PathBuf,
    /// `[l3.rocksdb]`: bound, WAL sync.
    cfg: RocksdbSection,
    index: Arc<Mutex<Index>>,
}

impl std::fmt::Debug for RocksStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RocksStore")
            .field("path", &self.path)
            .finish()
    }
}

fn err(op: &'static str) -> impl FnOnce(rocksdb::Error) -> StorageError {
    move |e| StorageError::Backend {
        backend: "rocksdb",
        message: format!("{op}: {e}"),
        retryable: !matches!(
            e.kind(),
            rocksdb::ErrorKind::InvalidArgument | rocksdb::ErrorKind::NotSupported
        ),
    }
}

/// The `sizes` column family (created at open, so its absence is a broken database).
fn sizes_cf(db: &DB) -> Result<&rocksdb::ColumnFamily, StorageError> {
    db.cf_handle(SIZES)
        .ok_or_else(|| StorageError::Invalid("sizes column family missing".into()))
}

/// Write options: WAL synced on every write, or not.
fn write_opts(sync: bool) -> WriteOptions {
    let mut w = WriteOptions::default();
    w.set_sync(sync);
    w
}

impl RocksStore {
    /// Opens (creating if needed) the database and rebuilds the capacity index from the
    /// `sizes` column family.
    /// `cfg` is `[l3.rocksdb]`; `path` is where the caller resolved its directory to, and
    /// `tenant_quotas` the tenants to track (each by the tag its objects' keys start with,
    /// with its most bytes, 0: counted only).
    pub async fn open(
        path: impl Into<PathBuf>,
        cfg: &RocksdbSection,
        tenant_quotas: &[(TenantTag, u64)],
    ) -> Result<Arc<Self>, StorageError> {
        let dir: PathBuf = path.into();
        let path = dir.clone();
        let db = blocking("rocksdb", move || {
            std::fs::create_dir_all(&path).map_err(|source| StorageError::Io {
                op: "create",
                target: path.display().to_string(),
                source,
            })?;
            // No one else may swap the database's files under it.
            kvtier_shm::check_trusted_dir(&path)
                .map_err(|e| StorageError::Invalid(format!("l3.rocksdb.path: {e}")))?;
            let mut opts = Options::default();
            opts.create_if_missing(true);
            opts.create_missing_column_families(true);
            let mut pages = Options::default();
            pages.set_enable_blob_files(true);
            pages.set_min_blob_size(4096);
            pages.set_blob_file_size(256 << 20);
            pages.set_enable_blob_gc(true);
            // KV pages are dense floats: compression costs CPU and saves little.
            pages.set_compression_type(DBCompressionType::None);
            let cfs = vec![
                ColumnFamilyDescriptor::new("default", pages),
                ColumnFamilyDescriptor::new(SIZES, Options::default()),
            ];
            DB::open_cf_descriptors(&opts, &path, cfs).map_err(err("open"))
        })
        .await?;
        let db = Arc::new(db);
        let index = Arc::new(Mutex::new(Index::with_quotas(tenant_quotas)));
        {
            let (db, index) = (db.clone(), index.clone());
            blocking("rocksdb", move || {
                let cf = sizes_cf(&db)?;
                let at = now_ns();
                let mut g = index.lock();
                for item in db.iterator_cf(cf, IteratorMode::Start) {
                    let (k, v) = item.map_err(err("scan sizes"))?;
                    let (Ok(name), Ok(size)) = (std::str::from_utf8(&k), <[u8; 8]>::try_from(&*v))
                    else {
                        continue;
                    };
                    g.insert(name, u64::from_le_bytes(size), at);
                }
                Ok(())
            })
            .await?;
        }
        Ok(Arc::new(Self {
            db,
            path: dir,
            cfg: cfg.clone(),
            index,
        }))
    }

    fn remove_batch(db: &DB, names: &[String], sync: bool) -> Result<(), StorageError> {
        let cf = sizes_cf(db)?;
        let mut b = WriteBatch::default();
        for n in names {
            b.delete(n.as_bytes());
            b.delete_cf(cf, n.as_bytes());
        }
        db.write_opt(b, &write_opts(sync)).map_err(err("delete"))
    }

    /// Takes deleted `names` out of the capacity index; returns how many there were.
    fn forget(index: &Mutex<Index>, names: &mut Vec<String>) -> u64 {
        let mut g = index.lock();
        for n in names.iter() {
            g.remove(n);
        }
        let n = names.len() as u64;
        names.clear();
        n
    }
}

#[async_trait]
impl Store for RocksStore {
    fn kind(&self) -> &'static str {
        "rocksdb"
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        check_name(name)?;
        let (db, index, name) = (self.db.clone(), self.index.clone(), name.to_string());
        blocking("rocksdb", move || {
            let v = db
                .get_opt(name.as_bytes(), &value_read_opts())
                .map_err(err("get"))?;
            if v.is_some() {
                index.lock().touch(&name, now_ns());
            }
            Ok(v.map(Bytes::from))
        })
        .await
    }

    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        check_name(name)?;
        let size = (head.len() + body.len()) as u64;
        let cap = self.cfg.capacity_bytes.0;
        check_fits(size, cap)?;
        self.index.lock().check_quota(name, size)?;
        let (db, index, name) = (self.db.clone(), self.index.clone(), name.to_string());
        let sync = self.cfg.sync;
        blocking("rocksdb", move || {
            let cf = sizes_cf(&db)?;
            let mut value = Vec::with_capacity(size as usize);
            value.extend_from_slice(&head);
            value.extend_from_slice(&body);
            let mut b = WriteBatch::default();
            b.put(name.as_bytes(), &value);
            b.put_cf(cf, name.as_bytes(), size.to_le_bytes());
            db.write_opt(b, &write_opts(sync)).map_err(err("put"))?;
            let victims = {
                let mut g = index.lock();
                g.insert(&name, size, now_ns());
                g.victims(cap, &name)
            };
            if !victims.is_empty()
                && let Err(e) = Self::remove_batch(&db, &victims, sync)
            {
                index.lock().delete_failures += victims.len() as u64;
                tracing::warn!("rocksdb: evicting {} objects failed: {e}", victims.len());
            }
            Ok(())
        })
        .await
    }

    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        check_name(name)?;
        let (db, name) = (self.db.clone(), name.to_string());
        blocking("rocksdb", move || {
            let cf = sizes_cf(&db)?;
            Ok(db
                .get_pinned_cf(cf, name.as_bytes())
                .map_err(err("exists"))?
                .is_some())
        })
        .await
    }

    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        check_name(name)?;
        let (db, index, name, sync) = (
            self.db.clone(),
            self.index.clone(),
            name.to_string(),
            self.cfg.sync,
        );
        blocking("rocksdb", move || {
            index.lock().remove(&name);
            Self::remove_batch(&db, std::slice::from_ref(&name), sync)
        })
        .await
    }

    async fn clear(&self) -> Result<u64, StorageError> {
        let (db, index, sync) = (self.db.clone(), self.index.clone(), self.cfg.sync);
        blocking("rocksdb", move || {
            // The sizes family names every object; delete in batches as the scan goes.
            let cf = sizes_cf(&db)?;
            let mut names = Vec::with_capacity(1024);
            let mut n = 0u64;
            for item in db.iterator_cf(cf, IteratorMode::Start) {
                let (k, _) = item.map_err(err("scan sizes"))?;
                if let Ok(name) = std::str::from_utf8(&k) {
                    names.push(name.to_string());
                }
                if names.len() == 1024 {
                    Self::remove_batch(&db, &names, sync)?;
                    n += Self::forget(&index, &mut names);
                }
            }
            Self::remove_batch(&db, &names, sync)?;
            n += Self::forget(&index, &mut names);
            Ok(n)
        })
        .await
    }

    fn take_removed(&self) -> Removed {
        self.index.lock().removed.take()
    }

    fn stats(&self) -> StoreStats {
        let g = self.index.lock();
        StoreStats {
            objects: g.entries.len() as u64,
            bytes: g.bytes,
            capacity: self.cfg.capacity_bytes.0,
            evictions: g.evictions,
            delete_failures: g.delete_failures,
            tenants: g.tenants(),
        }
    }
}
