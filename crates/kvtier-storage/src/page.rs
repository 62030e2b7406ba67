//! Pages over a [`Store`]: framing on write, verification on read, and results that say why.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kvtier_core::{LayoutFingerprint, PageKey};

use crate::format::{HEADER_LEN, header, object_name, verify_head};
use crate::{Fill, ObjectSink, OpCtx, SinkReadError, StorageError, Store, StoreStats};
use kvtier_core::checksum::crc32c_append;

/// Why a page was not served.
#[derive(Debug)]
pub enum MissReason {
    /// The backend does not have it.
    Absent,
    /// It was there but is not the expected page (torn, corrupted, other layout or key); it
    /// has been deleted.
    Corrupt(String),
    /// The call did not finish in time.
    Timeout,
    /// The caller cancelled.
    Cancelled,
    /// The backend refused to try (its breaker is open).
    Throttled,
    /// The backend failed.
    Failed(StorageError),
}

impl MissReason {
    /// A short, bounded label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            MissReason::Absent => "absent",
            MissReason::Corrupt(_) => "corrupt",
            MissReason::Timeout => "timeout",
            MissReason::Cancelled => "cancelled",
            MissReason::Throttled => "throttled",
            MissReason::Failed(_) => "failed",
        }
    }
}

/// The outcome of a page read.
#[derive(Debug)]
pub enum Fetch {
    /// The page's bytes, verified.
    Hit(Bytes),
    /// No page, and why.
    Miss(MissReason),
}

impl Fetch {
    /// The bytes of a hit.
    pub fn hit(self) -> Option<Bytes> {
        match self {
            Fetch::Hit(b) => Some(b),
            Fetch::Miss(_) => None,
        }
    }
}

impl From<StorageError> for MissReason {
    fn from(e: StorageError) -> Self {
        match e {
            StorageError::Timeout(_) => MissReason::Timeout,
            StorageError::Cancelled => MissReason::Cancelled,
            StorageError::Unavailable(_) => MissReason::Throttled,
            other => MissReason::Failed(other),
        }
    }
}

/// A page [`PageStore::get_into`] put in its sink and verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verified {
    /// Its payload bytes.
    pub len: u64,
    /// Their CRC32C, as computed while they passed into the sink (equal to the header's).
    /// Whoever keeps the bytes where they landed can record it instead of reading them again.
    pub crc32c: u32,
}

/// The outcome of [`PageStore::get_into`].
#[derive(Debug)]
pub enum Landed {
    /// The page's bytes are in the sink and verified.
    Hit(Verified),
    /// The sink holds nothing usable, and why.
    Miss(MissReason),
}

/// Passes chunks on to the caller's sink and checksums them on the way, so the payload is
/// verified without being read twice.
struct Checksummed {
    inner: Arc<dyn ObjectSink>,
    /// (running CRC32C, next expected offset)
    crc: parking_lot::Mutex<(u32, u64)>,
    /// The page's length, when the caller knows it: bytes past it are refused, and the object
    /// is then a bad one (not the page), whatever else may also refuse bytes.
    limit: Option<u64>,
    /// Whether the object ran past `limit`.
    overrun: std::sync::atomic::AtomicBool,
}

impl Checksummed {
    /// Refuses `len` bytes at `offset` that would run past the page.
    fn room(&self, offset: u64, len: u64) -> Result<(), String> {
        match self.limit {
            Some(limit) if offset.saturating_add(len) > limit => {
                self.overrun.store(true, Ordering::Relaxed);
                Err(format!(
                    "the object is longer than the {limit}-byte page ({} bytes at least)",
                    offset.saturating_add(len)
                ))
            }
            _ => Ok(()),
        }
    }
}

fn in_order(at: &(u32, u64), offset: u64) -> Result<(), String> {
    if offset == at.1 {
        Ok(())
    } else {
        Err(format!("chunk at {offset}, expected {}", at.1))
    }
}

impl ObjectSink for Checksummed {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.room(offset, bytes.len() as u64)?;
        {
            let mut g = self.crc.lock();
            in_order(&g, offset)?;
            g.0 = crc32c_append(g.0, bytes);
            g.1 += bytes.len() as u64;
        }
        self.inner.write_at(offset, bytes)
    }

    fn take(&self, rest: Bytes) -> Result<(), String> {
        self.room(0, rest.len() as u64)?;
        {
            let mut g = self.crc.lock();
            in_order(&g, 0)?;
            g.0 = crc32c_append(g.0, &rest);
            g.1 += rest.len() as u64;
        }
        self.inner.take(rest)
    }

    /// Checksums what the sink read as it hands it over.
    fn append_from(
        &self,
        offset: u64,
        len: u64,
        src: &mut dyn std::io::Read,
        seen: &mut dyn FnMut(&[u8]),
    ) -> Option<Result<u64, SinkReadError>> {
        if let Err(e) = self.room(offset, len) {
            return Some(Err(SinkReadError::Sink(e)));
        }
        let mut g = self.crc.lock();
        if let Err(e) = in_order(&g, offset) {
            return Some(Err(SinkReadError::Sink(e)));
        }
        let mut crc = g.0;
        let r = self.inner.append_from(offset, len, src, &mut |b| {
            crc = crc32c_append(crc, b);
            seen(b);
        })?;
        if let Ok(n) = r {
            *g = (crc, g.1 + n);
        }
        Some(r)
    }

    /// Checksums each piece right after the backend filled it, while it is still in cache.
    fn fill_at(&self, offset: u64, len: usize, fill: Fill<'_>) -> Option<Result<(), String>> {
        if let Err(e) = self.room(offset, len as u64) {
            return Some(Err(e));
        }
        let mut g = self.crc.lock();
        if let Err(e) = in_order(&g, offset) {
            return Some(Err(e));
        }
        let mut crc = g.0;
        let r = self.inner.fill_at(offset, len, &mut |dst| {
            fill(dst)?;
            crc = crc32c_append(crc, dst);
            Ok(())
        })?;
        if r.is_ok() {
            *g = (crc, g.1 + len as u64);
        }
        Some(r)
    }
}

/// The destination of [`PageStore::get`]: the payload in memory of its own, reserved up front
/// when the length is known, and filled without zeroing it first where the backend reads a
/// file ([`ObjectSink::append_from`]).
struct HeapSink(parking_lot::Mutex<HeapBuf>);

enum HeapBuf {
    /// Filled in place or appended to: all of it is payload; its capacity is the length asked.
    Owned(Vec<u8>),
    /// Handed over whole by a backend that had it in memory.
    Taken(Bytes),
}

impl HeapSink {
    fn new(expected_len: Option<usize>) -> Self {
        Self(parking_lot::Mutex::new(HeapBuf::Owned(Vec::with_capacity(
            expected_len.unwrap_or(0),
        ))))
    }

    /// The payload received so far (the whole of it after a hit); leaves the sink empty, so a
    /// late write from a read that outlived its caller lands nowhere that matters.
    fn take_bytes(&self) -> Bytes {
        match std::mem::replace(&mut *self.0.lock(), HeapBuf::Owned(Vec::new())) {
            HeapBuf::Owned(buf) => Bytes::from(buf),
            HeapBuf::Taken(b) => b,
        }
    }

    /// Fills the next `len` bytes, growing the buffer (zeroed pieces, on the reading thread).
    fn put(&self, offset: u64, len: usize, fill: Fill<'_>) -> Result<(), String> {
        let mut g = self.0.lock();
        let HeapBuf::Owned(buf) = &mut *g else {
            return Err("bytes arrived after a whole object".into());
        };
        let start = buf.len();
        if offset != start as u64 {
            return Err(format!("chunk at {offset}, expected {start}"));
        }
        buf.resize(start + len, 0);
        let r = fill(&mut buf[start..]);
        if r.is_err() {
            buf.truncate(start);
        }
        r
    }
}

impl ObjectSink for HeapSink {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.put(offset, bytes.len(), &mut |dst| {
            dst.copy_from_slice(bytes);
            Ok(())
        })
    }

    fn take(&self, rest: Bytes) -> Result<(), String> {
        let mut g = self.0.lock();
        match &*g {
            HeapBuf::Owned(buf) if buf.is_empty() => {
                *g = HeapBuf::Taken(rest);
                Ok(())
            }
            _ => Err("bytes handed over after others".into()),
        }
    }

    fn fill_at(&self, offset: u64, len: usize, fill: Fill<'_>) -> Option<Result<(), String>> {
        Some(self.put(offset, len, fill))
    }

    /// Reads the whole rest into the reserved capacity: one copy, no zeroing. Declines a rest
    /// longer than the length asked (a wrong object is then read piece by piece and refused
    /// by its header, as before), so a stray large file costs no large allocation.
    fn append_from(
        &self,
        offset: u64,
        len: u64,
        src: &mut dyn std::io::Read,
        seen: &mut dyn FnMut(&[u8]),
    ) -> Option<Result<u64, SinkReadError>> {
        let mut g = self.0.lock();
        let HeapBuf::Owned(buf) = &mut *g else {
            return Some(Err(SinkReadError::Sink(
                "bytes arrived after a whole object".into(),
            )));
        };
        if offset != 0 || !buf.is_empty() || len > buf.capacity() as u64 {
            return None;
        }
        // A file's own read_to_end sizes its read from the file's length: one read(2) into
        // the spare capacity, then one that finds the end.
        Some(match src.read_to_end(buf) {
            Ok(n) => {
                seen(buf);
                Ok(n as u64)
            }
            Err(e) => {
                buf.clear();
                Err(SinkReadError::Io(e))
            }
        })
    }
}

/// Counters of a [`PageStore`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageStoreStats {
    /// Verified hits.
    pub hits: u64,
    /// Reads that found nothing.
    pub absent: u64,
    /// Reads that found a bad object (deleted).
    pub corrupt: u64,
    /// Reads that failed, timed out or were refused.
    pub failed: u64,
    /// Pages written.
    pub sets: u64,
    /// Writes that failed.
    pub set_failures: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    absent: AtomicU64,
    corrupt: AtomicU64,
    failed: AtomicU64,
    sets: AtomicU64,
    set_failures: AtomicU64,
}

/// Pages of any layout over one backend.
#[derive(Clone)]
pub struct PageStore {
    store: Arc<dyn Store>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for PageStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageStore")
            .field("store", &self.store)
            .finish()
    }
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl PageStore {
    /// Pages over `store`.
    pub fn new(store: Arc<dyn Store>) -> Self {
        Self {
            store,
            counters: Arc::default(),
        }
    }

    /// The backend.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Reads and verifies page `key` of layout `fp`. Never returns unverified bytes: a bad
    /// object is deleted and reported as [`MissReason::Corrupt`].
    pub async fn get(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        key: &PageKey,
        expected_len: Option<usize>,
    ) -> Fetch {
        // One read-and-verify path for both: the file backend reads straight into the buffer
        // and checksums each piece while it is in cache; in-memory backends hand theirs over.
        let sink = Arc::new(HeapSink::new(expected_len));
        match self
            .get_into(ctx, fp, key, expected_len, sink.clone())
            .await
        {
            Landed::Hit(_) => Fetch::Hit(sink.take_bytes()),
            Landed::Miss(why) => Fetch::Miss(why),
        }
    }

    /// Reads page `key` of layout `fp` straight into `sink` (no page-sized buffer where the
    /// backend streams) and verifies it. On a miss the sink may hold partial or wrong bytes:
    /// the caller must not use them.
    pub async fn get_into(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        key: &PageKey,
        expected_len: Option<usize>,
        sink: Arc<dyn ObjectSink>,
    ) -> Landed {
        let name = object_name(fp, key);
        let c = &self.counters;
        let sum = Arc::new(Checksummed {
            inner: sink,
            crc: parking_lot::Mutex::new((0, 0)),
            limit: expected_len.map(|l| l as u64),
            overrun: std::sync::atomic::AtomicBool::new(false),
        });
        let r = ctx
            .run(self.store.read_into(&name, HEADER_LEN, sum.clone()))
            .await;
        let r = match r {
            // Longer than the page: a bad object, as below. (Other refusals, such as a
            // prefetch that stopped, say nothing of the object.)
            Err(e) if sum.overrun.load(Ordering::Relaxed) => {
                Ok(Some((Bytes::new(), 0, Err(e.to_string()))))
            }
            Ok(Some((head, len))) => Ok(Some((head, len, Ok(())))),
            Ok(None) => Ok(None),
            Err(e) => Err(e),
        };
        match r {
            Ok(Some((head, len, taken))) => {
                let (crc, seen) = *sum.crc.lock();
                let check = taken
                    .and_then(|()| verify_head(&head, fp, key, expected_len, len))
                    .and_then(|want| {
                        if seen != len {
                            Err(format!("{seen} of {len} payload bytes arrived"))
                        } else if crc != want {
                            Err("payload checksum mismatch".into())
                        } else {
                            Ok(())
                        }
                    });
                match check {
                    Ok(()) => {
                        bump(&c.hits);
                        Landed::Hit(Verified { len, crc32c: crc })
                    }
                    Err(why) => {
                        bump(&c.corrupt);
                        tracing::warn!(backend = self.store.kind(), object = %name, "deleting a bad object: {why}");
                        if let Err(e) = ctx.run(self.store.delete(&name)).await {
                            tracing::warn!(backend = self.store.kind(), object = %name, "could not delete a bad object: {e}");
                        }
                        Landed::Miss(MissReason::Corrupt(why))
                    }
                }
            }
            Ok(None) => {
                bump(&c.absent);
                Landed::Miss(MissReason::Absent)
            }
            Err(e) => {
                bump(&c.failed);
                Landed::Miss(e.into())
            }
        }
    }

    /// Writes page `key` of layout `fp`.
    pub async fn set(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        key: &PageKey,
        payload: Bytes,
    ) -> Result<(), StorageError> {
        let head = header(fp, key, &payload);
        let r = ctx
            .run(self.store.set(&object_name(fp, key), head, payload))
            .await;
        match &r {
            Ok(()) => bump(&self.counters.sets),
            Err(_) => bump(&self.counters.set_failures),
        }
        r
    }

    /// Whether the backend has page `key` (unverified: a later `get` may still miss).
    pub async fn exists(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        key: &PageKey,
    ) -> Result<bool, StorageError> {
        ctx.run(self.store.exists(&object_name(fp, key))).await
    }

    /// How many of `keys`, from the first, the backend has.
    pub async fn exists_prefix(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        keys: &[PageKey],
    ) -> Result<usize, StorageError> {
        let names: Vec<String> = keys.iter().map(|k| object_name(fp, k)).collect();
        ctx.run(self.store.exists_prefix(&names)).await
    }

    /// Deletes page `key`.
    pub async fn delete(
        &self,
        ctx: &OpCtx,
        fp: &LayoutFingerprint,
        key: &PageKey,
    ) -> Result<(), StorageError> {
        ctx.run(self.store.delete(&object_name(fp, key))).await
    }

    /// Read and write counters.
    pub fn stats(&self) -> PageStoreStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PageStoreStats {
            hits: l(&c.hits),
            absent: l(&c.absent),
            corrupt: l(&c.corrupt),
            failed: l(&c.failed),
            sets: l(&c.sets),
            set_failures: l(&c.set_failures),
        }
    }

    /// The backend's own statistics.
    pub fn store_stats(&self) -> StoreStats {
        self.store.stats()
    }
}
