//! kvtierd: the per-node daemon of kvtier. It owns the host tier (L2): one shared-memory page
//! pool per layout class that every agent on the node maps, its index, and the client
//! sessions that pin and reserve pages in it; it serves the `kvtier.v1.HostTier` gRPC service
//! on a Unix socket (and optionally TCP), `grpc.health.v1`, server reflection, and a
//! Prometheus text endpoint.
//!
//! [`run`] is the whole daemon; `main.rs` only parses flags, loads the configuration, starts
//! logging and calls it, and tests start the same `run` in-process or the binary as a process.

pub mod admin;
pub mod ids;
pub mod l3;
pub mod prefetch;
pub mod roles;
pub mod sealer;
pub mod service;
pub mod sglang;
pub mod state;
pub mod storage_service;
pub mod wire;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::DaemonConfig;
use kvtier_proto::v1::host_tier_server::HostTierServer;
use kvtier_server::peers::{GatedListener, PeerGate};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::service::HostService;
use crate::state::{HostState, Shared};
use kvtier_server::metrics::MetricRegistry;

/// Where a started daemon can be reached.
#[derive(Debug, Clone)]
pub struct Ready {
    /// The control socket.
    pub socket: PathBuf,
    /// The TCP control address, if enabled.
    pub tcp: Option<SocketAddr>,
    /// The metrics endpoint, if enabled.
    pub metrics: Option<SocketAddr>,
}

/// Why the daemon could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A socket or directory could not be set up.
    #[error("{what} {path}: {source}")]
    Setup {
        /// What was being set up.
        what: &'static str,
        /// Where.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another daemon answers on the socket.
    #[error("another kvtierd is serving {0}; stop it or choose another server.socket")]
    SocketInUse(String),
    /// The gRPC server failed.
    #[error("grpc server: {0}")]
    Server(#[from] tonic::transport::Error),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
}

impl From<kvtier_server::serving::BindError> for DaemonError {
    fn from(e: kvtier_server::serving::BindError) -> Self {
        use kvtier_server::serving::BindError;
        match e {
            BindError::InUse(p) => DaemonError::SocketInUse(p),
            BindError::Io { what, path, source } => DaemonError::Setup { what, path, source },
        }
    }
}

impl DaemonError {
    /// Start-up errors are not retryable without a change; a server error may be.
    pub fn is_retryable(&self) -> bool {
        matches!(self, DaemonError::Server(_))
    }
}

fn setup(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DaemonError {
    let path = path.display().to_string();
    move |source| DaemonError::Setup { what, path, source }
}

/// The TCP listener's TLS settings (`server.tls_*`), read from their files.
fn server_tls(
    cfg: &DaemonConfig,
) -> Result<Option<tonic::transport::ServerTlsConfig>, DaemonError> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let s = &cfg.server;
    if s.tls_cert.is_empty() {
        return Ok(None);
    }
    kvtier_client::install_crypto_provider();
    let read =
        |what: &'static str, path: &str| std::fs::read(path).map_err(setup(what, Path::new(path)));
    let identity = Identity::from_pem(
        read("reading server.tls_cert", &s.tls_cert)?,
        read("reading server.tls_key", &s.tls_key)?,
    );
    // A client that never finishes its handshake is closed (and its descriptor freed).
    let mut tls = ServerTlsConfig::new()
        .identity(identity)
        .timeout(cfg.server.connections.handshake_timeout.0);
    if !s.tls_client_ca.is_empty() {
        tls = tls.client_ca_root(Certificate::from_pem(read(
            "reading server.tls_client_ca",
            &s.tls_client_ca,
        )?));
    }
    Ok(Some(tls))
}

/// Binds a socket, replacing a stale socket file but never a live server's, with
/// `[server.unix]`'s file mode, owner and peer allow-list.
async fn bind_socket(
    gate: &PeerGate,
    path: &Path,
    name: &'static str,
) -> Result<GatedListener, DaemonError> {
    Ok(gate.bind(path, name).await?)
}

/// Runs the daemon until `shutdown` is cancelled, then drains in-flight requests, removes
/// the socket and unmaps (and unlinks) every pool. `ready` is called once everything listens.
pub async fn run(
    cfg: DaemonConfig,
    shutdown: CancellationToken,
    ready: impl FnOnce(Ready) + Send,
) -> Result<(), DaemonError> {
    let socket = cfg.socket_path();
    let tenants = cfg.tenants().map_err(|e| DaemonError::Setup {
        what: "reading the tokens of",
        path: "[tenants]".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    std::fs::create_dir_all(&cfg.data_dir).map_err(setup("creating data_dir", &cfg.data_dir))?;
    // Each component declares its own series here.
    let metrics = MetricRegistry::new();
    let gate = PeerGate::new(&cfg.server.unix, &cfg.server.connections, &metrics)?;
    // Who is the operator, a peer or which tenant, on every socket and listener.
    let roles = Arc::new(
        roles::Roles::new(
            &cfg,
            tenants.clone(),
            rustix::process::geteuid().as_raw(),
            &metrics,
        )
        .map_err(|e| DaemonError::Setup {
            what: "deciding the roles of",
            path: "[server.admin] and [tenants]".into(),
            source: std::io::Error::other(e.to_string()),
        })?,
    );
    let uds = bind_socket(&gate, &socket, "control").await?;
    let tcp = match cfg.server.tcp.as_str() {
        "" => None,
        a => Some(
            TcpListener::bind(a)
                .await
                .map_err(setup("binding server.tcp", Path::new(a)))?,
        ),
    };
    let metrics_listener = kvtier_server::prometheus_http::bind(&cfg.metrics.listen)
        .await
        .map_err(setup(
            "binding metrics.listen",
            Path::new(&cfg.metrics.listen),
        ))?;
    let metrics_addr = metrics_listener
        .as_ref()
        .and_then(kvtier_server::prometheus_http::local);

    let state = Arc::new(Shared::new(HostState::new(&cfg)));
    state.lock().set_tenants(tenants.quotas());
    {
        // Before serving: the pools of a kvtierd that crashed are taken over (or removed).
        let mut st = state.lock();
        let counts = state::take_over_dead_pools(&cfg, &mut st);
        st.counters.takeover = counts;
    }
    let l3 = l3::L3Slot::new(
        state.clone(),
        &metrics,
        shutdown.clone(),
        cfg.server.drain_timeout.0,
    )?;
    l3.attach(&cfg).await.map_err(|e| DaemonError::Setup {
        what: "opening the l3 backend",
        path: cfg.l3.backend.to_string(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let prefetcher = Arc::new(prefetch::Prefetcher::new(
        cfg.prefetch.clone(),
        state.clone(),
        l3.clone(),
        &metrics,
        shutdown.clone(),
        cfg.server.max_batch as usize,
    )?);
    let sglang_metrics = sglang::SglangMetrics::new(&metrics)?;
    let service = HostService::new(
        state.clone(),
        metrics.clone(),
        cfg.server.max_batch as usize,
        metrics_addr.map(|a| a.to_string()).unwrap_or_default(),
        l3.clone(),
        prefetcher,
        shutdown.clone(),
    )?
    .with_roles(roles.clone());

    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<HostTierServer<HostService>>().await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(kvtier_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| DaemonError::Setup {
            what: "reflection",
            path: String::new(),
            source: std::io::Error::other(e),
        })?;

    let tracker = TaskTracker::new();
    // Peers and the operator only (`roles`).
    let objects = tonic::service::interceptor::InterceptedService::new(
        kvtier_proto::v1::object_storage_server::ObjectStorageServer::new(
            storage_service::ObjectStorageService::new(l3.clone()),
        )
        .max_decoding_message_size(kvtier_storage::remote::MAX_CHUNK + 4096)
        .max_encoding_message_size(kvtier_storage::remote::MAX_CHUNK + 4096),
        roles.guard(roles::Door::Objects),
    );
    // kvtierd's memory of SGLang objects, when it serves SGLang (the admin clears it with L2).
    let sglang_memory = cfg.sglang_rpc.enable.then(|| {
        Arc::new(sglang::ObjectCache::new(
            cfg.sglang_rpc.memory_bytes.0,
            Some(sglang_metrics.cache.clone()),
        ))
    });
    let admin = admin::AdminService::new(
        l3.clone(),
        state.clone(),
        sglang_memory.clone(),
        health.clone(),
        cfg.clone(),
    );
    let admin_token = cfg.server.admin_token.expose().to_string();
    // The operator only (`roles`): on the socket by uid, anywhere by server.admin_token.
    let admin_server = kvtier_proto::v1::admin_server::AdminServer::with_interceptor(
        admin.clone(),
        roles.guard(roles::Door::Admin),
    );
    let router = || {
        kvtier_server::serving::grpc_server()
            .add_service(HostTierServer::new(service.clone()))
            .add_service(health_service.clone())
            .add_service(reflection.clone())
            .add_service(objects.clone())
    };

    // Control plane on the Unix socket (and TCP when configured).
    let uds_task = {
        let stop = shutdown.clone();
        let server = router()
            .add_service(admin_server.clone())
            .serve_with_incoming_shutdown(uds.incoming(), async move {
                stop.cancelled().await;
            });
        tracker.spawn(server)
    };
    let tcp_addr = tcp.as_ref().and_then(|l| l.local_addr().ok());
    // Declared whether or not TCP is on, so the series always exists (0 without TCP).
    let denials = kvtier_server::serving::RequireBearer::new(&[], &metrics)?;
    let tcp_task = match tcp {
        None => None,
        Some(l) => {
            let stop = shutdown.clone();
            // Under the same connection limits as the sockets (per IP address), with
            // TCP_NODELAY; a TLS handshake gets the handshake timeout too.
            let incoming = kvtier_server::conn::tcp_incoming(
                l,
                kvtier_server::conn::Cap::new(
                    &cfg.server.connections,
                    "control_tcp",
                    gate.conn_metrics(),
                ),
            );
            // Admin over TCP only with its own token (which also passes the call check).
            let admin_tcp = (!admin_token.is_empty()).then(|| admin_server.clone());
            let token = cfg.server.tcp_token().map_err(|e| DaemonError::Setup {
                what: "reading the token of",
                path: "server.token".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
            let mut server = kvtier_server::serving::grpc_server();
            if let Some(tls) = server_tls(&cfg)? {
                server = server.tls_config(tls)?;
            }
            let peer_token = cfg.server.peer_token().map_err(|e| DaemonError::Setup {
                what: "reading the token of",
                path: "server.peer_token".into(),
                source: std::io::Error::other(e.to_string()),
            })?;
            // server.token, the admin and peer tokens and every tenant's token pass the call
            // check; what each may do is the roles' business.
            let check = token.map(|t| {
                let mut accepted: Vec<&str> = vec![&t, &admin_token];
                accepted.extend(peer_token.as_deref());
                accepted.extend(tenants.tokens());
                denials.with_tokens(&accepted)
            });
            let mut layered = server.layer(tower::util::option_layer(check));
            Some(
                tracker.spawn(
                    layered
                        .add_service(HostTierServer::new(service.clone()))
                        .add_service(health_service.clone())
                        .add_service(reflection.clone())
                        .add_service(objects.clone())
                        .add_optional_service(admin_tcp)
                        .serve_with_incoming_shutdown(
                            incoming,
                            async move { stop.cancelled().await },
                        ),
                ),
            )
        }
    };
    if let Some(l) = metrics_listener {
        let metrics = metrics.clone();
        tracker.spawn(kvtier_server::prometheus_http::serve(
            l,
            Arc::new(move || metrics.render()),
            shutdown.clone(),
        ));
    }
    // Sealer: checksums committed pages off the state lock and seals their slot records,
    // so the pools survive a crash (on its own thread: `sealer.rs`).
    if state.lock().seals_enabled() {
        let sealer = sealer::start(state.clone(), shutdown.clone())
            .map_err(setup("start the sealer thread", Path::new("")))?;
        tracker.spawn(sealer);
    }
    // Lease sweeper: ends sessions that stopped heartbeating.
    {
        let state = state.clone();
        let stop = shutdown.clone();
        let period = (cfg.sessions.ttl.0 / 4).max(Duration::from_millis(20));
        tracker.spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tokio::select! {
                    () = stop.cancelled() => return,
                    _ = tick.tick() => {
                        state.lock().expire(Instant::now());
                    }
                }
            }
        });
    }
    // SGLang's HiCache RPC storage protocol, when enabled.
    let sglang_sockets = if cfg.sglang_rpc.enable {
        let (reg_path, grpc_path) = (cfg.sglang_mempool_socket(), cfg.sglang_grpc_socket());
        let reg = bind_socket(&gate, &reg_path, "sglang_mempool").await?;
        let grpc = bind_socket(&gate, &grpc_path, "sglang_grpc").await?;
        let pools = Arc::new(sglang::Pools::with_gauge(sglang_metrics.pools.clone()));
        tracker.spawn(sglang::serve_registrations(
            reg,
            pools.clone(),
            shutdown.clone(),
        ));
        let memory = sglang_memory.clone().unwrap_or_else(|| {
            Arc::new(sglang::ObjectCache::new(
                cfg.sglang_rpc.memory_bytes.0,
                Some(sglang_metrics.cache.clone()),
            ))
        });
        let svc = kvtier_proto::sglang::storage_server_server::StorageServerServer::new(
            sglang::StorageService::new(
                &cfg.sglang_rpc,
                pools,
                l3.clone(),
                memory,
                sglang_metrics.clone(),
                shutdown.clone(),
            ),
        )
        .max_decoding_message_size(512 << 20)
        .max_encoding_message_size(512 << 20);
        let stop = shutdown.clone();
        tracker.spawn(
            kvtier_server::serving::grpc_server()
                .add_service(svc)
                // Through the relay that makes grpcio's `:authority` acceptable to h2.
                .serve_with_incoming_shutdown(
                    sglang::grpc_incoming(grpc, shutdown.clone(), Arc::new(tenants.clone())),
                    async move { stop.cancelled().await },
                ),
        );
        tracing::info!(mempool = %reg_path.display(), grpc = %grpc_path.display(), "serving SGLang's HiCache RPC storage protocol");
        vec![reg_path, grpc_path]
    } else {
        Vec::new()
    };
    tracker.close();

    tracing::info!(
        socket = %socket.display(),
        tcp = ?tcp_addr,
        metrics = ?metrics_addr,
        "kvtierd serving"
    );
    ready(Ready {
        socket: socket.clone(),
        tcp: tcp_addr,
        metrics: metrics_addr,
    });

    shutdown.cancelled().await;
    health
        .set_not_serving::<HostTierServer<HostService>>()
        .await;
    tracing::info!("shutting down: draining in-flight requests");
    // Graceful first: in-flight requests finish and connections close. A client that never
    // closes its connection (or a wedged task) must not keep the daemon alive: after the
    // drain deadline the servers are aborted.
    let drain = cfg.server.drain_timeout.0;
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        tracing::warn!(
            ?drain,
            "connections still open after the drain deadline; closing them"
        );
        uds_task.abort();
        if let Some(t) = &tcp_task {
            t.abort();
        }
    }
    let result = match uds_task.await {
        Ok(r) => r.map_err(DaemonError::from),
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => {
            tracing::error!("control server task failed: {e}");
            Ok(())
        }
    };
    if let Some(t) = tcp_task
        && let Ok(Err(e)) = t.await
    {
        tracing::warn!("tcp server ended with: {e}");
    }
    for p in &sglang_sockets {
        let _ = std::fs::remove_file(p);
    }
    if let Err(e) = std::fs::remove_file(&socket) {
        tracing::warn!(socket = %socket.display(), "could not remove the socket: {e}");
    }
    // Unlink every pool now, even if a connection task aborted above still holds the state;
    // the memory itself goes when the last mapping does.
    drop(service);
    for pool in state.lock().pools() {
        pool.shm.unlink();
    }
    drop(state);
    tracing::info!("kvtierd stopped");
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_declared_once_and_documented() {
        let cfg = DaemonConfig::default();
        let registry = MetricRegistry::new();
        let state = Arc::new(Shared::new(HostState::new(&cfg)));
        let stop = CancellationToken::new();
        let l3 = l3::L3Slot::new(state.clone(), &registry, stop.clone(), Duration::ZERO).unwrap();
        let prefetcher = Arc::new(
            prefetch::Prefetcher::new(
                cfg.prefetch.clone(),
                state.clone(),
                l3.clone(),
                &registry,
                stop.clone(),
                16,
            )
            .unwrap(),
        );
        HostService::new(
            state,
            registry.clone(),
            16,
            String::new(),
            l3,
            prefetcher,
            stop,
        )
        .unwrap();
        sglang::SglangMetrics::new(&registry).unwrap();
        kvtier_server::serving::RequireBearer::new(&["t"], &registry).unwrap();
        PeerGate::new(&cfg.server.unix, &cfg.server.connections, &registry).unwrap();
        roles::Roles::new(
            &cfg,
            kvtier_config::tenants::Tenants::default(),
            u32::MAX,
            &registry,
        )
        .unwrap();
        let doc = include_str!("../../../docs/metrics.md");
        let wrong = registry.check_documented(doc, |n| !n.starts_with("kvtier_agent_"));
        assert!(wrong.is_empty(), "{wrong:#?}");
        // The scrape hooks run without an attached tier.
        assert!(registry.render().contains("kvtier_l2_pools 0"));
    }
}
