//! kvtierd: the per-node daemon of kvtier. It owns the host tier (L2): one shared-memory page
//! pool per layout class that every agent on the node maps, its index, and the client
//! sessions that pin and reserve pages in it; it serves the `kvtier.v1.HostTier` gRPC service
//! on a Unix socket (and optionally TCP), `grpc.health.v1`, server reflection, and a
//! Prometheus text endpoint.
//!
//! [`run`] is the whole daemon; `main.rs` only parses flags, loads the configuration, starts
//! logging and calls it, and tests start the same `run` in-process or the binary as a process.

pub mod admin;
pub mod events;
pub mod ids;
pub mod l3;
mod parts;
mod pool_door;
pub mod prefetch;
pub mod roles;
pub mod sealer;
pub mod service;
pub mod sglang;
pub mod state;
pub mod storage_service;
pub mod streams;
pub mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;

use kvtier_config::daemon::DaemonConfig;
use tokio_util::sync::CancellationToken;

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

/// Runs the daemon until `shutdown` is cancelled, then drains in-flight requests, removes
/// the sockets and unmaps (and unlinks) every pool. `ready` is called once everything listens.
///
/// Build, serve, stop: each part (`parts.rs`) starts from the same context and hands back
/// what the later stages need.
pub async fn run(
    cfg: DaemonConfig,
    shutdown: CancellationToken,
    ready: impl FnOnce(Ready) + Send,
) -> Result<(), DaemonError> {
    let ctx = parts::Ctx::new(cfg, shutdown)?;
    let parts::Listeners {
        gate,
        uds,
        pools,
        tcp,
        metrics,
    } = parts::Listeners::bind(&ctx).await?;
    // A start that fails from here on (an L3 it cannot open, a pool it cannot map) leaves
    // no socket file behind.
    let mut unbind = Unbind(vec![ctx.cfg.socket_path(), ctx.cfg.pool_socket()]);
    let core = parts::Core::start(&ctx).await?;
    core.serve_pool_door(&ctx, pools)?;
    let sglang = parts::Sglang::new(&ctx)?;
    let metrics_addr = metrics
        .as_ref()
        .and_then(kvtier_server::prometheus_http::local);
    let control = parts::Control::serve(&ctx, &core, &gate, uds, tcp, metrics_addr).await?;
    parts::spawn_metrics(&ctx, &gate, metrics)?;
    parts::spawn_upkeep(&ctx, &core.state)?;
    let sglang_sockets = sglang.serve(&ctx, &gate, &core).await?;
    ctx.tasks.close();

    let socket = ctx.cfg.socket_path();
    tracing::info!(
        socket = %socket.display(),
        tcp = ?control.tcp_addr,
        metrics = ?control.metrics_addr,
        "kvtierd serving"
    );
    unbind.0.clear();
    ready(Ready {
        socket: socket.clone(),
        tcp: control.tcp_addr,
        metrics: control.metrics_addr,
    });
    ctx.tasks.shutdown.cancelled().await;
    let result = control.drain(&ctx).await;
    let pool_socket = ctx.cfg.pool_socket();
    for p in sglang_sockets.iter().chain([&socket, &pool_socket]) {
        if let Err(e) = std::fs::remove_file(p) {
            tracing::warn!(socket = %p.display(), "could not remove the socket: {e}");
        }
    }
    // Unlink every pool now, even if a connection task aborted above still holds the state;
    // the memory itself goes when the last mapping does.
    for pool in core.state.lock().pools() {
        pool.shm.unlink();
    }
    tracing::info!("kvtierd stopped");
    result
}

/// Removes the socket files it names when dropped: a failed start's.
struct Unbind(Vec<std::path::PathBuf>);

impl Drop for Unbind {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kvtier_server::metrics::MetricRegistry;
    use kvtier_server::peers::PeerGate;

    use super::*;
    use crate::service::HostService;
    use crate::state::{HostState, Shared};

    /// A start refused after the sockets were bound (here: an L3 directory that is a file)
    /// leaves neither socket file behind.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_start_leaves_no_socket_file() {
        let dir = std::env::temp_dir().join(format!("kvtierd-unbind-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("not-a-dir"), b"").unwrap();
        let sets = [
            format!("data_dir={}", dir.join("data").display()),
            format!("server.socket={}", dir.join("k.sock").display()),
            "l3.backend=file".to_string(),
            format!("l3.file.path={}", dir.join("not-a-dir").display()),
            "metrics.listen=".to_string(),
        ];
        let cfg = DaemonConfig::load(&kvtier_config::Sources {
            sets: sets.to_vec(),
            ..Default::default()
        })
        .unwrap();
        let pools = cfg.pool_socket();
        let e = run(cfg, CancellationToken::new(), |_| panic!("it started"))
            .await
            .unwrap_err();
        assert!(
            format!("{e:#}").contains("not-a-dir: it exists and is not a directory"),
            "{e:#}"
        );
        for p in [dir.join("k.sock"), pools] {
            assert!(!p.exists(), "{} left behind", p.display());
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn every_metric_is_declared_once_and_documented() {
        let cfg = DaemonConfig::default();
        let registry = MetricRegistry::new();
        let state = Arc::new(Shared::new(HostState::new(&cfg).unwrap()));
        let tasks = kvtier_server::tasks::Tasks::new(CancellationToken::new());
        let l3 = l3::L3Slot::new(state.clone(), &registry, tasks.clone(), Duration::ZERO).unwrap();
        let prefetcher = Arc::new(
            prefetch::Prefetcher::new(
                cfg.prefetch.clone(),
                state.clone(),
                l3.clone(),
                &registry,
                tasks.clone(),
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
            tasks,
        )
        .unwrap();
        sglang::SglangMetrics::new(&registry).unwrap();
        pool_door::DoorMetrics::new(&registry).unwrap();
        kvtier_server::guard::GuardMetrics::new(&registry, kvtier_server::doors::Server::Kvtierd)
            .unwrap();
        PeerGate::new(&cfg.server.unix, &cfg.server.connections, &registry).unwrap();
        kvtier_server::prometheus_http::Auth::new(None, &registry).unwrap();
        let doc = include_str!("../../../docs/metrics.md");
        let wrong = registry.check_documented(doc, |n| !n.starts_with("kvtier_agent_"));
        assert!(wrong.is_empty(), "{wrong:#?}");
        // The scrape hooks run without an attached tier.
        assert!(registry.render().contains("kvtier_l2_pools 0"));
    }
}
