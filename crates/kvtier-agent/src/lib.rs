//! kvtier-agent: the L1 agent, one per inference worker. It is the engine's prefix cache (a
//! radix tree of page keys over the engine's device KV pages), and the engine's door to the
//! node's kvtierd: load-back from L2, prefetch from L3, backups from the device to L2 per the
//! write policy. The engine talks to it over a Unix socket (`kvtier.v1.Agent`); page bytes
//! move by memcpy (cpu device) or DMA (cuda device), never through gRPC.
//!
//! [`run`] is the whole process: the binary only parses flags, loads the configuration and
//! calls it.
//!
//! Layers, each using only those above it in this list:
//! - `outcome` (why pages were lost or not loaded), `metrics`, `owner`, `link` (the kvtierd
//!   session), `handle_ids`, `memory_door` (engine memory deposited as descriptors);
//! - `shared`: the registered pool, the state behind one mutex, settings and counters;
//! - `l2`: the one port to kvtierd, owning the page moves (read, write with backpressure);
//! - the two modes over it, fixed at `RegisterPool`: `tree` (with `backup`: backups and
//!   eviction) and `engine_cache`;
//! - `engine_memory`: the engine's memory a registration describes, opened as a device;
//! - `service`: the gRPC edge, wire ↔ domain, dispatching to the pool's mode.

mod backup;
mod call_fence;
mod engine_cache;
mod engine_memory;
mod handle_ids;
mod l2;
pub mod link;
pub mod memory_door;
pub mod metrics;
mod outcome;
pub mod owner;
mod service;
mod shared;
mod tree;

use kvtier_server::tasks::Tasks;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvtier_config::agent::AgentConfig;
use kvtier_server::doors::{Listener, Server, Who};
use kvtier_server::guard::{Guard, GuardMetrics};
use kvtier_server::peers::{GatedListener, PeerGate};
use tokio_util::sync::CancellationToken;

use crate::link::Link;
use crate::metrics::Metrics;
use crate::service::AgentService;

/// Where a running agent can be reached.
#[derive(Debug, Clone)]
pub struct Ready {
    /// The engine socket.
    pub socket: PathBuf,
    /// The memory door (engines deposit their CPU pool's descriptors there).
    pub memory_socket: PathBuf,
    /// The metrics endpoint, if enabled.
    pub metrics: Option<std::net::SocketAddr>,
}

/// Why the agent could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Binding or preparing something failed.
    #[error("{what} {path}: {source}")]
    Setup {
        /// What.
        what: &'static str,
        /// Where.
        path: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another agent answers on the socket.
    #[error("an agent is already serving on {0}")]
    SocketInUse(String),
    /// Metrics could not be registered.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The gRPC server failed.
    #[error("server: {0}")]
    Server(#[from] tonic::transport::Error),
}

fn setup<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> AgentError + 'a {
    move |source| AgentError::Setup {
        what,
        path: path.display().to_string(),
        source,
    }
}

async fn bind_socket(
    gate: &PeerGate,
    path: &Path,
    name: Listener,
) -> Result<GatedListener, AgentError> {
    use kvtier_server::serving::BindError;
    gate.bind(path, name).await.map_err(|e| match e {
        BindError::InUse(p) => AgentError::SocketInUse(p),
        BindError::Io { what, path, source } => AgentError::Setup { what, path, source },
    })
}

/// Runs the agent until `shutdown`; `ready` is called once it serves.
pub async fn run(
    cfg: AgentConfig,
    shutdown: CancellationToken,
    ready: impl FnOnce(Ready) + Send,
) -> Result<(), AgentError> {
    let socket = cfg.socket_path();
    let memory_socket = cfg.memory_socket();
    let registry = kvtier_server::metrics::MetricRegistry::new();
    // The sockets and the metrics endpoint each get an equal share of the descriptors (less
    // what deposits waiting at the memory door may hold).
    let listeners = 2 + u32::from(cfg.metrics.listen.is_some());
    let limits = kvtier_server::conn::fit_to_descriptors_beside(
        &cfg.server.connections,
        listeners,
        memory_door::MAX_PENDING_FDS as u64,
    );
    let gate = PeerGate::new(&cfg.server.unix, &limits, &registry)?;
    let uds = bind_socket(&gate, &socket, Listener::Agent).await?;
    let door = bind_socket(&gate, &memory_socket, Listener::MemoryDoor).await?;
    let deposits = Arc::new(memory_door::Deposits::new(&registry)?);
    let listen = cfg.metrics.listen.as_deref();
    let metrics_listener = kvtier_server::prometheus_http::bind(listen)
        .await
        .map_err(setup(
            "binding metrics.listen",
            Path::new(listen.unwrap_or_default()),
        ))?;
    let metrics_addr = metrics_listener
        .as_ref()
        .and_then(kvtier_server::prometheus_http::local);
    let metrics = Metrics::new(&registry)?;
    let refusals = GuardMetrics::new(&registry, Server::Agent)?;
    // Every task of the agent runs on this tracker; the drain waits on it.
    let tasks = Tasks::new(shutdown.clone());
    let link = Arc::new(Link::new(&cfg, tasks.clone()));
    let (service, worker) = AgentService::new(
        &cfg,
        link.clone(),
        metrics.clone(),
        metrics_addr.map(|a| a.to_string()).unwrap_or_default(),
        deposits.clone(),
        tasks.clone(),
    );
    tasks.spawn(memory_door::serve(door, deposits, tasks.clone()));
    {
        let svc = service.clone();
        link.set_reporter(Arc::new(move || svc.report()));
        let svc = service.clone();
        link.set_on_linked(Arc::new(move |linked| svc.relinked(linked)));
    }
    tasks.spawn(link.clone().run(shutdown.clone()));
    tasks.spawn(service.run_backups(worker));
    if let Some(l) = metrics_listener {
        let svc = service.clone();
        registry.on_scrape(move || svc.refresh_gauges());
        let cap = kvtier_server::conn::Cap::new(
            gate.limits(),
            Listener::AgentMetrics,
            gate.conn_metrics(),
        );
        // The agent's series are its one engine's: no tenant's name or usage in them.
        let auth = kvtier_server::prometheus_http::Auth::new(None, &registry)?;
        tasks.spawn(kvtier_server::prometheus_http::serve(
            l,
            Arc::new(move || registry.render()),
            shutdown.clone(),
            cap,
            auth,
        ));
    }
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<kvtier_proto::v1::agent_server::AgentServer<AgentService>>()
        .await;
    tracing::info!(socket = %socket.display(), memory_socket = %memory_socket.display(), metrics = ?metrics_addr, daemon = %cfg.daemon_address(), "kvtier-agent serving");
    ready(Ready {
        socket: socket.clone(),
        memory_socket: memory_socket.clone(),
        metrics: metrics_addr,
    });
    // Who may call what: the doors table. Every peer [server.unix] admits is the engine (the
    // agent has no tenants); the agent's own uid is its operator.
    let own_uid = rustix::process::geteuid().as_raw();
    let guard = Guard::new(
        Listener::Agent,
        Arc::new(move |ext, _| match kvtier_server::guard::unix_uid(ext) {
            Some((uid, _)) if uid == own_uid => Who::Operator,
            Some(_) => Who::DefaultTenant,
            None => Who::Unauthenticated,
        }),
        true,
        &refusals,
    );
    let stop = shutdown.clone();
    let mut server = tasks.spawn(
        kvtier_server::serving::grpc_server()
            .layer(guard)
            .add_service(kvtier_proto::v1::agent_server::AgentServer::new(service))
            .add_service(health_service)
            .serve_with_incoming_shutdown(uds.incoming(), async move {
                stop.cancelled().await;
            }),
    );
    // Serve until shutdown (or the server fails); then give open engine connections the
    // drain deadline, and close them: an engine that never hangs up must not keep the
    // agent alive.
    let served = tokio::select! {
        r = &mut server => Some(r),
        () = shutdown.cancelled() => None,
    };
    // One deadline for the whole drain: open engine connections, then every task still
    // running (backups under way, calls finishing their copies, the link's last calls).
    let deadline = tokio::time::Instant::now() + cfg.server.drain_timeout.0;
    let served = match served {
        Some(r) => r,
        None => match tokio::time::timeout_at(deadline, &mut server).await {
            Ok(r) => r,
            Err(_) => {
                tracing::warn!(
                    "engine connections still open after the drain deadline; closing them"
                );
                server.abort();
                Ok(Ok(()))
            }
        },
    };
    let served = match served {
        Ok(r) => r,
        Err(e) if e.is_cancelled() => Ok(()),
        Err(e) => {
            tracing::error!("agent server task failed: {e}");
            Ok(())
        }
    };
    shutdown.cancel();
    tasks.close();
    if tokio::time::timeout_at(deadline, tasks.wait())
        .await
        .is_err()
    {
        tracing::warn!("agent tasks still running after the drain deadline; stopping anyway");
    }
    for path in [&socket, &memory_socket] {
        if let Err(e) = std::fs::remove_file(path) {
            tracing::warn!(socket = %path.display(), "could not remove the socket: {e}");
        }
    }
    tracing::info!("kvtier-agent stopped");
    served.map_err(AgentError::from)
}
