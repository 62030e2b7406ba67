//! SGLang's HiCache RPC storage protocol, part 1: host-pool registration.
//!
//! Each SGLang scheduler process (one per TP rank) registers its host KV pool — a memfd — on
//! a Unix stream socket: one `sendmsg` carrying 8 bytes of magic (`0x8DF6FBFD`, u64
//! little-endian), a u32 little-endian name length, the UTF-8 name, and exactly one file
//! descriptor as `SCM_RIGHTS`. The server maps the memfd (its size from `fstat`) and answers
//! the pool id, u32 little-endian, from 1 upwards. The client keeps the connection open while
//! it uses the pool; when it closes, the pool is unmapped and its id stops resolving.
//!
//! Hostile input — a wrong magic, a short or oversized preamble, a name that is not UTF-8,
//! no descriptor or more than one, a file that cannot be mapped — closes that connection with
//! a log line naming the problem; nothing else is affected.
//!
//! The gRPC `StorageServer` ([`StorageService`]) then moves objects by offset into these
//! pools: a put stores the concatenation of its iovecs as one object of kvtier's L3 (framed
//! and checksummed like a page, named in a namespace of its own: a fixed fingerprint and the
//! SHA-256 of the id), a get scatters it back. Every iovec is checked against the mapping
//! and against the file's current size (a client may shrink its memfd) before a byte moves;
//! a bad transfer gets an error code in its slot, the others proceed.

use std::collections::HashMap;
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_proto::sglang;
use kvtier_shm::ShmRegion;
use kvtier_storage::{Fetch, MissReason, OpCtx};
use sha2::{Digest, Sha256};
use tonic::{Request, Response, Status};

use crate::l3::L3Slot;
use crate::metrics::Metrics;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::sync::CancellationToken;

/// The preamble's magic, as SGLang sends it.
pub const MAGIC: u64 = 0x8DF6_FBFD;
/// Longest pool name accepted.
pub const MAX_NAME: usize = 4096;

/// The registered pools by id.
#[derive(Debug, Default)]
pub struct Pools {
    next: AtomicU32,
    map: Mutex<HashMap<u32, Arc<ShmRegion>>>,
    gauge: Option<prometheus::IntGauge>,
}

impl Pools {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Arc<ShmRegion>>> {
        match self.map.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// The pool registered as `id`, while its client is connected.
    pub fn get(&self, id: u32) -> Option<Arc<ShmRegion>> {
        self.lock().get(&id).cloned()
    }

    /// Pools registered now.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Pools that report their count to `gauge`.
    pub fn with_gauge(gauge: prometheus::IntGauge) -> Self {
        Self {
            gauge: Some(gauge),
            ..Self::default()
        }
    }

    fn add(&self, region: ShmRegion) -> u32 {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        let mut m = self.lock();
        m.insert(id, Arc::new(region));
        if let Some(g) = &self.gauge {
            g.set(m.len() as i64);
        }
        id
    }

    fn remove(&self, id: u32) {
        let mut m = self.lock();
        m.remove(&id);
        if let Some(g) = &self.gauge {
            g.set(m.len() as i64);
        }
    }
}

/// A registration that went wrong, and why.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The socket failed.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The preamble is not SGLang's.
    #[error("bad preamble: {0}")]
    Preamble(String),
    /// The descriptor could not be used.
    #[error("pool: {0}")]
    Pool(String),
}

/// Reads one registration message: the preamble bytes and every descriptor that came with
/// them (until the preamble is complete or the peer stops sending).
async fn read_preamble(stream: &UnixStream) -> Result<(String, Vec<OwnedFd>), RegisterError> {
    let mut bytes: Vec<u8> = Vec::new();
    let mut fds: Vec<OwnedFd> = Vec::new();
    loop {
        let need = if bytes.len() >= 12 {
            let n = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
            if n > MAX_NAME {
                return Err(RegisterError::Preamble(format!(
                    "a pool name of {n} bytes (at most {MAX_NAME})"
                )));
            }
            12 + n
        } else {
            12
        };
        if bytes.len() >= 8 {
            let magic = u64::from_le_bytes(bytes[..8].try_into().unwrap_or([0; 8]));
            if magic != MAGIC {
                return Err(RegisterError::Preamble(format!(
                    "magic {magic:#x}, expected {MAGIC:#x}"
                )));
            }
        }
        if bytes.len() >= 12 && bytes.len() >= need {
            if bytes.len() > need {
                return Err(RegisterError::Preamble(format!(
                    "{} bytes after the pool name",
                    bytes.len() - need
                )));
            }
            let name = String::from_utf8(bytes[12..need].to_vec())
                .map_err(|_| RegisterError::Preamble("the pool name is not UTF-8".into()))?;
            return Ok((name, fds));
        }
        let mut buf = vec![0u8; need - bytes.len()];
        let got = stream
            .async_io(Interest::READABLE, || {
                let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
                let mut anc = rustix::net::RecvAncillaryBuffer::new(&mut space);
                let r = rustix::net::recvmsg(
                    stream,
                    &mut [std::io::IoSliceMut::new(&mut buf)],
                    &mut anc,
                    rustix::net::RecvFlags::CMSG_CLOEXEC,
                )
                .map_err(std::io::Error::from)?;
                let mut got_fds = Vec::new();
                for msg in anc.drain() {
                    if let rustix::net::RecvAncillaryMessage::ScmRights(rights) = msg {
                        got_fds.extend(rights);
                    }
                }
                Ok((r.bytes, got_fds))
            })
            .await?;
        let (n, more) = got;
        fds.extend(more);
        if n == 0 {
            return Err(RegisterError::Preamble(format!(
                "the client closed after {} of {need} bytes",
                bytes.len()
            )));
        }
        bytes.extend_from_slice(&buf[..n]);
    }
}

/// Serves one registration connection: register, answer the id, hold the pool until the
/// client hangs up.
async fn serve_one(mut stream: UnixStream, pools: Arc<Pools>) -> Result<(), RegisterError> {
    let (name, mut fds) = read_preamble(&stream).await?;
    if fds.len() != 1 {
        return Err(RegisterError::Preamble(format!(
            "{} file descriptors with pool {name:?}, expected exactly one",
            fds.len()
        )));
    }
    let fd = fds.remove(0);
    let region = ShmRegion::from_fd(fd, &name).map_err(|e| RegisterError::Pool(e.to_string()))?;
    let bytes = region.len();
    let id = pools.add(region);
    tracing::info!(pool = id, name = %name, bytes, "sglang host pool registered");
    let answered = stream.write_all(&id.to_le_bytes()).await;
    // Held until the client hangs up (anything it sends is ignored).
    let mut sink = [0u8; 64];
    if answered.is_ok() {
        while let Ok(n) = stream.read(&mut sink).await {
            if n == 0 {
                break;
            }
        }
    }
    pools.remove(id);
    tracing::info!(pool = id, name = %name, "sglang host pool unregistered");
    Ok(())
}

/// The namespace of SGLang's objects in L3: never a layout fingerprint kvtier computes.
fn namespace() -> LayoutFingerprint {
    let d = Sha256::digest(b"kvtier: SGLang HiCache RPC objects, v1");
    let mut fp = [0u8; 16];
    fp.copy_from_slice(&d[..16]);
    LayoutFingerprint(fp)
}

fn object_key(id: &[u8]) -> PageKey {
    PageKey(Sha256::digest(id).into())
}

/// gRPC status codes SGLang reads in result slots.
mod code {
    pub(super) const OK: i32 = 0;
    pub(super) const INVALID_ARGUMENT: i32 = 3;
    pub(super) const NOT_FOUND: i32 = 5;
    pub(super) const FAILED_PRECONDITION: i32 = 9;
    pub(super) const OUT_OF_RANGE: i32 = 11;
    pub(super) const INTERNAL: i32 = 13;
    pub(super) const UNAVAILABLE: i32 = 14;
}

/// A transfer's pool, its checked `(offset, length)` ranges, and their total length.
type Ranges = (Arc<ShmRegion>, Vec<(usize, usize)>, usize);

/// The `sglang.runtime.hicache.StorageServer` service.
#[derive(Debug, Clone)]
pub struct StorageService {
    pools: Arc<Pools>,
    l3: Arc<L3Slot>,
    metrics: Metrics,
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

impl StorageService {
    /// Serves objects of `l3` by offset into `pools`.
    pub fn new(pools: Arc<Pools>, l3: Arc<L3Slot>, metrics: Metrics) -> Self {
        Self { pools, l3, metrics }
    }

    fn count(&self, op: &str, code: i32, bytes: u64) {
        self.metrics
            .sglang_transfers
            .with_label_values(&[op, outcome(code)])
            .inc();
        if code == code::OK && bytes > 0 {
            self.metrics
                .sglang_bytes
                .with_label_values(&[op])
                .inc_by(bytes);
        }
    }

    fn bytes_of(t: &sglang::Transfer) -> u64 {
        t.iovec.iter().map(|v| u64::from(v.length)).sum()
    }

    /// The pool and the checked byte ranges of a transfer, or the code for its slot.
    fn ranges(&self, t: &sglang::Transfer) -> Result<Ranges, i32> {
        if t.id.is_empty() {
            tracing::warn!("sglang transfer with an empty id refused");
            return Err(code::INVALID_ARGUMENT);
        }
        let pool = u32::try_from(t.pool_id)
            .ok()
            .and_then(|id| self.pools.get(id))
            .ok_or_else(|| {
                tracing::warn!(pool = t.pool_id, "sglang transfer names no registered pool");
                code::FAILED_PRECONDITION
            })?;
        // The client may have shrunk its memfd since it registered: never touch past the
        // end of the file, whatever the mapping's length.
        let limit = pool
            .current_file_len()
            .map_or(0, |l| l.min(pool.len() as u64));
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
        Ok((pool, ranges, total))
    }

    async fn put_one(&self, t: &sglang::Transfer) -> i32 {
        let (pool, ranges, total) = match self.ranges(t) {
            Ok(r) => r,
            Err(c) => return c,
        };
        let Some(l3) = self.l3.current() else {
            return code::UNAVAILABLE;
        };
        let mut buf = vec![0u8; total];
        let mut at = 0;
        for (off, len) in ranges {
            if pool.read(off, &mut buf[at..at + len]).is_err() {
                return code::OUT_OF_RANGE;
            }
            at += len;
        }
        let ctx = OpCtx::timeout(l3.timeout);
        match l3
            .store
            .set(
                &ctx,
                &namespace(),
                &object_key(&t.id),
                bytes::Bytes::from(buf),
            )
            .await
        {
            Ok(()) => code::OK,
            Err(e) => {
                tracing::debug!("sglang put failed: {e}");
                code::UNAVAILABLE
            }
        }
    }

    async fn get_one(&self, t: &sglang::Transfer) -> i32 {
        let (pool, ranges, total) = match self.ranges(t) {
            Ok(r) => r,
            Err(c) => return c,
        };
        let Some(l3) = self.l3.current() else {
            return code::UNAVAILABLE;
        };
        let ctx = OpCtx::timeout(l3.timeout);
        match l3
            .store
            .get(&ctx, &namespace(), &object_key(&t.id), Some(total))
            .await
        {
            Fetch::Hit(bytes) => {
                let mut at = 0;
                for (off, len) in ranges {
                    if pool.write(off, &bytes[at..at + len]).is_err() {
                        return code::INTERNAL;
                    }
                    at += len;
                }
                code::OK
            }
            // Absent, corrupt, torn, or of another length than asked: not found, bytes
            // untouched.
            Fetch::Miss(MissReason::Absent | MissReason::Corrupt(_)) => code::NOT_FOUND,
            Fetch::Miss(_) => code::UNAVAILABLE,
        }
    }
}

#[tonic::async_trait]
impl sglang::storage_server_server::StorageServer for StorageService {
    async fn exist(
        &self,
        request: Request<sglang::ExistRequest>,
    ) -> Result<Response<sglang::ExistResponse>, Status> {
        let started = std::time::Instant::now();
        let ids = request.into_inner().id;
        let mut results = Vec::with_capacity(ids.len());
        let l3 = self.l3.current();
        for id in &ids {
            let found = match &l3 {
                Some(l3) if !id.is_empty() => {
                    let ctx = OpCtx::timeout(l3.timeout);
                    l3.store
                        .exists(&ctx, &namespace(), &object_key(id))
                        .await
                        .unwrap_or(false)
                }
                _ => false,
            };
            self.count("exist", if found { code::OK } else { code::NOT_FOUND }, 0);
            results.push(found);
        }
        self.metrics
            .sglang_seconds
            .with_label_values(&["exist"])
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(sglang::ExistResponse { results }))
    }

    async fn batch_put(
        &self,
        request: Request<sglang::BatchPutRequest>,
    ) -> Result<Response<sglang::BatchPutResponse>, Status> {
        let started = std::time::Instant::now();
        let puts = request.into_inner().puts;
        let mut results = Vec::with_capacity(puts.len());
        for t in &puts {
            let c = self.put_one(t).await;
            self.count("put", c, Self::bytes_of(t));
            results.push(c);
        }
        self.metrics
            .sglang_seconds
            .with_label_values(&["put"])
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(sglang::BatchPutResponse { results }))
    }

    async fn batch_get(
        &self,
        request: Request<sglang::BatchGetRequest>,
    ) -> Result<Response<sglang::BatchGetResponse>, Status> {
        let started = std::time::Instant::now();
        let gets = request.into_inner().gets;
        let mut results = Vec::with_capacity(gets.len());
        for t in &gets {
            let c = self.get_one(t).await;
            self.count("get", c, Self::bytes_of(t));
            results.push(c);
        }
        self.metrics
            .sglang_seconds
            .with_label_values(&["get"])
            .observe(started.elapsed().as_secs_f64());
        Ok(Response::new(sglang::BatchGetResponse { results }))
    }
}

/// Accepts registrations on `listener` until `stop`.
pub async fn serve_registrations(
    listener: UnixListener,
    pools: Arc<Pools>,
    stop: CancellationToken,
) {
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            r = listener.accept() => match r {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!("sglang registration accept failed: {e}");
                    continue;
                }
            },
        };
        let (pools, stop) = (pools.clone(), stop.clone());
        tokio::spawn(async move {
            tokio::select! {
                () = stop.cancelled() => {}
                r = serve_one(stream, pools) => {
                    if let Err(e) = r {
                        tracing::warn!("sglang pool registration refused: {e}");
                    }
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use std::os::fd::{AsFd, BorrowedFd};
    use std::time::Duration;

    use super::*;

    /// Sends a registration message as SGLang does (magic, name length, name, descriptors).
    fn send(
        stream: &std::os::unix::net::UnixStream,
        magic: u64,
        name: &[u8],
        fds: &[BorrowedFd<'_>],
    ) {
        let mut msg = magic.to_le_bytes().to_vec();
        msg.extend_from_slice(&(name.len() as u32).to_le_bytes());
        msg.extend_from_slice(name);
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
        let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
        if !fds.is_empty() {
            assert!(anc.push(rustix::net::SendAncillaryMessage::ScmRights(fds)));
        }
        rustix::net::sendmsg(
            stream,
            &[std::io::IoSlice::new(&msg)],
            &mut anc,
            rustix::net::SendFlags::empty(),
        )
        .unwrap();
    }

    fn memfd(len: u64, fill: u8) -> OwnedFd {
        let fd =
            rustix::fs::memfd_create("kvtier-test-pool", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let f = std::fs::File::from(fd);
        std::io::Write::write_all(&mut &f, &vec![fill; len as usize]).unwrap();
        OwnedFd::from(f)
    }

    /// Reads the 4-byte answer, or `None` when the server closed the connection instead.
    fn answer(stream: &mut std::os::unix::net::UnixStream) -> Option<u32> {
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let mut b = [0u8; 4];
        std::io::Read::read_exact(stream, &mut b).ok()?;
        Some(u32::from_le_bytes(b))
    }

    async fn until(what: &str, f: impl Fn() -> bool) {
        for _ in 0..500 {
            if f() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("timed out waiting for {what}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pools_register_map_the_memfd_and_go_when_the_client_does() {
        let dir = std::env::temp_dir().join(format!("kvtier-sglang-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mempool.sock");
        let listener = UnixListener::bind(&path).unwrap();
        let pools = Arc::new(Pools::default());
        let stop = CancellationToken::new();
        tokio::spawn(serve_registrations(listener, pools.clone(), stop.clone()));

        // A good registration: id 1, the memfd's bytes visible through the mapping.
        let path2 = path.clone();
        let (c1, id1, fd1) = tokio::task::spawn_blocking(move || {
            let mut c = std::os::unix::net::UnixStream::connect(&path2).unwrap();
            let fd = memfd(8192, 0x42);
            send(&c, MAGIC, b"tp0", &[fd.as_fd()]);
            let id = answer(&mut c);
            (c, id, fd)
        })
        .await
        .unwrap();
        assert_eq!(id1, Some(1));
        let region = pools.get(1).unwrap();
        assert_eq!(region.len(), 8192);
        let mut b = [0u8; 4];
        region.read(8188, &mut b).unwrap();
        assert_eq!(b, [0x42; 4]);
        // The client writes through its memfd; the daemon's mapping sees it.
        rustix::io::pwrite(&fd1, &[7, 7], 100).unwrap();
        region.read(100, &mut b[..2]).unwrap();
        assert_eq!(&b[..2], &[7, 7]);
        drop(region);

        // Hostile registrations are refused (connection closed, no id), nothing registered.
        let path3 = path.clone();
        let refused = tokio::task::spawn_blocking(move || {
            let mut out = Vec::new();
            let fd = memfd(4096, 1);
            let fd2 = memfd(4096, 2);
            let cases: [(u64, Vec<u8>, Vec<BorrowedFd<'_>>); 5] = [
                (0xDEAD_BEEF, b"bad-magic".to_vec(), vec![fd.as_fd()]),
                (MAGIC, b"no-fd".to_vec(), vec![]),
                (MAGIC, b"two-fds".to_vec(), vec![fd.as_fd(), fd2.as_fd()]),
                (MAGIC, vec![0xff, 0xfe], vec![fd.as_fd()]),
                (MAGIC, vec![b'x'; MAX_NAME + 1], vec![fd.as_fd()]),
            ];
            for (magic, name, fds) in cases {
                let mut c = std::os::unix::net::UnixStream::connect(&path3).unwrap();
                send(&c, magic, &name, &fds);
                out.push(answer(&mut c));
            }
            out
        })
        .await
        .unwrap();
        assert_eq!(refused, vec![None; 5]);
        assert_eq!(pools.len(), 1);

        // A second good client gets the next id; closing the first unregisters it.
        let path4 = path.clone();
        let (c2, id2) = tokio::task::spawn_blocking(move || {
            let mut c = std::os::unix::net::UnixStream::connect(&path4).unwrap();
            let fd = memfd(4096, 9);
            send(&c, MAGIC, b"tp1", &[fd.as_fd()]);
            let id = answer(&mut c);
            (c, id)
        })
        .await
        .unwrap();
        assert_eq!(id2, Some(2));
        c1.shutdown(std::net::Shutdown::Both).unwrap();
        drop(c1);
        until("pool 1 to go", || pools.get(1).is_none()).await;
        assert!(pools.get(2).is_some());
        drop(c2);
        until("pool 2 to go", || pools.is_empty()).await;
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
