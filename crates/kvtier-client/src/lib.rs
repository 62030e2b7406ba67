//! kvtier-client: typed async clients of kvtier's services, and the client side of the
//! daemon's shared-memory pool.
//!
//! [`HostClient`] speaks `kvtier.v1.HostTier` over a Unix socket (or TCP), takes and returns
//! domain types (page keys, layouts), builds the hash self-test itself at registration, and
//! maps the session's pool ([`Session::pool`]) so pages are copied, never sent.
//! [`AgentClient`] is the engine's side of `kvtier.v1.Agent` (match, load back, prefetch,
//! insert, release, evict). [`raw`] calls any method with pre-encoded bytes (fuzzers, wire
//! debugging). (What the servers themselves share lives in kvtier-server.)

mod agent;
mod events;
mod pages;
pub mod raw;
mod secure;

pub use agent::{
    AgentClient, CALL_ID_HEADER, DEADLINE_HEADER, Evicted, Handle, Insert, Inserted, Loaded, Match,
    OWNER_HEADER, PagesLookup, PoolInfo, PoolMemory, PromptTokens, SaveRequest, Saved,
};

use std::path::{Path, PathBuf};
use std::time::Duration;

use kvtier_core::host_index::Landed;
use kvtier_core::{Layout, LayoutSpec, Namespace, PageHasher, PageKey, SessionId};
use kvtier_proto::v1::host_tier_client::HostTierClient;
use kvtier_proto::{pack_keys, v1};
use kvtier_shm::ShmPool;
use tonic::transport::{Channel, Endpoint, Uri};

pub use events::{EventBatch, EventStream};
pub use kvtier_proto::v1::ReserveStatus;
pub use pages::{PageError, SlotLease, StoredPages};
pub use secure::{
    AuthChannel, Bearer, TcpSecurity, connect_lazy_with, connect_with, install_crypto_provider,
};

/// Errors of the clients.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Could not connect.
    #[error("connecting to {target}: {source}")]
    Connect {
        /// Where.
        target: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server answered with an error status.
    #[error("{}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    /// The input was invalid before anything was sent.
    #[error(transparent)]
    Core(#[from] kvtier_core::Error),
    /// The pool could not be mapped.
    #[error("mapping the pool: {0}")]
    Shm(#[from] kvtier_shm::ShmError),
    /// The server's answer does not fit the request.
    #[error("protocol: {0}")]
    Protocol(String),
    /// TLS or token settings that cannot work (named in the message).
    #[error("{0}")]
    Security(String),
}

impl ClientError {
    /// Whether retrying could succeed (the daemon restarting or overloaded).
    pub fn is_retryable(&self) -> bool {
        match self {
            ClientError::Connect { .. } => true,
            ClientError::Status(s) => matches!(
                s.code(),
                tonic::Code::Unavailable | tonic::Code::ResourceExhausted
            ),
            _ => false,
        }
    }

    /// The gRPC code, when the server answered.
    pub fn code(&self) -> Option<tonic::Code> {
        match self {
            ClientError::Status(s) => Some(s.code()),
            _ => None,
        }
    }
}

/// Connects a gRPC channel to a Unix socket path, or to `http://host:port`.
pub async fn connect(target: &str) -> Result<Channel, ClientError> {
    let err = |source| ClientError::Connect {
        target: target.to_string(),
        source,
    };
    if target.starts_with("http://") || target.starts_with("https://") {
        return tune(Endpoint::from_shared(target.to_string()).map_err(err)?)
            .connect()
            .await
            .map_err(err);
    }
    let path = PathBuf::from(target.strip_prefix("unix://").unwrap_or(target));
    // The URI is required by the API but unused: the connector dials the socket.
    tune(Endpoint::from_static("http://kvtierd.local"))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .map_err(err)
}

/// Like [`connect`], but returns at once: the connection is made on first use and remade after
/// failures, so a peer that is down at start costs errors on calls, not a failed start.
pub fn connect_lazy(target: &str) -> Result<Channel, ClientError> {
    let err = |source| ClientError::Connect {
        target: target.to_string(),
        source,
    };
    if target.starts_with("http://") || target.starts_with("https://") {
        return Ok(tune(Endpoint::from_shared(target.to_string()).map_err(err)?).connect_lazy());
    }
    let path = PathBuf::from(target.strip_prefix("unix://").unwrap_or(target));
    Ok(
        tune(Endpoint::from_static("http://kvtierd.local")).connect_with_connector_lazy(
            tower::service_fn(move |_: Uri| {
                let path = path.clone();
                async move {
                    let stream = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                }
            }),
        ),
    )
}

/// HTTP/2 windows wide enough that streaming megabyte pages does not stall on the 64 KiB
/// defaults (kvtierd's server uses the same).
pub const STREAM_WINDOW: u32 = 8 << 20;
/// Connection-level HTTP/2 window.
pub const CONNECTION_WINDOW: u32 = 32 << 20;
/// Largest HTTP/2 frame kvtier receives, on servers and clients alike (the protocol's default
/// is 16 KiB). Measured on streamed 2 MiB pages (`benches/l3_remote.rs`, loopback, 2 cores):
/// gets ran at 2.2 GiB/s with 16 KiB frames, 3.4–5.2 GiB/s with 64–256 KiB frames, and
/// 0.9–1.2 GiB/s with 1 MiB frames (h2 holds a whole frame before handing any of it on, so
/// receiving and consuming stop overlapping); sets moved from 2.9 to 3.0–3.4 GiB/s.
pub const MAX_FRAME: u32 = 256 << 10;

pub(crate) fn tune(e: Endpoint) -> Endpoint {
    e.initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_frame_size(MAX_FRAME)
        .tcp_nodelay(true)
}

/// Page keys as raw wire bytes.
fn raw(keys: &[PageKey]) -> Vec<Vec<u8>> {
    keys.iter().map(|k| k.0.to_vec()).collect()
}

/// A client of the host tier.
#[derive(Debug, Clone)]
pub struct HostClient {
    inner: HostTierClient<AuthChannel>,
    /// The same connection, for calls made without the generated client (WatchEvents).
    channel: AuthChannel,
    /// The bearer token the calls present, presented at the pool door too.
    token: Option<String>,
}

/// The largest message a HostClient accepts.
const MAX_MESSAGE: usize = 64 << 20;

/// A registered session with its pool mapped.
#[derive(Debug)]
pub struct Session {
    /// Session id.
    pub id: SessionId,
    /// Lease time.
    pub ttl: Duration,
    /// The validated layout.
    pub layout: Layout,
    /// The daemon's pool for this layout, mapped into this process.
    pub pool: ShmPool,
    /// Where the pool lives.
    pub pool_path: PathBuf,
}

/// The outcome of a reserve, per key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reserved {
    /// Write the page into this slot, then commit.
    Slot(u32),
    /// Already stored.
    Present,
    /// No room.
    NoSpace,
}

/// The hash self-test a client sends at registration: keys of two pages of fixed tokens.
pub fn self_test(page_size: usize, ns: &Namespace) -> Result<v1::HashSelfTest, ClientError> {
    let tokens: Vec<u32> = (0..2 * page_size as u32)
        .map(|t| t.wrapping_mul(2_654_435_761) % 150_000)
        .collect();
    let keys = PageHasher::new(page_size, ns)?.keys(&tokens);
    Ok(v1::HashSelfTest {
        page_size: page_size as u32,
        namespace: Some(ns.into()),
        tokens,
        keys: raw(&keys),
    })
}

/// The session's pool, mapped from the descriptor kvtierd's pool door hands this process
/// (`RegisterResponse.pool_socket`; `kvtier_shm::door`).
async fn map_pool(
    r: &v1::RegisterResponse,
    stride: usize,
    token: Option<String>,
) -> Result<ShmPool, ClientError> {
    if r.pool_socket.is_empty() {
        return Err(ClientError::Protocol(
            "kvtierd named no pool door (pool_socket): it is older than this client, which \
             maps pools only from descriptors; upgrade kvtierd"
                .into(),
        ));
    }
    let (socket, session, slots) = (
        PathBuf::from(&r.pool_socket),
        r.session_id.clone(),
        r.pool_slots,
    );
    let fetched = tokio::task::spawn_blocking(move || {
        kvtier_shm::door::fetch(&socket, &session, token.as_deref(), POOL_DOOR_TIMEOUT)
    })
    .await
    .map_err(|e| ClientError::Protocol(format!("the pool door's fetch stopped: {e}")))??;
    let (fd, door_slots, door_stride) = fetched;
    if door_slots != slots || door_stride != stride as u64 {
        return Err(ClientError::Protocol(format!(
            "the pool door's pool ({door_slots} slots of {door_stride} bytes) is not the one \
             Register described ({slots} of {stride})"
        )));
    }
    Ok(ShmPool::from_fd(fd, &r.pool_path, slots, stride)?)
}

/// How long each step of a pool door fetch may take.
const POOL_DOOR_TIMEOUT: Duration = Duration::from_secs(10);

impl HostClient {
    /// Connects to the daemon at a socket path or `http://` address.
    pub async fn connect(target: &str) -> Result<Self, ClientError> {
        Self::connect_with(target, &TcpSecurity::default()).await
    }

    /// Connects with TLS (for `https://` targets) and a bearer token.
    pub async fn connect_with(target: &str, sec: &TcpSecurity) -> Result<Self, ClientError> {
        let channel = connect_with(target, sec).await?;
        Ok(Self {
            inner: HostTierClient::new(channel.clone()).max_decoding_message_size(MAX_MESSAGE),
            channel,
            token: sec.token.clone(),
        })
    }

    /// The raw generated client, for requests the typed methods do not cover.
    pub fn raw(&mut self) -> &mut HostTierClient<AuthChannel> {
        &mut self.inner
    }

    /// Registers a session for `layout` and maps its pool.
    pub async fn register(
        &mut self,
        name: &str,
        spec: &LayoutSpec,
    ) -> Result<Session, ClientError> {
        let layout = Layout::new(spec.clone())?;
        let r = self
            .inner
            .register(v1::RegisterRequest {
                name: name.to_string(),
                layout: Some(spec.into()),
                hash_self_test: Some(self_test(layout.page_size(), &Namespace::default())?),
                expected_layout: Some((&layout).into()),
            })
            .await?
            .into_inner();
        let stride = usize::try_from(r.slot_stride)
            .map_err(|_| ClientError::Protocol("slot stride overflows".into()))?;
        if stride != layout.slot_stride() {
            return Err(ClientError::Protocol(format!(
                "daemon slot stride {stride} differs from the layout's {}",
                layout.slot_stride()
            )));
        }
        let id = SessionId::from_bytes(&r.session_id).map_err(|e| {
            ClientError::Protocol(format!("kvtierd answered a bad session id: {e}"))
        })?;
        let pool = map_pool(&r, stride, self.token.clone()).await?;
        let pool_path = PathBuf::from(&r.pool_path);
        Ok(Session {
            id,
            ttl: Duration::from_millis(r.ttl_ms),
            layout,
            pool,
            pool_path,
        })
    }

    /// Keeps a session alive.
    pub async fn heartbeat(&mut self, session: SessionId) -> Result<(), ClientError> {
        self.heartbeat_with(session, None).await
    }

    /// Keeps a session alive and hands the daemon this client's report (shown per session
    /// in the daemon's Stats).
    pub async fn heartbeat_with(
        &mut self,
        session: SessionId,
        report: Option<v1::ClientReport>,
    ) -> Result<(), ClientError> {
        self.inner
            .heartbeat(v1::HeartbeatRequest {
                session_id: session.to_bytes().to_vec(),
                report,
            })
            .await?;
        Ok(())
    }

    /// Ends a session.
    pub async fn close(&mut self, session: SessionId) -> Result<(), ClientError> {
        self.inner
            .close(v1::CloseRequest {
                session_id: session.to_bytes().to_vec(),
            })
            .await?;
        Ok(())
    }

    /// Leading keys ready in L2.
    pub async fn lookup(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
    ) -> Result<usize, ClientError> {
        Ok(self.lookup_tiers(session, keys, false).await?.0)
    }

    /// Leading keys ready in L2, and (with `storage`) how many after those L3 holds.
    pub async fn lookup_tiers(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
        storage: bool,
    ) -> Result<(usize, usize), ClientError> {
        let r = self.lookup_raw(session, keys, storage, false).await?;
        let (ready, stored) = (r.ready_pages as usize, r.storage_pages as usize);
        // kvtierd is a peer: an answer about more keys than were asked is refused.
        if ready.saturating_add(stored) > keys.len() {
            return Err(ClientError::Protocol(format!(
                "lookup answered {ready} + {stored} pages for {} keys",
                keys.len()
            )));
        }
        Ok((ready, stored))
    }

    /// Key by key, whether each is ready in L2 or (with `storage`) held by L3.
    pub async fn lookup_each(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
        storage: bool,
    ) -> Result<Vec<bool>, ClientError> {
        let r = self.lookup_raw(session, keys, storage, true).await?;
        if r.present.len() != keys.len() {
            return Err(ClientError::Protocol(format!(
                "lookup answered {} presence flags for {} keys",
                r.present.len(),
                keys.len()
            )));
        }
        Ok(r.present)
    }

    async fn lookup_raw(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
        include_storage: bool,
        each_key: bool,
    ) -> Result<v1::LookupResponse, ClientError> {
        Ok(self
            .inner
            .lookup(v1::LookupRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
                include_storage,
                each_key,
            })
            .await?
            .into_inner())
    }

    /// Reserves slots for the keys not yet stored.
    pub async fn reserve(
        &mut self,
        session: SessionId,
        parent: Option<&PageKey>,
        keys: &[PageKey],
    ) -> Result<Vec<Reserved>, ClientError> {
        let r = self
            .inner
            .reserve(v1::ReserveRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
                parent: parent.map(|p| p.0.to_vec()).unwrap_or_default(),
            })
            .await?
            .into_inner();
        if r.status.len() != keys.len() || r.slots.len() != keys.len() {
            return Err(ClientError::Protocol(format!(
                "{} statuses and {} slots for {} keys",
                r.status.len(),
                r.slots.len(),
                keys.len()
            )));
        }
        r.status
            .iter()
            .zip(&r.slots)
            .map(|(&st, &slot)| match ReserveStatus::try_from(st) {
                Ok(ReserveStatus::Reserved) => Ok(Reserved::Slot(slot)),
                Ok(ReserveStatus::Present) => Ok(Reserved::Present),
                Ok(ReserveStatus::NoSpace) => Ok(Reserved::NoSpace),
                _ => Err(ClientError::Protocol(format!(
                    "unknown reserve status {st}"
                ))),
            })
            .collect()
    }

    /// Makes reserved pages visible.
    pub async fn commit(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
    ) -> Result<(), ClientError> {
        self.commit_leasing(session, keys, 0).await.map(|_| ())
    }

    /// [`Self::commit`], asking kvtierd to top the session's slot lease up to `lease_want`
    /// slots (see [`Self::commit_leased`]). Returns the slots newly leased.
    pub async fn commit_leasing(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
        lease_want: u32,
    ) -> Result<Vec<u32>, ClientError> {
        let r = self
            .inner
            .commit(v1::CommitRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
                lease_want,
            })
            .await?
            .into_inner();
        Ok(r.leased)
    }

    /// Lands pages copied into leased slots (`slots[i]` holds the page of `keys[i]`; `parent`
    /// is the key before `keys[0]`) and asks for the lease to be topped up to `want` slots.
    /// Returns what became of each page and the slots newly leased.
    pub async fn commit_leased(
        &mut self,
        session: SessionId,
        parent: Option<&PageKey>,
        keys: &[PageKey],
        slots: &[u32],
        want: u32,
    ) -> Result<(Vec<Landed>, Vec<u32>), ClientError> {
        let r = self
            .inner
            .commit_leased(v1::CommitLeasedRequest {
                session_id: session.to_bytes().to_vec(),
                parent: parent.map(|p| p.0.to_vec()).unwrap_or_default(),
                packed_keys: pack_keys(keys),
                slots: slots.to_vec(),
                want,
            })
            .await?
            .into_inner();
        if r.status.len() != keys.len() {
            return Err(ClientError::Protocol(format!(
                "{} statuses for {} keys",
                r.status.len(),
                keys.len()
            )));
        }
        let landed = r
            .status
            .iter()
            .map(|&st| match v1::LandedStatus::try_from(st) {
                Ok(v1::LandedStatus::Stored) => Ok(Landed::Stored),
                Ok(v1::LandedStatus::Present) => Ok(Landed::Present),
                Ok(v1::LandedStatus::NoRoom) => Ok(Landed::NoRoom),
                _ => Err(ClientError::Protocol(format!("unknown landed status {st}"))),
            })
            .collect::<Result<_, _>>()?;
        Ok((landed, r.granted))
    }

    /// Drops reservations.
    pub async fn abort(&mut self, session: SessionId, keys: &[PageKey]) -> Result<(), ClientError> {
        self.inner
            .abort(v1::AbortRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
            })
            .await?;
        Ok(())
    }

    /// Pins the longest ready prefix; returns its slots.
    pub async fn acquire(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
    ) -> Result<Vec<u32>, ClientError> {
        let r = self
            .inner
            .acquire(v1::AcquireRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
            })
            .await?
            .into_inner();
        if r.slots.len() > keys.len() {
            return Err(ClientError::Protocol("more slots than keys".into()));
        }
        Ok(r.slots)
    }

    /// Drops pins. If this fails, bytes read under those pins must be discarded.
    pub async fn release(
        &mut self,
        session: SessionId,
        keys: &[PageKey],
    ) -> Result<(), ClientError> {
        self.inner
            .release(v1::ReleaseRequest {
                session_id: session.to_bytes().to_vec(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
            })
            .await?;
        Ok(())
    }

    /// Daemon-wide state.
    pub async fn stats(&mut self) -> Result<v1::StatsResponse, ClientError> {
        Ok(self.inner.stats(v1::StatsRequest {}).await?.into_inner())
    }

    /// Starts prefetching `keys` from L3 into L2 under the name `request_id`; returns its
    /// progress stream (the first message says whether it runs or was revoked, the last one
    /// is final).
    pub async fn prefetch(
        &mut self,
        session: SessionId,
        request_id: &str,
        keys: &[PageKey],
        opts: PrefetchOptions,
    ) -> Result<tonic::Streaming<v1::PrefetchProgress>, ClientError> {
        Ok(self
            .inner
            .prefetch(v1::PrefetchRequest {
                session_id: session.to_bytes().to_vec(),
                request_id: request_id.to_string(),
                keys: Vec::new(),
                packed_keys: pack_keys(keys),
                parent: opts.parent.map(|p| p.0.to_vec()).unwrap_or_default(),
                policy: opts.policy as i32,
                hints: Some(opts.hints),
            })
            .await?
            .into_inner())
    }

    /// The progress of an open prefetch.
    pub async fn prefetch_status(
        &mut self,
        session: SessionId,
        request_id: &str,
    ) -> Result<v1::PrefetchProgress, ClientError> {
        Ok(self
            .inner
            .prefetch_status(v1::PrefetchStatusRequest {
                session_id: session.to_bytes().to_vec(),
                request_id: request_id.to_string(),
            })
            .await?
            .into_inner())
    }

    /// Finishes a prefetch per its policy and pins its usable prefix for the session;
    /// returns its final progress and the slots (copy them, then `release` those keys).
    pub async fn take_prefetch(
        &mut self,
        session: SessionId,
        request_id: &str,
    ) -> Result<(v1::PrefetchProgress, Vec<u32>), ClientError> {
        let r = self
            .inner
            .take_prefetch(v1::TakePrefetchRequest {
                session_id: session.to_bytes().to_vec(),
                request_id: request_id.to_string(),
            })
            .await?
            .into_inner();
        let p = r
            .progress
            .ok_or_else(|| ClientError::Protocol("take without progress".into()))?;
        Ok((p, r.slots))
    }

    /// Cancels a prefetch and drops its pins.
    pub async fn release_prefetch(
        &mut self,
        session: SessionId,
        request_id: &str,
    ) -> Result<(), ClientError> {
        self.inner
            .release_prefetch(v1::ReleasePrefetchRequest {
                session_id: session.to_bytes().to_vec(),
                request_id: request_id.to_string(),
            })
            .await?;
        Ok(())
    }

    /// How many leading pages of `keys` (a prompt's, in the caller's tenant) this node
    /// holds in the pool of `layout`: ready in L2, and after those in L3 when
    /// `include_storage` (docs/routing.md). No session needed.
    pub async fn locate(
        &mut self,
        layout: &kvtier_core::LayoutFingerprint,
        keys: &[PageKey],
        include_storage: bool,
    ) -> Result<Located, ClientError> {
        let r = self
            .inner
            .locate(v1::LocateRequest {
                layout: layout.to_hex(),
                packed_keys: kvtier_proto::pack_keys(keys),
                include_storage,
                ..Default::default()
            })
            .await?
            .into_inner();
        Ok(Located {
            l2_pages: r.l2_pages as usize,
            l3_pages: r.l3_pages as usize,
            node: r.node,
        })
    }

    /// What kvtierd's L2 holds, as events (docs/routing.md): from a snapshot, or resuming
    /// after `after_seq` of stream `stream_id` (0, 0: a snapshot first).
    pub async fn watch_events(
        &mut self,
        stream_id: u64,
        after_seq: u64,
    ) -> Result<EventStream, ClientError> {
        events::watch(
            self.channel.clone(),
            MAX_MESSAGE,
            v1::WatchEventsRequest {
                stream_id,
                after_seq,
            },
        )
        .await
    }

    /// A snapshot of every daemon metric each `interval` (0: the daemon's default).
    pub async fn watch_metrics(
        &mut self,
        interval: Duration,
    ) -> Result<tonic::Streaming<v1::MetricsSnapshot>, ClientError> {
        Ok(self
            .inner
            .watch_metrics(v1::WatchMetricsRequest {
                interval_ms: interval.as_millis() as u64,
            })
            .await?
            .into_inner())
    }
}

/// Where a node holds a prompt's pages ([`HostClient::locate`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Located {
    /// Leading pages ready in L2.
    pub l2_pages: usize,
    /// Pages after those in L3 (when asked).
    pub l3_pages: usize,
    /// The node's name.
    pub node: String,
}

/// How to run a prefetch; the default is the daemon's configuration.
#[derive(Clone, Debug, Default)]
pub struct PrefetchOptions {
    /// The key of the page before `keys[0]`.
    pub parent: Option<PageKey>,
    /// Stop policy (unspecified: the daemon's `prefetch.policy`).
    pub policy: v1::PrefetchPolicy,
    /// Per-request adjustments.
    pub hints: v1::PrefetchHints,
}

impl PrefetchOptions {
    /// The daemon's defaults with stop policy `policy`.
    pub fn policy(policy: v1::PrefetchPolicy) -> Self {
        Self {
            policy,
            ..Self::default()
        }
    }
}

/// A prefetch's outcome as one word: `running`, `completed`, `partial`, `timed_out`,
/// `revoked:<reason>` or `failed:<reason>`.
pub fn outcome(p: &v1::PrefetchProgress) -> String {
    use v1::PrefetchState as S;
    match S::try_from(p.state).unwrap_or(S::Unspecified) {
        S::Running => "running".into(),
        S::Completed => "completed".into(),
        S::Partial => "partial".into(),
        S::TimedOut => "timed_out".into(),
        S::Revoked => format!("revoked:{}", p.reason),
        S::Failed => format!("failed:{}", p.reason),
        S::Unspecified => "unspecified".into(),
    }
}

/// Asks `grpc.health.v1` whether the daemon serves; returns the status name.
pub async fn health(target: &str) -> Result<String, ClientError> {
    health_with(target, &TcpSecurity::default()).await
}

/// [`health`] of a TCP target with TLS and a token.
pub async fn health_with(target: &str, sec: &TcpSecurity) -> Result<String, ClientError> {
    use tonic_health::pb::health_client::HealthClient;
    let mut c = HealthClient::new(connect_with(target, sec).await?);
    let r = c
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await?
        .into_inner();
    Ok(format!("{:?}", r.status()).to_uppercase())
}

/// The default daemon socket for the embedded default configuration.
pub fn default_socket() -> &'static Path {
    Path::new("kvtier-data/kvtierd.sock")
}
