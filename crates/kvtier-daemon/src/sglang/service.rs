//! SGLang's HiCache RPC storage protocol, part 2: the `sglang.runtime.hicache.StorageServer`
//! gRPC service.
//!
//! A put stores the concatenation of its iovecs (read from the registered pool) as one
//! object; a get scatters an object back over its iovecs. Objects live in two places:
//!
//! - **memory** ([`ObjectPages`]): the objects recently put or got on this node, as kvtierd's
//!   own L2 pages (a pool of `sglang_rpc.memory_bytes` per object size). Every SGLang
//!   instance registered here reads them, so a second instance that asks for ids another one
//!   stored is served from memory, and they survive a kvtierd crash as L2 does;
//! - **L3** (`sglang_rpc.l3 = "shared"`): kvtierd's own backend, each object framed and
//!   checksummed like a kvtier page and named in a namespace of its own (a fixed fingerprint
//!   and the SHA-256 of the id), so it never collides with kvtier's page keys. A put is
//!   written through before it is answered — SGLang's own write policy already decides when
//!   to back up, and it waits for the answer — with `l3.retries`, the breaker and
//!   `l3.timeout` as for kvtier's pages.
//!
//! Every iovec is checked against the mapping and against the file's current size (a client
//! may shrink its memfd) before a byte moves; a bad transfer gets an error code in its slot
//! and a log line, the others proceed. A stored object whose length differs from the
//! transfer's is `NOT_FOUND` (and stays stored); a corrupt or torn L3 object is `NOT_FOUND`
//! (and is deleted). A put of an id another transfer is reading from memory right now is
//! `UNAVAILABLE`, nothing written: the copy being read stays, and must not be answered for. A request with more transfers than `sglang_rpc.max_batch` is
//! `InvalidArgument` as a whole. Transfers of one batch run `sglang_rpc.concurrency` at a
//! time; results keep the request's order. A BatchGet runs each transfer on its own task, so
//! its copies into the engine's memory spread over the runtime's workers, and none runs once
//! the call is over (`batch`); a BatchPut runs in one task, applying its objects in order.

use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use kvtier_config::daemon::{SglangRpcConfig, SglangStore};
use kvtier_core::{LayoutFingerprint, PageKey, TenantScope};
use kvtier_proto::sglang;
use kvtier_storage::{Fill, Landed, MissReason, ObjectSink, OpCtx};
use sha2::{Digest, Sha256};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::SglangMetrics;
use super::batch::{self, CopyGate};
use super::objects::{Busy, ObjectPages};
use super::{EnginePool, Pools};
use crate::l3::L3Slot;

/// How often, and how long apart, a put waits for a copy of its id that someone is reading
/// from memory (one copy: microseconds to milliseconds).
const BUSY_TRIES: u32 = 20;
const BUSY_WAIT: std::time::Duration = std::time::Duration::from_millis(2);

/// Longest id accepted (SGLang's are ~70 bytes).
pub const MAX_ID: usize = 1024;
/// Most iovecs in one transfer.
pub const MAX_IOVECS: usize = 65536;

/// The namespace of SGLang's objects in L3: never a layout fingerprint kvtier computes.
fn namespace() -> LayoutFingerprint {
    let d = Sha256::digest(b"kvtier: SGLang HiCache RPC objects, v1");
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&d[..16]);
    LayoutFingerprint(fp)
}

/// The key of object `id`: SHA-256 of the id, mapped into the connection's tenant scope
/// while tenancy is on (so equal ids of two tenants are two objects, in memory and in L3).
fn object_key(scope: Option<&TenantScope>, id: &[u8]) -> PageKey {
    let k = PageKey(Sha256::digest(id).into());
    scope.map_or(k, |s| s.apply(&k))
}

/// Who the relay says sent a request.
#[derive(Debug, Clone)]
struct Caller {
    /// The tenant scope of its connection (`authority::TENANT_HEADER`; absent while tenancy
    /// is off).
    scope: Option<TenantScope>,
    /// That tenant's name (`""`: the default tenant, and every caller while tenancy is off).
    tenant: String,
    /// Its peer uid (`authority::UID_HEADER`); `None` names no pool.
    uid: Option<u32>,
}

fn request_caller<T>(request: &Request<T>) -> Caller {
    let m = request.metadata();
    let tenant = m
        .get(super::authority::TENANT_HEADER)
        .map(|t| t.to_str().unwrap_or_default().to_string());
    Caller {
        scope: tenant.as_deref().map(TenantScope::new),
        tenant: tenant.unwrap_or_default(),
        uid: m
            .get(super::authority::UID_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok()),
    }
}

/// Transfers naming no pool of their caller's: logged at most every 10 s, whatever their
/// rate (a prober would otherwise write a line per guess).
static NO_POOL_LOG: kvtier_server::conn::Throttle =
    kvtier_server::conn::Throttle::new(kvtier_server::conn::LOG_EVERY);

/// gRPC status codes SGLang reads in result slots.
mod code {
    pub(super) const OK: i32 = 0;
    pub(super) const INVALID_ARGUMENT: i32 = 3;
    pub(super) const NOT_FOUND: i32 = 5;
    pub(super) const FAILED_PRECONDITION: i32 = 9;
    pub(super) const OUT_OF_RANGE: i32 = 11;
    pub(super) const UNAVAILABLE: i32 = 14;
}

fn outcome(code: i32) -> &'static str {
    match code {
        code::OK => "ok",
        code::NOT_FOUND => "not_found",
        code::OUT_OF_RANGE => "out_of_range",
        code::FAILED_PRECONDITION => "no_pool",
        code::INVALID_ARGUMENT => "invalid",
        code::UNAVAILABLE => "unavailable",
        _ => "internal",
    }
}

/// An L3 read's destination: a buffer of the length the transfer asked for.
struct BufferSink {
    buf: Mutex<Vec<u8>>,
    /// The object turned out longer than asked.
    overflow: AtomicBool,
}

impl ObjectSink for BufferSink {
    fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), String> {
        self.fill(offset, bytes.len(), &mut |dst| {
            dst.copy_from_slice(bytes);
            Ok(())
        })
    }

    /// The file backend reads straight into the buffer.
    fn fill_at(&self, offset: u64, len: usize, fill: Fill<'_>) -> Option<Result<(), String>> {
        Some(self.fill(offset, len, fill))
    }
}

impl BufferSink {
    fn fill(&self, offset: u64, len: usize, fill: Fill<'_>) -> Result<(), String> {
        let mut b = self.buf.lock();
        let start = usize::try_from(offset).map_err(|e| e.to_string())?;
        match start.checked_add(len) {
            Some(end) if end <= b.len() => fill(&mut b[start..end]),
            _ => {
                self.overflow.store(true, Ordering::Relaxed);
                Err("the object is longer than the transfer asked for".into())
            }
        }
    }
}

/// A transfer's pool, its checked `(offset, length)` ranges, and their total length.
type Ranges = (Arc<EnginePool>, Vec<(usize, usize)>, usize);

/// The `sglang.runtime.hicache.StorageServer` service.
#[derive(Debug, Clone)]
pub struct StorageService {
    inner: Arc<Objects>,
}

/// What the service serves from.
#[derive(Debug)]
struct Objects {
    pools: Arc<Pools>,
    l3: Option<Arc<L3Slot>>,
    memory: Arc<ObjectPages>,
    /// Longest object (`l2.max_page_bytes`: it must fit one L2 slot).
    max_object: usize,
    concurrency: usize,
    max_batch: usize,
    metrics: SglangMetrics,
    stop: CancellationToken,
}

impl StorageService {
    /// Serves objects by offset into `pools`, from `memory` and (with `sglang_rpc.l3 =
    /// "shared"`) kvtierd's `l3`.
    pub fn new(
        cfg: &SglangRpcConfig,
        pools: Arc<Pools>,
        l3: Arc<L3Slot>,
        memory: Arc<ObjectPages>,
        max_object: u64,
        metrics: SglangMetrics,
        stop: CancellationToken,
    ) -> Self {
        Self {
            inner: Arc::new(Objects {
                pools,
                l3: (cfg.l3 == SglangStore::Shared).then_some(l3),
                memory,
                max_object: usize::try_from(max_object).unwrap_or(usize::MAX),
                concurrency: cfg.concurrency.max(1) as usize,
                max_batch: cfg.max_batch as usize,
                metrics,
                stop,
            }),
        }
    }
}

impl Objects {
    fn count(&self, op: &str, code: i32, bytes: u64) {
        self.metrics
            .transfers
            .with_label_values(&[op, outcome(code)])
            .inc();
        if code == code::OK && bytes > 0 {
            self.metrics.bytes.with_label_values(&[op]).inc_by(bytes);
        }
    }

    fn served(&self, op: &str, tier: &str) {
        self.metrics.hits.with_label_values(&[op, tier]).inc();
    }

    fn check_batch(&self, what: &str, n: usize) -> Result<(), Status> {
        if n > self.max_batch {
            tracing::warn!(
                n,
                max = self.max_batch,
                "sglang {what} refused: too many in one request"
            );
            return Err(Status::invalid_argument(format!(
                "{n} entries in one {what}; sglang_rpc.max_batch is {}",
                self.max_batch
            )));
        }
        Ok(())
    }

    fn bytes_of(t: &sglang::Transfer) -> u64 {
        t.iovec.iter().map(|v| u64::from(v.length)).sum()
    }

    /// The pool and the checked byte ranges of a transfer from a peer with `uid`, or the
    /// code for its slot.
    fn ranges(&self, t: &sglang::Transfer, uid: Option<u32>) -> Result<Ranges, i32> {
        if t.id.is_empty() || t.id.len() > MAX_ID {
            tracing::warn!(
                len = t.id.len(),
                "sglang transfer refused: an id must have 1 to {MAX_ID} bytes"
            );
            return Err(code::INVALID_ARGUMENT);
        }
        if t.iovec.is_empty() || t.iovec.len() > MAX_IOVECS {
            tracing::warn!(
                iovecs = t.iovec.len(),
                "sglang transfer refused: it needs 1 to {MAX_IOVECS} iovecs"
            );
            return Err(code::INVALID_ARGUMENT);
        }
        // Another uid's pool answers exactly as an unknown id does, before anything about it
        // (its size, its state) can show.
        let pool = u32::try_from(t.pool_id)
            .ok()
            .and_then(|id| self.pools.get(id))
            .filter(|p| uid.is_some_and(|u| p.owned_by(u)))
            .ok_or_else(|| {
                if let Some(more) = NO_POOL_LOG.allow() {
                    tracing::warn!(
                        pool = t.pool_id,
                        uid,
                        suppressed = more,
                        "sglang transfer names no pool its caller registered"
                    );
                }
                code::FAILED_PRECONDITION
            })?;
        if pool.is_damaged() {
            tracing::warn!(
                pool = t.pool_id,
                "sglang transfer refused: the client shrank this pool under a copy; it must register again"
            );
            return Err(code::FAILED_PRECONDITION);
        }
        // The client may have shrunk its memfd since it registered: never touch past the
        // end of the file, whatever the mapping's length.
        let limit = pool.current_len().min(pool.len() as u64);
        let mut ranges = Vec::with_capacity(t.iovec.len());
        let mut total = 0usize;
        for v in &t.iovec {
            let end = v.offset.checked_add(u64::from(v.length));
            if end.is_none_or(|e| e > limit) {
                tracing::warn!(
                    pool = t.pool_id,
                    offset = v.offset,
                    length = v.length,
                    limit,
                    "sglang iovec outside the registered pool"
                );
                return Err(code::OUT_OF_RANGE);
            }
            ranges.push((v.offset as usize, v.length as usize));
            total += v.length as usize;
        }
        // An object is a page of SGLang's: it fits in one L2 slot. Larger is refused before
        // a buffer of its size is taken (a client naming 65,536 iovecs of 4 GiB would ask for
        // 256 TiB).
        if total > self.max_object {
            tracing::warn!(
                pool = t.pool_id,
                total,
                max = self.max_object,
                "sglang transfer refused: longer than l2.max_page_bytes"
            );
            return Err(code::INVALID_ARGUMENT);
        }
        Ok((pool, ranges, total))
    }

    /// Copies `data` over the transfer's ranges of the engine's pool (already checked), while
    /// the batch's call lasts (`UNAVAILABLE`, nothing written, once it is over).
    fn scatter(gate: &CopyGate, pool: &EnginePool, ranges: &[(usize, usize)], data: &[u8]) -> i32 {
        gate.copy(|| {
            let mut at = 0;
            for &(off, len) in ranges {
                if let Err(e) = pool.write(off, &data[at..at + len]) {
                    tracing::warn!("sglang get: copy into the pool failed: {e}");
                    return code::OUT_OF_RANGE;
                }
                at += len;
            }
            code::OK
        })
        .unwrap_or(code::UNAVAILABLE)
    }

    async fn put_one(&self, caller: &Caller, t: &sglang::Transfer) -> i32 {
        let scope = caller.scope.as_ref();
        let (pool, ranges, total) = match self.ranges(t, caller.uid) {
            Ok(r) => r,
            Err(c) => return c,
        };
        let key = object_key(scope, &t.id);
        // Every byte of the buffer is overwritten: the ranges add up to `total`.
        let mut buf = self.memory.take_buffer(total);
        let mut at = 0;
        for (off, len) in ranges {
            if pool.read(off, &mut buf[at..at + len]).is_err() {
                self.memory.recycle_vec(buf);
                return code::OUT_OF_RANGE;
            }
            at += len;
        }
        let data = Bytes::from(buf);
        let (code, in_l3) = match self.l3.as_ref().map(|s| s.current()) {
            // Memory is the only copy (`sglang_rpc.l3 = "none"`).
            None => (code::OK, false),
            Some(None) => (code::UNAVAILABLE, false),
            Some(Some(l3)) => match l3
                .store
                .set(
                    &kvtier_storage::OpCtx::child(&self.stop, l3.timeout),
                    &namespace(),
                    &key,
                    data.clone(),
                )
                .await
            {
                Ok(()) => (code::OK, true),
                Err(e) => {
                    tracing::warn!(
                        id = %String::from_utf8_lossy(&t.id),
                        "sglang put: the L3 write failed: {e}"
                    );
                    (code::UNAVAILABLE, false)
                }
            },
        };
        // Then memory, with no wait between its reservation and its commit: a later put of
        // the id (in this batch, or another instance's) finds this copy landed and replaces
        // it. A copy someone is reading right now is waited for a moment (a read is one
        // copy), and stays if it is still read: then this put is not answered for.
        let mut kept = Err(Busy);
        for _ in 0..BUSY_TRIES {
            kept = self.memory.reserve(&caller.tenant, key, total);
            if kept.is_ok() {
                break;
            }
            tokio::time::sleep(BUSY_WAIT).await;
        }
        let code = match kept {
            Ok(Some(slot)) => {
                if slot.commit(&data, in_l3) {
                    code
                } else if self.l3.is_none() {
                    code::UNAVAILABLE
                } else {
                    code
                }
            }
            // Not kept (and no copy left): only L3 answers for it.
            Ok(None) if self.l3.is_none() => code::UNAVAILABLE,
            Ok(None) => code,
            Err(Busy) => {
                tracing::warn!(
                    id = %String::from_utf8_lossy(&t.id),
                    "sglang put: the object is being read from memory; this put is not answered for"
                );
                code::UNAVAILABLE
            }
        };
        self.memory.recycle(data);
        self.memory.report();
        code
    }

    async fn get_one(&self, caller: &Caller, t: &sglang::Transfer, gate: &CopyGate) -> i32 {
        let scope = caller.scope.as_ref();
        let (pool, ranges, total) = match self.ranges(t, caller.uid) {
            Ok(r) => r,
            Err(c) => return c,
        };
        let key = object_key(scope, &t.id);
        let wrong_length = |len: usize| {
            tracing::warn!(
                id = %String::from_utf8_lossy(&t.id),
                stored = len,
                asked = total,
                "sglang get: the stored object has another length; not served"
            );
            code::NOT_FOUND
        };
        let mut buf = self.memory.take_buffer(total);
        if self.memory.get(&caller.tenant, key, &mut buf) {
            self.served("get", "memory");
            let c = Self::scatter(gate, &pool, &ranges, &buf);
            self.memory.recycle_vec(buf);
            return c;
        }
        let Some(l3) = self.l3.as_ref().and_then(|s| s.current()) else {
            self.memory.recycle_vec(buf);
            return code::NOT_FOUND;
        };
        let ctx = OpCtx::child(&self.stop, l3.timeout);
        // Read (checksummed on the way) into a buffer of the asked length; no expected length
        // is given to the store, so a request of the wrong length cannot make it treat a good
        // object as corrupt (and delete it).
        let sink = Arc::new(BufferSink {
            buf: Mutex::new(buf),
            overflow: AtomicBool::new(false),
        });
        let landed = l3
            .store
            .get_into(&ctx, &namespace(), &key, None, sink.clone())
            .await;
        // The backend is done with the sink (or its late writes find an empty buffer).
        let buf = std::mem::take(&mut *sink.buf.lock());
        let c = match landed {
            Landed::Hit(v) if v.len as usize == total && !sink.overflow.load(Ordering::Relaxed) => {
                let c = Self::scatter(gate, &pool, &ranges, &buf);
                if c == code::OK {
                    self.served("get", "l3");
                    // Kept in memory for the next reader, unless memory has a copy now (a
                    // put may have stored newer bytes since this read began).
                    if let Some(slot) = self.memory.reserve_if_absent(&caller.tenant, key, total) {
                        slot.commit(&buf, true);
                        self.memory.report();
                    }
                }
                c
            }
            Landed::Hit(v) => wrong_length(v.len as usize),
            Landed::Miss(_) if sink.overflow.load(Ordering::Relaxed) => wrong_length(total + 1),
            // Absent, corrupt or torn: not found, bytes untouched.
            Landed::Miss(MissReason::Absent | MissReason::Corrupt(_)) => code::NOT_FOUND,
            Landed::Miss(why) => {
                tracing::debug!("sglang get: L3 read failed: {}", why.label());
                code::UNAVAILABLE
            }
        };
        self.memory.recycle_vec(buf);
        c
    }

    async fn exists_one(&self, caller: &Caller, id: &[u8]) -> bool {
        if id.is_empty() || id.len() > MAX_ID {
            return false;
        }
        let key = object_key(caller.scope.as_ref(), id);
        if self.memory.contains(&caller.tenant, key) {
            self.served("exist", "memory");
            return true;
        }
        let Some(l3) = self.l3.as_ref().and_then(|s| s.current()) else {
            return false;
        };
        let ctx = OpCtx::child(&self.stop, l3.timeout);
        let found = l3
            .store
            .exists(&ctx, &namespace(), &key)
            .await
            .unwrap_or(false);
        if found {
            self.served("exist", "l3");
        }
        found
    }

    fn timed(&self, op: &str, started: Instant) {
        self.metrics
            .seconds
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
    }
}

#[tonic::async_trait]
impl sglang::storage_server_server::StorageServer for StorageService {
    async fn exist(
        &self,
        request: Request<sglang::ExistRequest>,
    ) -> Result<Response<sglang::ExistResponse>, Status> {
        let started = Instant::now();
        let caller = request_caller(&request);
        let ids = request.into_inner().id;
        let this = &self.inner;
        this.check_batch("Exist", ids.len())?;
        let results: Vec<bool> = futures::stream::iter(ids)
            .map(|id| {
                let (this, caller) = (this.clone(), caller.clone());
                async move { this.exists_one(&caller, &id).await }
            })
            .buffered(this.concurrency)
            .collect()
            .await;
        for &found in &results {
            this.count("exist", if found { code::OK } else { code::NOT_FOUND }, 0);
        }
        this.timed("exist", started);
        Ok(Response::new(sglang::ExistResponse { results }))
    }

    async fn batch_put(
        &self,
        request: Request<sglang::BatchPutRequest>,
    ) -> Result<Response<sglang::BatchPutResponse>, Status> {
        let started = Instant::now();
        let caller = request_caller(&request);
        let puts = request.into_inner().puts;
        let this = &self.inner;
        this.check_batch("BatchPut", puts.len())?;
        // In one task, in the request's order: a later put of an id wins, and the bounded
        // memory keeps the batch's last objects.
        let results: Vec<i32> = futures::stream::iter(puts)
            .map(|t| {
                let (this, caller) = (this.clone(), caller.clone());
                async move {
                    let c = this.put_one(&caller, &t).await;
                    this.count("put", c, Objects::bytes_of(&t));
                    c
                }
            })
            .buffered(this.concurrency)
            .collect()
            .await;
        this.timed("put", started);
        Ok(Response::new(sglang::BatchPutResponse { results }))
    }

    async fn batch_get(
        &self,
        request: Request<sglang::BatchGetRequest>,
    ) -> Result<Response<sglang::BatchGetResponse>, Status> {
        let started = Instant::now();
        let caller = request_caller(&request);
        let gets = request.into_inner().gets;
        let this = &self.inner;
        this.check_batch("BatchGet", gets.len())?;
        let results = batch::run(gets, this.concurrency, code::UNAVAILABLE, |t, gate| {
            let (this, caller) = (this.clone(), caller.clone());
            async move {
                let c = this.get_one(&caller, &t, &gate).await;
                this.count("get", c, Objects::bytes_of(&t));
                c
            }
        })
        .await;
        this.timed("get", started);
        Ok(Response::new(sglang::BatchGetResponse { results }))
    }
}
