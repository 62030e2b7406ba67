//! `kvtierd.toml`: the node daemon's configuration.
//!
//! The commented default file (`DEFAULT_TOML`) lives in `daemon/default_toml.rs`, `[l3]` in
//! `l3.rs`; here are the structs, `validate` and tests.

use std::path::PathBuf;
use std::time::Duration;

use kvtier_core::PolicyKind;
use serde::{Deserialize, Serialize};

pub use crate::l3::{
    FileSection, L3Backend, L3Config, MemorySection, RemoteSection, RocksdbSection, S3Section,
};
use crate::tenants::{TenantConfig, Tenants};
use crate::unix::UnixAccess;
use crate::{ByteSize, ConfigError, Dur, Secret, Sources};

mod default_toml;
pub use default_toml::DEFAULT_TOML;

/// What [`DaemonConfig::to_redacted_toml`] shows instead of a secret.
pub const REDACTED: &str = "<redacted>";

/// The daemon's configuration, as read. Use [`DaemonConfig::load`]; it validates.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// Directory for the socket and local state.
    pub data_dir: PathBuf,
    /// Control plane.
    pub server: ServerConfig,
    /// Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The host tier.
    pub l2: L2Config,
    /// The storage tier.
    pub l3: L3Config,
    /// Prefetch from L3 into L2.
    pub prefetch: PrefetchConfig,
    /// SGLang's HiCache RPC storage protocol.
    pub sglang_rpc: SglangRpcConfig,
    /// Client sessions.
    pub sessions: SessionsConfig,
    /// Named tenants (file only).
    pub tenants: std::collections::BTreeMap<String, TenantConfig>,
    /// Logging.
    pub log: LogConfig,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// UDS path; unset means `<data_dir>/kvtierd.sock`.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub socket: Option<PathBuf>,
    /// The pool door's UDS path (clients receive pool descriptors there); unset means the
    /// control socket's path with `.pools` appended.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub pool_socket: Option<PathBuf>,
    /// Optional TCP listen address.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tcp: Option<String>,
    /// Most keys per request.
    pub max_batch: u32,
    /// Most streams of each kind one caller holds open.
    pub max_streams_per_caller: u32,
    /// Grace period for in-flight work at shutdown.
    pub drain_timeout: Dur,
    /// Token for admin calls over TCP. Never printed.
    pub admin_token: Secret,
    /// PEM certificate chain of the TCP listener.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of the TCP listener.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle that TCP clients' certificates must chain to; empty: no client certs.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Bearer token of every call over TCP. Never printed.
    pub token: Secret,
    /// File holding the token.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub token_file: Option<PathBuf>,
    /// TCP without TLS, on loopback only.
    pub tcp_insecure: bool,
    /// Who may use the Unix sockets.
    pub unix: UnixAccess,
    /// Token of peer kvtierds (ObjectStorage). Never printed.
    pub peer_token: Secret,
    /// File holding the peer token.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub peer_token_file: Option<PathBuf>,
    /// Who is the operator on the Unix socket.
    pub admin: crate::roles::AdminAccess,
    /// How many connections each listener holds, and how long one has to start.
    pub connections: crate::connections::ConnectionLimits,
}

impl DaemonConfig {
    /// The named tenants, tokens read (validation has checked they resolve).
    pub fn tenants(&self) -> Result<Tenants, ConfigError> {
        Tenants::resolve(&self.tenants)
    }
}

impl ServerConfig {
    /// The bearer token every TCP call must present: `token`, or the contents of
    /// `token_file`; `None` when neither is set.
    pub fn tcp_token(&self) -> Result<Option<String>, ConfigError> {
        crate::tls::resolve_token(&self.token, self.token_file.as_deref(), "server.token")
    }

    /// The token of peer kvtierds: `peer_token`, or the contents of `peer_token_file`.
    pub fn peer_token(&self) -> Result<Option<String>, ConfigError> {
        crate::tls::resolve_token(
            &self.peer_token,
            self.peer_token_file.as_deref(),
            "server.peer_token",
        )
    }
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// Listen address; unset disables the endpoint (written `""`, so a configuration
    /// written out and read again keeps it off: the default is on).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        serialize_with = "crate::units::none_as_empty"
    )]
    pub listen: Option<String>,
    /// Bearer token a scrape must present (`Authorization: Bearer <token>`); empty: none.
    /// Never printed.
    pub token: Secret,
    /// File holding the token.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub token_file: Option<PathBuf>,
    /// Whether the endpoint shows series labelled by tenant (`kvtier_tenant_*`).
    pub tenant_series: bool,
    /// The window of `kvtier_lookup_hit_ceiling_ratio`: requests within one to two of it.
    pub hit_ceiling_window: Dur,
}

impl MetricsConfig {
    /// The scrape token: `token`, or the contents of `token_file`; `None` when neither is
    /// set.
    pub fn bearer_token(&self) -> Result<Option<String>, ConfigError> {
        crate::tls::resolve_token(&self.token, self.token_file.as_deref(), "metrics.token")
    }
}

/// What backs an L2 pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum L2Backing {
    /// A named file in `l2.shm_dir`.
    #[default]
    ShmFile,
    /// An anonymous memfd, opened by clients through `/proc/<pid>/fd`.
    Memfd,
}

/// Where SGLang's objects persist.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SglangStore {
    /// kvtierd's `[l3]` backend, in a namespace of their own.
    #[default]
    Shared,
    /// kvtierd's memory only.
    None,
}

/// `[l2]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct L2Config {
    /// tmpfs directory for pool files.
    pub shm_dir: PathBuf,
    /// What backs each pool.
    pub backing: L2Backing,
    /// Bytes per pool class.
    pub pool_bytes: ByteSize,
    /// Pages per pool class (overrides `pool_bytes` when above 0).
    pub pool_pages: u64,
    /// Largest page a layout may have.
    pub max_page_bytes: ByteSize,
    /// A pool per tenant and layout, its file open to that tenant alone.
    pub tenant_pools: bool,
    /// Most pool classes.
    pub max_pools: u32,
    /// Most own pools of one named tenant (0: an even share).
    pub max_pools_per_tenant: u32,
    /// How long an unused pool lives.
    pub idle_pool_ttl: Dur,
    /// Which page to evict first.
    pub eviction_policy: PolicyKind,
    /// mlock the pools.
    pub mlock: bool,
    /// Transparent huge pages.
    pub huge_pages: bool,
    /// Allocate pools' memory up front.
    pub reserve: bool,
    /// Share of a pool that pages not yet in L3 may take while L3 is up.
    pub dirty_fraction: f64,
    /// Share of the dirty limit one session (and one tenant) may hold reserved.
    pub reserve_share: f64,
    /// Seal committed pages so a kvtierd started after a crash takes the pool over.
    pub take_over_after_crash: bool,
}

/// `[sglang_rpc]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SglangRpcConfig {
    /// Serve the protocol.
    pub enable: bool,
    /// Pool registration socket (empty: `<data_dir>/sglang-mempool.sock`).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub mempool_socket: Option<PathBuf>,
    /// gRPC socket (empty: `<data_dir>/sglang-grpc.sock`).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub grpc_socket: Option<PathBuf>,
    /// Where objects persist.
    pub l3: SglangStore,
    /// Bytes of recently put or got objects kept in kvtierd's memory for every SGLang
    /// instance on the node (0: off).
    pub memory_bytes: ByteSize,
    /// Backend calls in flight per batch.
    pub concurrency: u32,
    /// Most transfers (or ids) in one request.
    pub max_batch: u32,
}

/// `[prefetch]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PrefetchConfig {
    /// Default stop policy.
    pub policy: StopPolicy,
    /// Shortest L3 hit (tokens) worth fetching.
    pub threshold_tokens: u64,
    /// Engine prefill rate used to decide whether loading beats recomputing (0: off).
    pub recompute_tokens_per_second: u64,
    /// Share of each pool prefetches may hold.
    pub budget_fraction: f64,
    /// Pages per fetch batch.
    pub batch_pages: u32,
    /// Backend reads in flight per prefetch, at least.
    pub concurrency: u32,
    /// Backend reads in flight per prefetch, at most (the window adapts in between).
    pub max_concurrency: u32,
    /// Timeout policy: fixed part of the deadline.
    pub timeout_base: Dur,
    /// Timeout policy: added per 1024 tokens.
    pub timeout_per_1k_tokens: Dur,
    /// Upper bound of every prefetch's deadline.
    pub timeout_max: Dur,
    /// How long a failed key is not prefetched again.
    pub negative_ttl: Dur,
    /// Most keys remembered as failed.
    pub negative_capacity: u32,
    /// Most open prefetches per session.
    pub max_per_session: u32,
}

/// When a prefetch is finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopPolicy {
    /// Take what landed whenever the client asks.
    BestEffort,
    /// Wait for every hit page.
    WaitComplete,
    /// Wait until the size-dependent deadline.
    Timeout,
}

impl PrefetchConfig {
    /// The timeout policy's deadline for a prefetch of `tokens` tokens.
    pub fn deadline_for(&self, tokens: u64) -> Duration {
        let scaled = self.timeout_per_1k_tokens.0.mul_f64(tokens as f64 / 1024.0);
        (self.timeout_base.0 + scaled).min(self.timeout_max.0)
    }
}

/// `[sessions]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SessionsConfig {
    /// Lease time without heartbeat.
    pub ttl: Dur,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    /// Filter directives.
    pub level: String,
}

crate::defaults_from_file!(defaults, DaemonConfig, DEFAULT_TOML);

impl Default for DaemonConfig {
    /// The commented default file ([`DEFAULT_TOML`]), the one place defaults are written.
    fn default() -> Self {
        defaults().clone()
    }
}

crate::default_from_parent!(
    defaults,
    ServerConfig => server,
    MetricsConfig => metrics,
    L2Config => l2,
    L3Config => l3,
    PrefetchConfig => prefetch,
    SglangRpcConfig => sglang_rpc,
    SessionsConfig => sessions,
    LogConfig => log,
    crate::l3::FileSection => l3.file,
    crate::l3::RocksdbSection => l3.rocksdb,
    crate::l3::S3Section => l3.s3,
    crate::l3::RemoteSection => l3.remote,
    crate::l3::MemorySection => l3.memory,
    UnixAccess => server.unix,
    crate::roles::AdminAccess => server.admin,
    crate::connections::ConnectionLimits => server.connections,
);

/// Most keys per request the daemon can be configured to accept.
pub const MAX_BATCH_LIMIT: u32 = 1 << 20;

impl DaemonConfig {
    /// This configuration with `section.key=value` overrides applied (as `--set` would) and
    /// validated: how runtime changes (attaching another L3 backend) are checked.
    pub fn with_overrides(&self, sets: &[String]) -> Result<Self, ConfigError> {
        let table = toml::Table::try_from(self)
            .map_err(|e| ConfigError::invalid("<running config>", e.to_string()))?;
        let text = toml::to_string(&table)
            .map_err(|e| ConfigError::invalid("<running config>", e.to_string()))?;
        Self::load(&Sources {
            file: Some(("<running config>".into(), text)),
            env: Vec::new(),
            sets: sets.to_vec(),
        })
    }

    /// This configuration as `kvtierd.toml` text, with every secret (`server.admin_token`,
    /// `server.token`, `server.peer_token`, `l3.s3.secret_key`, `l3.remote.token`, every `tenants.*.token`) shown
    /// as `"<redacted>"` when set: what an operator may print (`kvtierctl config`).
    pub fn to_redacted_toml(&self) -> Result<String, ConfigError> {
        let mut c = self.clone();
        let tenants = c.tenants.values_mut().map(|t| &mut t.token);
        for secret in [
            &mut c.server.admin_token,
            &mut c.server.token,
            &mut c.server.peer_token,
            &mut c.metrics.token,
            &mut c.l3.s3.secret_key,
            &mut c.l3.remote.token,
        ]
        .into_iter()
        .chain(tenants)
        {
            if !secret.expose().is_empty() {
                *secret = Secret(REDACTED.to_string());
            }
        }
        toml::to_string(&c).map_err(|e| ConfigError::invalid("<running config>", e.to_string()))
    }

    /// Loads from the given sources (see the crate docs for the order) and validates.
    pub fn load(src: &Sources) -> Result<Self, ConfigError> {
        let cfg: Self = crate::load(DEFAULT_TOML, src)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The control socket path.
    pub fn socket_path(&self) -> PathBuf {
        (self.server.socket.clone()).unwrap_or_else(|| self.data_dir.join("kvtierd.sock"))
    }

    /// The pool door: where a registered client receives its pool's descriptor.
    pub fn pool_socket(&self) -> PathBuf {
        self.server.pool_socket.clone().unwrap_or_else(|| {
            let mut p = self.socket_path().into_os_string();
            p.push(".pools");
            PathBuf::from(p)
        })
    }

    /// SGLang's pool registration socket.
    pub fn sglang_mempool_socket(&self) -> PathBuf {
        (self.sglang_rpc.mempool_socket.clone())
            .unwrap_or_else(|| self.data_dir.join("sglang-mempool.sock"))
    }

    /// SGLang's gRPC socket.
    pub fn sglang_grpc_socket(&self) -> PathBuf {
        (self.sglang_rpc.grpc_socket.clone())
            .unwrap_or_else(|| self.data_dir.join("sglang-grpc.sock"))
    }

    /// The file backend's directory.
    pub fn l3_file_path(&self) -> PathBuf {
        self.l3
            .file
            .path
            .clone()
            .unwrap_or_else(|| self.data_dir.join("l3"))
    }

    /// The rocksdb backend's directory.
    pub fn l3_rocksdb_path(&self) -> PathBuf {
        (self.l3.rocksdb.path.clone()).unwrap_or_else(|| self.data_dir.join("rocksdb"))
    }

    /// The directory `backend` keeps its objects in on this host, as this configuration
    /// places it; `None` for a backend without one.
    pub fn l3_directory(&self, backend: L3Backend) -> Option<PathBuf> {
        match backend {
            L3Backend::File => Some(self.l3_file_path()),
            L3Backend::Rocksdb => Some(self.l3_rocksdb_path()),
            L3Backend::S3 | L3Backend::Remote | L3Backend::Memory | L3Backend::None => None,
        }
    }

    /// Checks every key's bounds. Destructures exhaustively, so a new key cannot be added
    /// without deciding its validation.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Self {
            data_dir,
            server:
                ServerConfig {
                    socket: _,
                    pool_socket: _,
                    tcp,
                    max_batch,
                    max_streams_per_caller,
                    drain_timeout,
                    admin_token: _,
                    tls_cert,
                    tls_key,
                    tls_client_ca,
                    token,
                    token_file,
                    tcp_insecure,
                    unix,
                    peer_token,
                    peer_token_file,
                    admin: admin_access,
                    connections,
                },
            metrics:
                MetricsConfig {
                    listen,
                    token: _,
                    token_file: _,
                    tenant_series,
                    hit_ceiling_window,
                },
            l2:
                L2Config {
                    shm_dir,
                    backing: _,
                    pool_bytes,
                    pool_pages,
                    max_pools,
                    max_pools_per_tenant,
                    idle_pool_ttl: _,
                    max_page_bytes,
                    tenant_pools: _,
                    eviction_policy: _,
                    mlock: _,
                    huge_pages: _,
                    reserve: _,
                    dirty_fraction,
                    reserve_share,
                    take_over_after_crash: _,
                },
            l3,
            prefetch:
                PrefetchConfig {
                    policy: _,
                    threshold_tokens,
                    recompute_tokens_per_second: _,
                    budget_fraction,
                    batch_pages: prefetch_batch,
                    concurrency: prefetch_concurrency,
                    max_concurrency: prefetch_max_concurrency,
                    timeout_base,
                    timeout_per_1k_tokens,
                    timeout_max,
                    negative_ttl,
                    negative_capacity,
                    max_per_session,
                },
            sglang_rpc:
                SglangRpcConfig {
                    enable: sglang_enable,
                    mempool_socket: _,
                    grpc_socket: _,
                    l3: sglang_l3,
                    memory_bytes: sglang_memory,
                    concurrency: sglang_concurrency,
                    max_batch: sglang_max_batch,
                },
            sessions: SessionsConfig { ttl },
            tenants,
            log: LogConfig { level },
        } = self;
        let resolved = Tenants::resolve(tenants)?;
        // A tenant's token that is also the operator's or the listener's would make the
        // tenant an operator (or every TCP caller that tenant).
        let admin = Some(self.server.admin_token.expose().to_string()).filter(|t| !t.is_empty());
        let peer =
            crate::tls::resolve_token(peer_token, peer_token_file.as_deref(), "server.peer_token")?;
        for (key, secret) in [
            ("server.token", self.server.tcp_token()?),
            ("server.admin_token", admin.clone()),
            ("server.peer_token", peer.clone()),
        ] {
            let name = secret.map_or("", |t| resolved.of_token(&t));
            if !name.is_empty() {
                return Err(ConfigError::invalid(
                    format!("tenants.{name}.token"),
                    format!("the same token as {key}; a tenant's token must be its own"),
                ));
            }
        }
        if let Some(p) = &peer
            && admin
                .as_ref()
                .is_some_and(|a| crate::tls::constant_time_eq(a.as_bytes(), p.as_bytes()))
        {
            return Err(ConfigError::invalid(
                "server.peer_token",
                "the same token as server.admin_token; a peer is not the operator",
            ));
        }
        admin_access.validate(tenants)?;
        l3.validate()?;
        if let Some(name) = resolved.l3_quota()
            && !l3.backend.keeps_quotas()
        {
            return Err(ConfigError::invalid(
                format!("tenants.{name}.l3_bytes"),
                format!(
                    "L3 quotas are kept by the file and rocksdb backends; l3.backend is {:?}",
                    l3.backend.name()
                ),
            ));
        }
        unix.validate("server.unix")?;
        connections.validate("server.connections")?;
        if *sglang_enable && *sglang_l3 == SglangStore::None && sglang_memory.0 == 0 {
            return Err(ConfigError::invalid(
                "sglang_rpc.memory_bytes",
                "must be above 0 with sglang_rpc.l3 = \"none\" (nothing would be stored)",
            ));
        }
        crate::check_ranges(&[
            (
                "sglang_rpc.concurrency",
                u64::from(*sglang_concurrency),
                1,
                256,
            ),
            (
                "sglang_rpc.max_batch",
                u64::from(*sglang_max_batch),
                1,
                1 << 20,
            ),
        ])?;
        if data_dir.as_os_str().is_empty() {
            return Err(ConfigError::invalid("data_dir", "must not be empty"));
        }
        crate::tls::check_server(&crate::tls::ServerTls {
            tcp: tcp.as_deref(),
            tls_cert: tls_cert.as_deref(),
            tls_key: tls_key.as_deref(),
            tls_client_ca: tls_client_ca.as_deref(),
            token,
            token_file: token_file.as_deref(),
            tcp_insecure: *tcp_insecure,
        })?;
        if *max_batch == 0 || *max_batch > MAX_BATCH_LIMIT {
            return Err(ConfigError::invalid(
                "server.max_batch",
                format!("{max_batch} is outside 1..={MAX_BATCH_LIMIT}"),
            ));
        }
        if !(1..=4096).contains(max_streams_per_caller) {
            return Err(ConfigError::invalid(
                "server.max_streams_per_caller",
                format!("{max_streams_per_caller} is outside 1..=4096"),
            ));
        }
        if drain_timeout.0 < Duration::from_millis(100)
            || drain_timeout.0 > Duration::from_secs(600)
        {
            return Err(ConfigError::invalid(
                "server.drain_timeout",
                format!("{drain_timeout} is outside 100ms..=10m"),
            ));
        }
        if let Some(listen) = listen {
            let Ok(addr) = listen.parse::<std::net::SocketAddr>() else {
                return Err(ConfigError::invalid(
                    "metrics.listen",
                    format!("{listen:?} is not an address such as 127.0.0.1:9464"),
                ));
            };
            let token = self.metrics.bearer_token()?;
            // Tenants' names and usage are for the operator: an endpoint others can reach
            // that shows them must ask for a token.
            if !addr.ip().is_loopback() && *tenant_series && token.is_none() {
                return Err(ConfigError::invalid(
                    "metrics.listen",
                    format!(
                        "{listen} is reachable from other hosts and metrics.tenant_series \
                         shows every tenant's name and usage: set metrics.token (or \
                         metrics.token_file) for Prometheus to present, or bind 127.0.0.1"
                    ),
                ));
            }
        }
        if hit_ceiling_window.0 < Duration::from_secs(1)
            || hit_ceiling_window.0 > Duration::from_secs(7 * 86400)
        {
            return Err(ConfigError::invalid(
                "metrics.hit_ceiling_window",
                format!("{hit_ceiling_window} is outside 1s..=7d"),
            ));
        }
        if shm_dir.as_os_str().is_empty() {
            return Err(ConfigError::invalid("l2.shm_dir", "must not be empty"));
        }
        if *pool_pages == 0 && pool_bytes.0 == 0 {
            return Err(ConfigError::invalid(
                "l2.pool_bytes",
                "must be above 0 (or set l2.pool_pages)",
            ));
        }
        if *pool_pages > u64::from(u32::MAX) {
            return Err(ConfigError::invalid(
                "l2.pool_pages",
                format!("at most {} pages per pool", u32::MAX),
            ));
        }
        if max_page_bytes.0 < 4096 {
            return Err(ConfigError::invalid(
                "l2.max_page_bytes",
                format!("{max_page_bytes} is below one 4 KiB page"),
            ));
        }
        if max_pools_per_tenant > max_pools {
            return Err(ConfigError::invalid(
                "l2.max_pools_per_tenant",
                format!("{max_pools_per_tenant} is above l2.max_pools ({max_pools})"),
            ));
        }
        if *max_pools == 0 || *max_pools > 1024 {
            return Err(ConfigError::invalid(
                "l2.max_pools",
                format!("{max_pools} is outside 1..=1024"),
            ));
        }
        if ttl.0 < Duration::from_millis(100) || ttl.0 > Duration::from_secs(3600) {
            return Err(ConfigError::invalid(
                "sessions.ttl",
                format!("{ttl} is outside 100ms..=1h"),
            ));
        }
        if !(0.05..=1.0).contains(reserve_share) {
            return Err(ConfigError::invalid(
                "l2.reserve_share",
                format!("{reserve_share} is outside 0.05..=1.0"),
            ));
        }
        if !(0.05..=1.0).contains(dirty_fraction) {
            return Err(ConfigError::invalid(
                "l2.dirty_fraction",
                format!("{dirty_fraction} is outside 0.05..=1.0"),
            ));
        }
        if !(0.0..=1.0).contains(budget_fraction) {
            return Err(ConfigError::invalid(
                "prefetch.budget_fraction",
                format!("{budget_fraction} is outside 0.0..=1.0"),
            ));
        }
        let ranges: [(&str, u64, u64, u64); 6] = [
            ("prefetch.threshold_tokens", *threshold_tokens, 0, 1 << 32),
            ("prefetch.batch_pages", u64::from(*prefetch_batch), 1, 4096),
            (
                "prefetch.concurrency",
                u64::from(*prefetch_concurrency),
                1,
                256,
            ),
            (
                "prefetch.max_concurrency",
                u64::from(*prefetch_max_concurrency),
                u64::from(*prefetch_concurrency),
                4096,
            ),
            (
                "prefetch.negative_capacity",
                u64::from(*negative_capacity),
                1,
                1 << 24,
            ),
            (
                "prefetch.max_per_session",
                u64::from(*max_per_session),
                1,
                1 << 20,
            ),
        ];
        crate::check_ranges(&ranges)?;
        for (key, d) in [
            ("prefetch.timeout_base", timeout_base),
            ("prefetch.timeout_per_1k_tokens", timeout_per_1k_tokens),
            ("prefetch.negative_ttl", negative_ttl),
        ] {
            if d.0 > Duration::from_secs(3600) {
                return Err(ConfigError::invalid(key, format!("{d} is above 1h")));
            }
        }
        if timeout_max.0 < Duration::from_millis(1) || timeout_max.0 > Duration::from_secs(3600) {
            return Err(ConfigError::invalid(
                "prefetch.timeout_max",
                format!("{timeout_max} is outside 1ms..=1h"),
            ));
        }
        if level.trim().is_empty() {
            return Err(ConfigError::invalid("log.level", "must not be empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_commented_default_file_is_the_default() {
        assert_eq!(
            DaemonConfig::load(&Sources::default()).unwrap(),
            DaemonConfig::default()
        );
        // A section's default is the file's section, wherever it is asked for.
        assert_eq!(
            crate::l3::S3Section::default(),
            DaemonConfig::default().l3.s3
        );
        assert_eq!(L2Config::default().pool_bytes, ByteSize(256 << 20));
        // A file that gives one key of a section keeps the file's default for the others.
        let c = DaemonConfig::load(&Sources {
            file: Some(("t.toml".into(), "[l2]\npool_pages = 7\n".into())),
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(
            c.l2,
            L2Config {
                pool_pages: 7,
                ..L2Config::default()
            }
        );
        assert_eq!(c.l3, L3Config::default());
    }

    #[test]
    fn socket_access_comes_from_file_env_and_flags_and_bad_values_name_their_key() {
        let c = DaemonConfig::load(&Sources {
            file: Some((
                "t.toml".into(),
                "[server.unix]\nmode = \"0660\"\ngid = 50\n".into(),
            )),
            env: env(&[("KVTIER_SERVER_UNIX_ALLOW_UIDS", "1000, 1001")]),
            sets: vec!["server.unix.allow_gids=7".into()],
        })
        .unwrap();
        let u = &c.server.unix;
        assert_eq!(
            (u.mode.bits(), u.group(), u.owner()),
            (0o660, Some(50), None)
        );
        assert_eq!(
            (&u.allow_uids[..], &u.allow_gids[..]),
            (&[1000, 1001][..], &[7][..])
        );
        for (set, key) in [
            ("server.unix.mode=0400", "server.unix.mode"),
            ("server.unix.mode=rw", "server.unix.mode"),
            ("server.unix.uid=-5", "server.unix.uid"),
            ("server.unix.allow_uids=alice", "server.unix.allow_uids"),
        ] {
            let e = DaemonConfig::load(&Sources {
                sets: vec![set.into()],
                ..Sources::default()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(key), "{set}: {e}");
        }
    }

    #[test]
    fn a_removed_key_is_refused_naming_what_replaced_it() {
        let file = Sources {
            file: Some((
                "t.toml".into(),
                "[l3]\nretries = 3\n[l3.s3]\nbucket = \"b\"\nretries = 2\n".into(),
            )),
            ..Sources::default()
        };
        let set = Sources {
            sets: vec!["l3.s3.retries=1".into()],
            ..Sources::default()
        };
        let env_var = Sources {
            env: env(&[("KVTIER_L3_S3_RETRIES", "1")]),
            ..Sources::default()
        };
        for src in [file, set, env_var] {
            let e = DaemonConfig::load(&src).unwrap_err().to_string();
            assert!(
                e.contains("l3.s3.retries") && e.contains("set l3.retries instead"),
                "{e}"
            );
        }
        // The key that replaced it, and a section of that name without it, are fine.
        let ok = Sources {
            file: Some(("t.toml".into(), "[l3]\nretries = 3\n".into())),
            ..Sources::default()
        };
        assert_eq!(DaemonConfig::load(&ok).unwrap().l3.retries, 3);
    }

    #[test]
    fn a_disabled_metrics_endpoint_stays_disabled_through_overrides() {
        // Review finding: written out, an unset listen was left out, and read back it took
        // the file's default (on).
        let off = DaemonConfig::load(&Sources {
            sets: vec!["metrics.listen=".into()],
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(off.metrics.listen, None);
        let again = off.with_overrides(&["l3.backend=memory".into()]).unwrap();
        assert_eq!(again.metrics.listen, None);
        assert!(off.to_redacted_toml().unwrap().contains("listen = \"\""));
    }

    #[test]
    fn overrides_apply_to_a_running_config() {
        let base = DaemonConfig::load(&Sources {
            sets: vec!["l3.backend=none".into(), "l3.s3.secret_key=s".into()],
            ..Sources::default()
        })
        .unwrap();
        let c = base
            .with_overrides(&[
                "l3.backend=memory".into(),
                "l3.memory.capacity_bytes=2MiB".into(),
            ])
            .unwrap();
        assert_eq!(
            (c.l3.backend, c.l3.memory.capacity_bytes),
            (L3Backend::Memory, ByteSize(2 << 20))
        );
        assert_eq!(
            c.l3.s3.secret_key.expose(),
            "s",
            "secrets survive the round trip"
        );
        assert_eq!(c.l2, base.l2);
        let e = base
            .with_overrides(&["l3.backend=tape".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l3.backend"), "{e}");
        // Every enum-valued setting names the key and the words it takes.
        for (set, key, word) in [
            ("l3.backend=tape", "l3.backend", "rocksdb"),
            ("l2.backing=tape", "l2.backing", "memfd"),
            ("l2.eviction_policy=random", "l2.eviction_policy", "slru"),
            (
                "prefetch.policy=eventually",
                "prefetch.policy",
                "wait_complete",
            ),
            ("sglang_rpc.l3=s3", "sglang_rpc.l3", "shared"),
            ("l3.write_policy=sometimes", "l3.write_policy", "write_back"),
        ] {
            let e = base.with_overrides(&[set.into()]).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(word), "{set}: {e}");
        }
        // A backend's section is checked, and what it requires is required when it is used.
        let e = base
            .with_overrides(&["l3.backend=s3".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l3.s3.bucket"), "{e}");
        let e = base
            .with_overrides(&["l3.backend=remote".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l3.remote.address"), "{e}");
        let s3 = base
            .with_overrides(&["l3.backend=s3".into(), "l3.s3.bucket=kv".into()])
            .unwrap();
        assert_eq!(
            (s3.l3.backend, s3.l3.s3.bucket.as_str()),
            (L3Backend::S3, "kv")
        );
        let e = base
            .with_overrides(&["l3.s3.colour=red".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l3.s3.colour"), "{e}");
    }

    #[test]
    fn keys_that_may_be_unset_are_options_and_an_empty_string_unsets_them() {
        let base = DaemonConfig::default();
        // The default file spells them "": unset.
        assert_eq!(base.l3.file.path, None);
        assert_eq!(base.l3.s3.endpoint, None);
        assert_eq!(base.l3_file_path(), base.data_dir.join("l3"));
        let set = base
            .with_overrides(&[
                "l3.file.path=/srv/l3".into(),
                "l3.rocksdb.path=".into(),
                "l3.s3.endpoint=http://127.0.0.1:7480".into(),
                "l3.s3.access_key=".into(),
            ])
            .unwrap();
        assert_eq!(set.l3.file.path, Some(PathBuf::from("/srv/l3")));
        assert_eq!(set.l3_file_path(), PathBuf::from("/srv/l3"));
        assert_eq!(set.l3.rocksdb.path, None);
        assert_eq!(set.l3.s3.endpoint.as_deref(), Some("http://127.0.0.1:7480"));
        assert_eq!(set.l3.s3.access_key, None);
        // The same for the server's keys: an address, a file, a socket, the metrics endpoint.
        let off = base
            .with_overrides(&[
                "server.tcp=".into(),
                "server.token_file=".into(),
                "server.socket=/run/k.sock".into(),
                "metrics.listen=".into(),
            ])
            .unwrap();
        assert_eq!(
            (&off.server.tcp, &off.server.token_file, &off.metrics.listen),
            (&None, &None, &None)
        );
        assert_eq!(off.socket_path(), PathBuf::from("/run/k.sock"));
        assert_eq!(base.metrics.listen.as_deref(), Some("127.0.0.1:9464"));
        let e = base
            .with_overrides(&["l3.s3.endpoint=ftp://x".into()])
            .unwrap_err()
            .to_string();
        assert!(e.contains("l3.s3.endpoint"), "{e}");
        // What each backend can do is asked of the backend, not matched by name.
        assert!(L3Backend::File.keeps_quotas() && !L3Backend::S3.keeps_quotas());
        assert_eq!(L3Backend::Rocksdb.directory_key(), Some("rocksdb.path"));
        assert_eq!(set.l3_directory(L3Backend::Memory), None);
        assert!(!L3Backend::None.stores() && L3Backend::Memory.stores());
    }

    #[test]
    fn the_dump_is_a_loadable_config_without_its_secrets() {
        let c = DaemonConfig::load(&Sources {
            sets: vec![
                "server.admin_token=hunter2".into(),
                "l3.s3.secret_key=swordfish".into(),
                "l2.max_pools=3".into(),
            ],
            ..Sources::default()
        })
        .unwrap();
        let text = c.to_redacted_toml().unwrap();
        assert!(
            !text.contains("hunter2") && !text.contains("swordfish"),
            "{text}"
        );
        let back = DaemonConfig::load(&Sources {
            file: Some(("dump".into(), text)),
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(back.l2, c.l2);
        assert_eq!(back.server.admin_token.expose(), REDACTED);
        let plain = DaemonConfig::default().to_redacted_toml().unwrap();
        assert!(
            !plain.contains(REDACTED),
            "an unset secret is shown as unset"
        );
    }

    #[test]
    fn a_tenant_token_equal_to_the_listeners_or_the_operators_is_refused_by_name() {
        for key in ["server.token", "server.admin_token"] {
            let e = DaemonConfig::load(&Sources {
                file: Some((
                    "kvtierd.toml".into(),
                    "[tenants.acme]\ntoken = \"shared-token\"\n".into(),
                )),
                sets: vec![format!("{key}=shared-token")],
                ..Sources::default()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains("tenants.acme.token") && e.contains(key), "{e}");
        }
    }

    #[test]
    fn tenant_tokens_are_redacted_from_the_dump() {
        // Before: `kvtierctl config` printed every tenant's token to any admitted peer, which
        // could then call over TCP as that tenant.
        let c = DaemonConfig::load(&Sources {
            file: Some((
                "kvtierd.toml".into(),
                "[tenants.acme]\ntoken = \"acme-secret-token\"\n\
                 [tenants.globex]\ntoken = \"globex-secret-token\"\n"
                    .into(),
            )),
            ..Sources::default()
        })
        .unwrap();
        let text = c.to_redacted_toml().unwrap();
        assert!(!text.contains("secret-token"), "{text}");
        assert_eq!(text.matches(REDACTED).count(), 2, "{text}");
    }

    #[test]
    fn secrets_are_never_printed() {
        let src = Sources {
            env: env(&[("KVTIER_L3_S3_SECRET_KEY", "hunter2")]),
            ..Sources::default()
        };
        let c = DaemonConfig::load(&src).unwrap();
        assert_eq!(c.l3.s3.secret_key.expose(), "hunter2");
        assert!(!format!("{c:?}").contains("hunter2"));
    }

    #[test]
    fn deploy_copy_is_the_default_file() {
        let deployed = include_str!("../../../deploy/kvtierd.toml");
        assert_eq!(
            deployed, DEFAULT_TOML,
            "regenerate deploy/kvtierd.toml with --print-default-config"
        );
    }

    #[test]
    fn layering_order_is_defaults_file_env_flags() {
        let file = Some((
            "kvtierd.toml".to_string(),
            "[l2]\npool_bytes = \"1GiB\"\nmax_pools = 3\neviction_policy = \"lfu\"\n".to_string(),
        ));
        let src = Sources {
            file: file.clone(),
            env: env(&[
                ("KVTIER_L2_MAX_POOLS", "5"),
                ("KVTIER_DATA_DIR", "/var/lib/kvtier"),
                ("PATH", "/bin"),
            ]),
            sets: vec!["l2.max_pools=7".into()],
        };
        let c = DaemonConfig::load(&src).unwrap();
        assert_eq!(c.l2.pool_bytes, ByteSize(1 << 30)); // file over default
        assert_eq!(c.l2.eviction_policy, PolicyKind::Lfu); // file
        assert_eq!(c.l2.max_pools, 7); // flag over env over file
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/kvtier")); // env over default
        assert_eq!(
            c.socket_path(),
            PathBuf::from("/var/lib/kvtier/kvtierd.sock")
        );
        let no_flag = DaemonConfig::load(&Sources {
            sets: vec![],
            ..src
        })
        .unwrap();
        assert_eq!(no_flag.l2.max_pools, 5); // env over file
    }

    #[test]
    fn prefetch_deadline_grows_with_tokens_up_to_the_max() {
        let p = PrefetchConfig::default();
        assert_eq!(p.deadline_for(0), Duration::from_secs(2));
        assert_eq!(p.deadline_for(10 * 1024), Duration::from_secs(3));
        assert_eq!(p.deadline_for(10_000_000), Duration::from_secs(30));
        assert_eq!(p.policy, StopPolicy::Timeout);
    }

    #[test]
    fn errors_name_the_key() {
        let cases: &[(Sources, &str)] = &[
            (
                Sources {
                    sets: vec!["l2.eviction_policy=random".into()],
                    ..Sources::default()
                },
                "l2.eviction_policy",
            ),
            (
                Sources {
                    sets: vec!["sessions.ttl=1ms".into()],
                    ..Sources::default()
                },
                "sessions.ttl",
            ),
            (
                Sources {
                    sets: vec!["metrics.hit_ceiling_window=10ms".into()],
                    ..Sources::default()
                },
                "metrics.hit_ceiling_window",
            ),
            (
                Sources {
                    sets: vec!["l3.file.capacity_bytes=150%".into()],
                    ..Sources::default()
                },
                "l3.file.capacity_bytes",
            ),
            (
                Sources {
                    env: env(&[("KVTIER_L2_MAX_POOLS", "many")]),
                    ..Sources::default()
                },
                "KVTIER_L2_MAX_POOLS",
            ),
            (
                Sources {
                    env: env(&[("KVTIER_L2_POOLBYTES", "1G")]),
                    ..Sources::default()
                },
                "KVTIER_L2_POOLBYTES",
            ),
            (
                Sources {
                    sets: vec!["l2.backing=tape".into()],
                    ..Sources::default()
                },
                "l2.backing",
            ),
            (
                Sources {
                    sets: vec!["metrics.listen=nowhere".into()],
                    ..Sources::default()
                },
                "metrics.listen",
            ),
            (
                Sources {
                    sets: vec!["l3.kind=s3".into()],
                    ..Sources::default()
                },
                "l3.kind",
            ),
            (
                Sources {
                    sets: vec!["l2.dirty_fraction=0".into()],
                    ..Sources::default()
                },
                "l2.dirty_fraction",
            ),
            (
                Sources {
                    sets: vec!["l3.write_policy=write_whenever".into()],
                    ..Sources::default()
                },
                "l3.write_policy",
            ),
            (
                Sources {
                    sets: vec!["prefetch.policy=eventually".into()],
                    ..Sources::default()
                },
                "prefetch.policy",
            ),
            (
                Sources {
                    sets: vec!["prefetch.budget_fraction=1.5".into()],
                    ..Sources::default()
                },
                "prefetch.budget_fraction",
            ),
            (
                Sources {
                    env: env(&[("KVTIER_PREFETCH_CONCURRENCY", "0")]),
                    ..Sources::default()
                },
                "prefetch.concurrency",
            ),
            (
                Sources {
                    sets: vec![
                        "prefetch.concurrency=32".into(),
                        "prefetch.max_concurrency=16".into(),
                    ],
                    ..Sources::default()
                },
                "prefetch.max_concurrency",
            ),
            (
                Sources {
                    sets: vec!["prefetch.timeout_max=0s".into()],
                    ..Sources::default()
                },
                "prefetch.timeout_max",
            ),
            (
                Sources {
                    sets: vec!["sglang_rpc.l3=s3".into()],
                    ..Sources::default()
                },
                "sglang_rpc.l3",
            ),
            (
                Sources {
                    sets: vec![
                        "sglang_rpc.enable=true".into(),
                        "sglang_rpc.l3=none".into(),
                        "sglang_rpc.memory_bytes=0B".into(),
                    ],
                    ..Sources::default()
                },
                "sglang_rpc.memory_bytes",
            ),
            (
                Sources {
                    sets: vec!["sglang_rpc.max_batch=0".into()],
                    ..Sources::default()
                },
                "sglang_rpc.max_batch",
            ),
            (
                Sources {
                    file: Some(("f.toml".into(), "[l2]\npool_bytez = 1\n".into())),
                    ..Sources::default()
                },
                "pool_bytez",
            ),
            (
                Sources {
                    file: Some(("f.toml".into(), "[l2]\npool_bytes = \"lots\"\n".into())),
                    ..Sources::default()
                },
                "pool_bytes",
            ),
        ];
        for (src, key) in cases {
            let err = DaemonConfig::load(src).unwrap_err().to_string();
            assert!(err.contains(key), "error {err:?} does not name {key}");
        }
    }
}
