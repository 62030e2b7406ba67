//! SGLang's HiCache RPC storage protocol (`--hicache-storage-backend rpc`).
//!
//! Part 1, here: host-pool registration. Each SGLang scheduler process (one per TP rank)
//! registers its host KV pool — a memfd — on a Unix stream socket: one `sendmsg` carrying 8
//! bytes of magic (`0x8DF6FBFD`, u64 little-endian), a u32 little-endian name length, the
//! UTF-8 name, and exactly one file descriptor as `SCM_RIGHTS`. The server maps the memfd
//! (its size from `fstat`) and answers the pool id, u32 little-endian: random in
//! 1..=i32::MAX (transfers carry it in an int32 field) and never handed out twice by one
//! kvtierd, so a client from before a restart (or one that kept an old id) gets a clean "no
//! registered pool" instead of another client's pool. The client keeps the connection open
//! while it uses the pool; when it closes, the pool is unmapped and its id stops resolving.
//!
//! A pool belongs to the uid that registered it (`SO_PEERCRED` of the registration): a
//! transfer from a connection of another uid (the relay tells the service who is calling,
//! [`authority`]) that names it gets the very answer an unknown id gets, so an id is no
//! bearer capability and no probe tells a live id from a dead one. The registration must
//! arrive within `server.connections.handshake_timeout`.
//!
//! Hostile input — a wrong magic, a short or oversized preamble, a name that is not UTF-8,
//! no descriptor or more than one, a file that cannot be mapped — closes that connection with
//! a log line naming the problem; nothing else is affected.
//!
//! Part 2, [`service`]: the gRPC `StorageServer` that moves objects by offset into these
//! pools, over kvtier's L3 and kvtierd's own L2 pages of [`objects`].

mod authority;
mod batch;
mod metrics;
pub mod objects;
pub mod service;

pub use authority::incoming as grpc_incoming;
pub use authority::who as relayed_caller;

pub use metrics::SglangMetrics;
pub use objects::ObjectPages;
pub use service::StorageService;

use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;
use std::sync::Arc;

use kvtier_proto::ApiError;
use kvtier_server::peers::GatedListener;
use kvtier_shm::ShmRegion;
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::UnixStream;

use kvtier_server::tasks::Tasks;

/// The preamble's magic, as SGLang sends it.
pub const MAGIC: u64 = 0x8DF6_FBFD;
/// Longest pool name accepted.
pub const MAX_NAME: usize = 4096;

/// One registered host pool.
///
/// At registration kvtierd seals the memfd against shrinking (`F_SEAL_SHRINK`) when its
/// creator allowed sealing; then copies go through the mapping and can never fault. When
/// sealing is not allowed, the client could shrink the file in the middle of a copy, and
/// touching the mapping past the new end would kill kvtierd with SIGBUS — so those copies
/// are guarded (`ShmRegion::read_guarded`): a fault is absorbed, the copy fails, and the
/// pool is marked damaged (every later transfer naming it gets `FAILED_PRECONDITION`; the
/// client must register again).
#[derive(Debug)]
pub struct EnginePool {
    region: ShmRegion,
    sealed: bool,
    /// The uid of the process that registered it: only its transfers may name the pool.
    owner: u32,
}

impl EnginePool {
    /// A pool over `region` registered by `owner` (a uid), sealed if its file allows it.
    pub fn new(region: ShmRegion, owner: u32) -> Self {
        let sealed = region.seal_shrink();
        Self {
            region,
            sealed,
            owner,
        }
    }

    /// Whether a transfer from a peer with `uid` may name this pool.
    pub fn owned_by(&self, uid: u32) -> bool {
        self.owner == uid
    }

    /// Mapped bytes.
    pub fn len(&self) -> usize {
        self.region.len()
    }

    /// Always false: a pool has at least one byte.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// Whether the file can no longer shrink (copies then use the mapping).
    pub fn sealed(&self) -> bool {
        self.sealed
    }

    /// The file's size now (a client may have shrunk an unsealed one).
    pub fn current_len(&self) -> u64 {
        self.region.current_file_len().unwrap_or(0)
    }

    /// Whether a client shrank the pool under a copy (it is of no further use).
    pub fn is_damaged(&self) -> bool {
        self.region.is_damaged()
    }

    /// Copies bytes at `offset` into `dst`.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), kvtier_shm::ShmError> {
        if self.sealed {
            self.region.read(offset, dst)
        } else {
            self.region.read_guarded(offset, dst)
        }
    }

    /// Copies `src` to `offset`.
    pub fn write(&self, offset: usize, src: &[u8]) -> Result<(), kvtier_shm::ShmError> {
        if self.sealed {
            self.region.write(offset, src)
        } else {
            self.region.write_guarded(offset, src)
        }
    }
}

/// The registered pools by id, and every id handed out since start.
#[derive(Debug, Default)]
pub struct Pools {
    map: Mutex<Registry>,
    gauge: Option<prometheus::IntGauge>,
}

#[derive(Debug, Default)]
struct Registry {
    live: HashMap<u32, Arc<EnginePool>>,
    issued: HashSet<u32>,
}

impl Registry {
    /// A random id in 1..=i32::MAX (transfers carry it as an int32) never issued before by
    /// this process. Random rather than counted so that ids do not repeat across restarts
    /// either (as far as 31 bits allow).
    fn fresh_id(&mut self) -> Result<u32, ApiError> {
        loop {
            // Transfers carry the id in an int32 field: 31 bits.
            let id = u32::from_le_bytes(crate::ids::random()?) & 0x7FFF_FFFF;
            if id != 0 && self.issued.insert(id) {
                return Ok(id);
            }
        }
    }
}

impl Pools {
    fn lock(&self) -> parking_lot::MutexGuard<'_, Registry> {
        self.map.lock()
    }

    /// The pool registered as `id`, while its client is connected.
    pub fn get(&self, id: u32) -> Option<Arc<EnginePool>> {
        self.lock().live.get(&id).cloned()
    }

    /// Pools registered now.
    pub fn len(&self) -> usize {
        self.lock().live.len()
    }

    /// Whether none is registered.
    pub fn is_empty(&self) -> bool {
        self.lock().live.is_empty()
    }

    /// Pools that report their count to `gauge`.
    pub fn with_gauge(gauge: prometheus::IntGauge) -> Self {
        Self {
            gauge: Some(gauge),
            ..Self::default()
        }
    }

    fn add(&self, pool: EnginePool) -> Result<u32, ApiError> {
        let mut m = self.lock();
        let id = m.fresh_id()?;
        m.live.insert(id, Arc::new(pool));
        if let Some(g) = &self.gauge {
            g.set(m.live.len() as i64);
        }
        Ok(id)
    }

    fn remove(&self, id: u32) {
        let mut m = self.lock();
        m.live.remove(&id);
        if let Some(g) = &self.gauge {
            g.set(m.live.len() as i64);
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
async fn serve_one(
    mut stream: UnixStream,
    pools: Arc<Pools>,
    handshake: std::time::Duration,
) -> Result<(), RegisterError> {
    let owner = stream
        .peer_cred()
        .map_err(|e| RegisterError::Pool(format!("no peer credentials: {e}")))?
        .uid();
    let (name, mut fds) = tokio::time::timeout(handshake, read_preamble(&stream))
        .await
        .map_err(|_| {
            RegisterError::Preamble(
                "no registration within server.connections.handshake_timeout".into(),
            )
        })??;
    if fds.len() != 1 {
        return Err(RegisterError::Preamble(format!(
            "{} file descriptors with pool {name:?}, expected exactly one",
            fds.len()
        )));
    }
    let fd = fds.remove(0);
    // Mapped whole: no bigger than this machine's memory (a sparse file of any size would
    // otherwise take kvtierd's address space).
    let len = rustix::fs::fstat(&fd)
        .map_err(|e| RegisterError::Pool(format!("{name}: stat: {e}")))?
        .st_size as u64;
    let ram = kvtier_shm::physical_memory();
    if len > ram {
        return Err(RegisterError::Pool(format!(
            "{name} is {len} bytes, more than this machine's memory ({ram})"
        )));
    }
    let region = ShmRegion::from_fd(fd, &name).map_err(|e| RegisterError::Pool(e.to_string()))?;
    let bytes = region.len();
    let pool = EnginePool::new(region, owner);
    let sealed = pool.sealed();
    let id = pools
        .add(pool)
        .map_err(|e| RegisterError::Pool(e.to_string()))?;
    tracing::info!(
        pool = id,
        name = %name,
        bytes,
        sealed,
        "sglang host pool registered{}",
        if sealed { "" } else { " (not sealable: copies are guarded against a shrink)" }
    );
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

/// Registers `fd` (a memfd host pool) on the registration socket at `socket`, as SGLang's
/// client does; returns the connection — the pool stays registered while it is open — and
/// the pool id. Blocking; for tools, tests and benchmarks that stand in for SGLang.
pub fn register_pool(
    socket: &std::path::Path,
    name: &str,
    fd: std::os::fd::BorrowedFd<'_>,
) -> std::io::Result<(std::os::unix::net::UnixStream, u32)> {
    let c = std::os::unix::net::UnixStream::connect(socket)?;
    let mut msg = MAGIC.to_le_bytes().to_vec();
    msg.extend_from_slice(&(name.len() as u32).to_le_bytes());
    msg.extend_from_slice(name.as_bytes());
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = rustix::net::SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !anc.push(rustix::net::SendAncillaryMessage::ScmRights(&fds)) {
        return Err(std::io::Error::other("no room for the descriptor"));
    }
    rustix::net::sendmsg(
        &c,
        &[std::io::IoSlice::new(&msg)],
        &mut anc,
        rustix::net::SendFlags::empty(),
    )?;
    let mut id = [0u8; 4];
    std::io::Read::read_exact(&mut &c, &mut id)?;
    Ok((c, u32::from_le_bytes(id)))
}

/// Accepts registrations on `listener` until `tasks`' shutdown, each served on `tasks`.
pub async fn serve_registrations(listener: GatedListener, pools: Arc<Pools>, tasks: Tasks) {
    let stop = tasks.shutdown.clone();
    let handshake = listener.cap().handshake_timeout();
    loop {
        let (stream, permit) = tokio::select! {
            () = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let (pools, stop) = (pools.clone(), stop.clone());
        tasks.spawn(async move {
            // The connection's place under the socket's cap, for as long as it is served.
            let _permit = permit;
            tokio::select! {
                () = stop.cancelled() => {}
                r = serve_one(stream, pools, handshake) => {
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
    use tokio_util::sync::CancellationToken;

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

    #[test]
    fn pool_ids_are_non_zero_int32_and_never_repeat() {
        let mut r = Registry::default();
        let ids: Vec<u32> = (0..20_000).map(|_| r.fresh_id().unwrap()).collect();
        assert!(ids.iter().all(|&id| (1..=i32::MAX as u32).contains(&id)));
        let distinct: HashSet<u32> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len());
        // Not a counter: two registries (two kvtierd runs) start from different ids.
        let mut again = Registry::default();
        assert_ne!(again.fresh_id().unwrap(), ids[0]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pools_register_map_the_memfd_and_go_when_the_client_does() {
        let dir = std::env::temp_dir().join(format!("kvtier-sglang-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mempool.sock");
        let gate = kvtier_server::peers::PeerGate::new(
            &kvtier_config::unix::UnixAccess::default(),
            &kvtier_config::connections::ConnectionLimits::default(),
            &kvtier_server::metrics::MetricRegistry::new(),
        )
        .unwrap();
        let listener = gate
            .bind(&path, kvtier_server::doors::Listener::SglangMempool)
            .await
            .unwrap();
        let pools = Arc::new(Pools::default());
        let stop = CancellationToken::new();
        tokio::spawn(serve_registrations(
            listener,
            pools.clone(),
            Tasks::new(stop.clone()),
        ));

        // A good registration: a random non-zero id, the memfd's bytes visible through the
        // mapping.
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
        let id1 = id1.unwrap();
        assert!((1..=i32::MAX as u32).contains(&id1), "{id1}");
        let region = pools.get(id1).unwrap();
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
            // Review finding (issue 62): a sparse file larger than the machine's memory would
            // have taken kvtierd's address space when mapped whole.
            let huge = memfd(4096, 3);
            std::fs::File::from(huge.try_clone().unwrap())
                .set_len(kvtier_shm::physical_memory() + (1 << 30))
                .unwrap();
            let cases: [(u64, Vec<u8>, Vec<BorrowedFd<'_>>); 6] = [
                (0xDEAD_BEEF, b"bad-magic".to_vec(), vec![fd.as_fd()]),
                (MAGIC, b"no-fd".to_vec(), vec![]),
                (MAGIC, b"two-fds".to_vec(), vec![fd.as_fd(), fd2.as_fd()]),
                (MAGIC, vec![0xff, 0xfe], vec![fd.as_fd()]),
                (MAGIC, vec![b'x'; MAX_NAME + 1], vec![fd.as_fd()]),
                (MAGIC, b"sparse-and-huge".to_vec(), vec![huge.as_fd()]),
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
        assert_eq!(refused, vec![None; 6]);
        assert_eq!(pools.len(), 1);

        // A second good client gets another id; closing the first unregisters it.
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
        let id2 = id2.unwrap();
        assert!(id2 != id1 && (1..=i32::MAX as u32).contains(&id2), "{id2}");
        c1.shutdown(std::net::Shutdown::Both).unwrap();
        drop(c1);
        until("the first pool to go", || pools.get(id1).is_none()).await;
        assert!(pools.get(id2).is_some());
        drop(c2);
        until("the second pool to go", || pools.is_empty()).await;
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
