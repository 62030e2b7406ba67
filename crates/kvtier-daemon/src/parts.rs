//! The parts kvtierd is built from, each started from one context ([`Ctx`]: the
//! configuration, the metrics registry every component declares its series in, the shutdown
//! token and the task tracker the drain waits on):
//!
//! - [`Listeners`]: the control socket, the TCP listener and the metrics listener, bound first
//!   so a second kvtierd on the same socket fails before touching anything;
//! - [`Core`]: the host state (with the crash takeover done), the storage tier, the
//!   prefetcher and the roles;
//! - [`Sglang`]: SGLang's protocol, its metrics and object memory (which the admin clears);
//! - [`Control`]: the gRPC services of the control plane on the socket and over TCP, and the
//!   staged drain at shutdown;
//! - [`spawn_upkeep`] (the sealer and the lease sweeper) and [`spawn_metrics`].
//!
//! A new subsystem is one more part: built from the context, its tasks on the tracker, and
//! what it serves added where `run` wires the parts together.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::DaemonConfig;
use kvtier_config::tenants::Tenants;
use kvtier_proto::v1::host_tier_server::HostTierServer;
use kvtier_server::doors::Listener;
use kvtier_server::guard::GuardMetrics;
use kvtier_server::metrics::MetricRegistry;
use kvtier_server::peers::{GatedListener, PeerGate};
use kvtier_server::tasks::Tasks;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::l3::L3Slot;
use crate::prefetch::Prefetcher;
use crate::roles::Roles;
use crate::service::{HostService, HostTierRoutes};
use crate::state::{HostState, Shared};
use crate::{DaemonError, admin, pool_door, sealer, sglang, state, storage_service};

/// What every part starts from.
pub(crate) struct Ctx {
    /// The configuration kvtierd started with.
    pub(crate) cfg: DaemonConfig,
    /// The registry every component declares its series in.
    pub(crate) metrics: MetricRegistry,
    /// Every task, and the shutdown that stops them; the drain waits on them.
    pub(crate) tasks: Tasks,
}

fn setup(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> DaemonError {
    let path = path.display().to_string();
    move |source| DaemonError::Setup { what, path, source }
}

/// A configuration that validation passed but that cannot be used (a token file gone, ...).
fn config(what: &'static str, key: &str, e: impl std::fmt::Display) -> DaemonError {
    DaemonError::Setup {
        what,
        path: key.to_string(),
        source: std::io::Error::other(e.to_string()),
    }
}

impl Ctx {
    /// The context of a daemon with `cfg`; creates its data directory, and refuses one that
    /// another uid could change (its sockets and L3 live there: whoever can rename them can
    /// stand in for kvtierd, or swap its objects).
    pub(crate) fn new(cfg: DaemonConfig, shutdown: CancellationToken) -> Result<Self, DaemonError> {
        std::fs::create_dir_all(&cfg.data_dir)
            .map_err(setup("creating data_dir", &cfg.data_dir))?;
        kvtier_shm::check_trusted_dir(&cfg.data_dir).map_err(|e| DaemonError::Setup {
            what: "trusting data_dir",
            path: cfg.data_dir.display().to_string(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Self {
            cfg,
            metrics: MetricRegistry::new(),
            tasks: Tasks::new(shutdown),
        })
    }
}

/// Every listener, bound.
pub(crate) struct Listeners {
    /// Who may use the Unix sockets, and their connection caps.
    pub(crate) gate: PeerGate,
    /// The control socket.
    pub(crate) uds: GatedListener,
    /// The pool door's socket.
    pub(crate) pools: GatedListener,
    /// The TCP listener, if enabled.
    pub(crate) tcp: Option<TcpListener>,
    /// The metrics endpoint's listener, if enabled.
    pub(crate) metrics: Option<TcpListener>,
}

impl Listeners {
    /// Binds the control socket (never over a live server's), the TCP listener and the
    /// metrics listener.
    pub(crate) async fn bind(ctx: &Ctx) -> Result<Self, DaemonError> {
        let cfg = &ctx.cfg;
        // Every listener this kvtierd serves gets an equal share of its descriptors.
        let listeners = 2
            + u32::from(cfg.server.tcp.is_some())
            + u32::from(cfg.metrics.listen.is_some())
            + if cfg.sglang_rpc.enable { 2 } else { 0 };
        let limits = kvtier_server::conn::fit_to_descriptors(&cfg.server.connections, listeners);
        let gate = PeerGate::new(&cfg.server.unix, &limits, &ctx.metrics)?;
        let uds = gate.bind(&cfg.socket_path(), Listener::Control).await?;
        let pools = gate.bind(&cfg.pool_socket(), Listener::PoolDoor).await?;
        let tcp = match cfg.server.tcp.as_deref() {
            None => None,
            Some(a) => Some(
                TcpListener::bind(a)
                    .await
                    .map_err(setup("binding server.tcp", Path::new(a)))?,
            ),
        };
        let listen = cfg.metrics.listen.as_deref();
        let metrics = kvtier_server::prometheus_http::bind(listen)
            .await
            .map_err(setup(
                "binding metrics.listen",
                Path::new(listen.unwrap_or_default()),
            ))?;
        Ok(Self {
            gate,
            uds,
            pools,
            tcp,
            metrics,
        })
    }
}

/// The host tier and what serves it.
pub(crate) struct Core {
    /// The host state every service and task shares.
    pub(crate) state: Arc<Shared>,
    l3: Arc<L3Slot>,
    prefetcher: Arc<Prefetcher>,
    roles: Arc<Roles>,
    /// The refusal counters of every gRPC server's guard.
    guards: GuardMetrics,
    tenants: Tenants,
}

impl Core {
    /// The state (the pools of a kvtierd that crashed taken over before anything serves),
    /// the storage tier attached, the prefetcher, and the roles.
    pub(crate) async fn start(ctx: &Ctx) -> Result<Self, DaemonError> {
        let cfg = &ctx.cfg;
        let tenants = cfg
            .tenants()
            .map_err(|e| config("reading the tokens of", "[tenants]", e))?;
        // Who is the operator, a peer or which tenant, on every socket and listener.
        let roles = Roles::new(cfg, tenants.clone(), rustix::process::geteuid().as_raw())
            .map_err(|e| config("deciding the roles of", "[server.admin] and [tenants]", e))?;
        let state = HostState::new(cfg)
            .map_err(|e| config("using kvtierd's own pool directory in", "l2.shm_dir", e))?;
        let state = Arc::new(Shared::new(state));
        {
            let mut st = state.lock();
            st.set_tenants(tenants.quotas());
            let counts = state::take_over_dead_pools(cfg, &mut st);
            st.counters.takeover = counts;
        }
        let l3 = L3Slot::new(
            state.clone(),
            &ctx.metrics,
            ctx.tasks.clone(),
            cfg.server.drain_timeout.0,
        )?;
        l3.attach(cfg)
            .await
            .map_err(|e| config("opening the l3 backend", &cfg.l3.backend.to_string(), e))?;
        let prefetcher = Arc::new(Prefetcher::new(
            cfg.prefetch.clone(),
            state.clone(),
            l3.clone(),
            &ctx.metrics,
            ctx.tasks.clone(),
            cfg.server.max_batch as usize,
        )?);
        Ok(Self {
            state,
            l3,
            prefetcher,
            roles: Arc::new(roles),
            guards: GuardMetrics::new(&ctx.metrics, kvtier_server::doors::Server::Kvtierd)?,
            tenants,
        })
    }
}

impl Core {
    /// Serves the pool door on `listener` (`pool_door.rs`).
    pub(crate) fn serve_pool_door(
        &self,
        ctx: &Ctx,
        listener: GatedListener,
    ) -> Result<(), DaemonError> {
        let metrics = pool_door::DoorMetrics::new(&ctx.metrics)?;
        ctx.tasks.spawn(pool_door::serve(
            listener,
            self.state.clone(),
            self.roles.clone(),
            metrics,
            ctx.tasks.clone(),
        ));
        Ok(())
    }
}

/// SGLang's HiCache RPC protocol: its series always, its sockets when enabled.
pub(crate) struct Sglang {
    metrics: sglang::SglangMetrics,
}

impl Sglang {
    pub(crate) fn new(ctx: &Ctx) -> Result<Self, DaemonError> {
        let metrics = sglang::SglangMetrics::new(&ctx.metrics)?;
        Ok(Self { metrics })
    }

    /// Binds SGLang's two sockets and serves them, when enabled; returns their paths.
    pub(crate) async fn serve(
        self,
        ctx: &Ctx,
        gate: &PeerGate,
        core: &Core,
    ) -> Result<Vec<PathBuf>, DaemonError> {
        if !ctx.cfg.sglang_rpc.enable {
            return Ok(Vec::new());
        }
        // kvtierd's memory of SGLang objects: its own L2 pages (the admin clears them with L2).
        let memory = Arc::new(sglang::ObjectPages::new(
            core.state.clone(),
            ctx.cfg.sglang_rpc.memory_bytes.0,
            Some(self.metrics.memory.clone()),
        ));
        memory.adopt();
        memory.report();
        let cfg = &ctx.cfg;
        let (reg_path, grpc_path) = (cfg.sglang_mempool_socket(), cfg.sglang_grpc_socket());
        let reg = gate.bind(&reg_path, Listener::SglangMempool).await?;
        let grpc = gate.bind(&grpc_path, Listener::SglangGrpc).await?;
        let pools = Arc::new(sglang::Pools::with_gauge(self.metrics.pools.clone()));
        ctx.tasks.spawn(sglang::serve_registrations(
            reg,
            pools.clone(),
            ctx.tasks.clone(),
        ));
        let svc = kvtier_proto::sglang::storage_server_server::StorageServerServer::new(
            sglang::StorageService::new(
                &cfg.sglang_rpc,
                pools,
                core.l3.clone(),
                memory,
                cfg.l2.max_page_bytes.0,
                self.metrics,
                ctx.tasks.shutdown.clone(),
            ),
        )
        .max_decoding_message_size(512 << 20)
        .max_encoding_message_size(512 << 20);
        let stop = ctx.tasks.shutdown.clone();
        // Through the relay that makes grpcio's `:authority` acceptable to h2, and binds
        // each connection to its peer.
        let incoming = sglang::grpc_incoming(grpc, &ctx.tasks, Arc::new(core.tenants.clone()));
        // Engines only, by the doors table; the relay names each call's tenant.
        let guard = kvtier_server::guard::Guard::new(
            Listener::SglangGrpc,
            Arc::new(|_, headers| sglang::relayed_caller(headers)),
            core.roles.one_trust_domain(),
            &core.guards,
        );
        ctx.tasks.spawn(
            kvtier_server::serving::grpc_server()
                .layer(guard)
                .add_service(svc)
                .serve_with_incoming_shutdown(incoming, async move { stop.cancelled().await }),
        );
        tracing::info!(mempool = %reg_path.display(), grpc = %grpc_path.display(), "serving SGLang's HiCache RPC storage protocol");
        Ok(vec![reg_path, grpc_path])
    }
}

/// The control plane: its servers, and what the drain needs.
pub(crate) struct Control {
    uds: JoinHandle<Result<(), tonic::transport::Error>>,
    tcp: Option<JoinHandle<Result<(), tonic::transport::Error>>>,
    health: tonic_health::server::HealthReporter,
    /// The TCP listener's address, if enabled.
    pub(crate) tcp_addr: Option<SocketAddr>,
    /// The metrics endpoint's address, if enabled.
    pub(crate) metrics_addr: Option<SocketAddr>,
}

/// The TCP listener's TLS settings (`server.tls_*`), read from their files; a handshake that
/// does not finish within the handshake timeout is closed (its descriptor freed).
fn server_tls(
    cfg: &DaemonConfig,
) -> Result<Option<tonic::transport::ServerTlsConfig>, DaemonError> {
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let s = &cfg.server;
    let (Some(cert), Some(key)) = (&s.tls_cert, &s.tls_key) else {
        // Validation refuses one without the other.
        return Ok(None);
    };
    kvtier_client::install_crypto_provider();
    let read = |what: &'static str, path: &Path| std::fs::read(path).map_err(setup(what, path));
    let identity = Identity::from_pem(
        read("reading server.tls_cert", cert)?,
        read("reading server.tls_key", key)?,
    );
    let mut tls = ServerTlsConfig::new()
        .identity(identity)
        .timeout(cfg.server.connections.handshake_timeout.0);
    if let Some(ca) = &s.tls_client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(read(
            "reading server.tls_client_ca",
            ca,
        )?));
    }
    Ok(Some(tls))
}

impl Control {
    /// Serves HostTier, health, reflection and ObjectStorage (peers and the operator only)
    /// with Admin (the operator only) on the control socket, and over TCP when configured.
    pub(crate) async fn serve(
        ctx: &Ctx,
        core: &Core,
        gate: &PeerGate,
        uds: GatedListener,
        tcp: Option<TcpListener>,
        metrics_addr: Option<SocketAddr>,
    ) -> Result<Self, DaemonError> {
        let cfg = &ctx.cfg;
        let host = HostService::new(
            core.state.clone(),
            ctx.metrics.clone(),
            cfg.server.max_batch as usize,
            metrics_addr.map(|a| a.to_string()).unwrap_or_default(),
            core.l3.clone(),
            core.prefetcher.clone(),
            ctx.tasks.clone(),
        )?
        .with_roles(core.roles.clone())
        .with_max_streams(cfg.server.max_streams_per_caller)
        .with_hit_ceiling_window(cfg.metrics.hit_ceiling_window.0)
        .with_pool_socket(cfg.pool_socket());
        let (health, health_service) = tonic_health::server::health_reporter();
        health.set_serving::<HostTierServer<HostService>>().await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(kvtier_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| config("reflection", "", e))?;
        let objects = kvtier_proto::v1::object_storage_server::ObjectStorageServer::new(
            storage_service::ObjectStorageService::new(core.l3.clone()),
        )
        .max_decoding_message_size(kvtier_storage::remote::MAX_CHUNK + 4096)
        .max_encoding_message_size(kvtier_storage::remote::MAX_CHUNK + 4096);
        let admin = kvtier_proto::v1::admin_server::AdminServer::new(admin::AdminService::new(
            core.l3.clone(),
            core.state.clone(),
            health.clone(),
            cfg.clone(),
        ));
        // Who may call what, on either listener: the doors table, through the guard.
        let on_socket = core.roles.guard(None, &core.guards);
        let router = || {
            kvtier_server::serving::grpc_server()
                .layer(on_socket.clone())
                .add_service(HostTierRoutes::new(host.clone()))
                .add_service(health_service.clone())
                .add_service(reflection.clone())
                .add_service(objects.clone())
        };
        let stop = ctx.tasks.shutdown.clone();
        let uds = ctx.tasks.spawn(
            router()
                .add_service(admin.clone())
                .serve_with_incoming_shutdown(uds.incoming(), async move {
                    stop.cancelled().await;
                }),
        );
        let (tcp, tcp_addr) = match tcp {
            None => (None, None),
            Some(l) => {
                let addr = l.local_addr().ok();
                // Under the same connection limits as the sockets (per IP address), with
                // TCP_NODELAY.
                let incoming = kvtier_server::conn::tcp_incoming(
                    l,
                    kvtier_server::conn::Cap::new(
                        gate.limits(),
                        Listener::ControlTcp,
                        gate.conn_metrics(),
                    ),
                );
                let token_required = cfg
                    .server
                    .tcp_token()
                    .map_err(|e| config("reading the token of", "server.token", e))?
                    .is_some();
                let mut server = kvtier_server::serving::grpc_server();
                if let Some(tls) = server_tls(cfg)? {
                    server = server.tls_config(tls)?;
                }
                // Where server.token is set, a caller must present it, the admin or a peer
                // token, or a tenant's; what each may then call is its row in the doors
                // table (Admin: only with the admin token).
                let over_tcp = core.roles.guard(Some(token_required), &core.guards);
                let stop = ctx.tasks.shutdown.clone();
                let mut layered = server.layer(over_tcp);
                let task = ctx.tasks.spawn(
                    layered
                        .add_service(HostTierRoutes::new(host.clone()))
                        .add_service(health_service.clone())
                        .add_service(reflection.clone())
                        .add_service(objects.clone())
                        .add_service(admin.clone())
                        .serve_with_incoming_shutdown(
                            incoming,
                            async move { stop.cancelled().await },
                        ),
                );
                (Some(task), addr)
            }
        };
        Ok(Self {
            uds,
            tcp,
            health,
            tcp_addr,
            metrics_addr,
        })
    }

    /// Stops serving: readiness probes see NOT_SERVING, in-flight requests get
    /// `server.drain_timeout` to finish, then every connection still open is closed (a
    /// client that never closes, or a wedged task, must not keep the daemon alive).
    pub(crate) async fn drain(self, ctx: &Ctx) -> Result<(), DaemonError> {
        self.health
            .set_not_serving::<HostTierServer<HostService>>()
            .await;
        tracing::info!("shutting down: draining in-flight requests");
        let drain = ctx.cfg.server.drain_timeout.0;
        if tokio::time::timeout(drain, ctx.tasks.wait()).await.is_err() {
            tracing::warn!(
                ?drain,
                "connections still open after the drain deadline; closing them"
            );
            self.uds.abort();
            if let Some(t) = &self.tcp {
                t.abort();
            }
        }
        let result = match self.uds.await {
            Ok(r) => r.map_err(DaemonError::from),
            Err(e) if e.is_cancelled() => Ok(()),
            Err(e) => {
                tracing::error!("control server task failed: {e}");
                Ok(())
            }
        };
        if let Some(t) = self.tcp
            && let Ok(Err(e)) = t.await
        {
            tracing::warn!("tcp server ended with: {e}");
        }
        result
    }
}

/// Serves `/metrics` on `listener`, when enabled: to scrapes that present `metrics.token`
/// when it is set, and without the tenant-labelled series unless `metrics.tenant_series`.
pub(crate) fn spawn_metrics(
    ctx: &Ctx,
    gate: &PeerGate,
    listener: Option<TcpListener>,
) -> Result<(), DaemonError> {
    let token = ctx
        .cfg
        .metrics
        .bearer_token()
        .map_err(|e| config("reading", "metrics.token", e))?;
    let auth = kvtier_server::prometheus_http::Auth::new(token, &ctx.metrics)?;
    if let Some(l) = listener {
        let metrics = ctx.metrics.clone();
        let tenant_series = ctx.cfg.metrics.tenant_series;
        let cap =
            kvtier_server::conn::Cap::new(gate.limits(), Listener::Metrics, gate.conn_metrics());
        ctx.tasks.spawn(kvtier_server::prometheus_http::serve(
            l,
            Arc::new(move || {
                metrics.render_where(|name| tenant_series || !name.starts_with("kvtier_tenant_"))
            }),
            ctx.tasks.shutdown.clone(),
            cap,
            auth,
        ));
    }
    Ok(())
}

/// The sealer (checksums committed pages off the state lock and seals their slot records, so
/// the pools survive a crash; on its own thread) and the lease sweeper (ends sessions that
/// stopped heartbeating, and gives back pools nobody uses).
pub(crate) fn spawn_upkeep(ctx: &Ctx, state: &Arc<Shared>) -> Result<(), DaemonError> {
    if state.lock().seals_enabled() {
        let sealer = sealer::start(state.clone(), ctx.tasks.shutdown.clone())
            .map_err(setup("start the sealer thread", Path::new("")))?;
        ctx.tasks.spawn(sealer);
    }
    let state = state.clone();
    let stop = ctx.tasks.shutdown.clone();
    let period = (ctx.cfg.sessions.ttl.0 / 4).max(Duration::from_millis(20));
    ctx.tasks.spawn(async move {
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
    Ok(())
}
