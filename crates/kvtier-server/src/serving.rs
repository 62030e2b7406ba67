//! What kvtierd and kvtier-agent both need to run as servers: binding a Unix socket without
//! ever taking over a live one, a shutdown token cancelled by SIGTERM or SIGINT, and logging
//! from the `log.level` key.

use std::io::IsTerminal as _;
use std::path::Path;

use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// Why a Unix socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// A live server answers on it.
    #[error("a server is already answering on {0}")]
    InUse(String),
    /// Creating its directory, removing a stale socket or binding failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// Where.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Binds a Unix socket at `path`: creates its directory, replaces a stale socket file (one
/// nothing answers on), and refuses one a live server answers on.
pub async fn bind_unix(path: &Path) -> Result<UnixListener, BindError> {
    let io = |what: &'static str, p: &Path| {
        let path = p.display().to_string();
        move |source| BindError::Io { what, path, source }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io("creating the socket directory", dir))?;
    }
    if path.exists() {
        if tokio::net::UnixStream::connect(path).await.is_ok() {
            return Err(BindError::InUse(path.display().to_string()));
        }
        std::fs::remove_file(path).map_err(io("removing stale socket", path))?;
    }
    UnixListener::bind(path).map_err(io("binding socket", path))
}

/// A token cancelled on the first SIGTERM or SIGINT (call inside the runtime).
pub fn shutdown_on_signals() -> CancellationToken {
    let token = CancellationToken::new();
    let signals = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) else {
            tracing::error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = int.recv() => tracing::info!("SIGINT"),
        }
        signals.cancel();
    });
    token
}

/// Logs to stderr with the filter `level` (the `log.level` key; colours on a terminal).
pub fn init_logging(level: &str) -> Result<(), String> {
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .map_err(|e| format!("config key `log.level`: {level:?} is not a filter: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    Ok(())
}

/// A gRPC server builder with kvtier's HTTP/2 settings, for every server kvtier runs: windows
/// wide enough that a request or page larger than the 64 KiB default (a 1,000-page Match
/// carries 80 KB of tokens) does not wait a round trip for a window update, and large frames
/// for streamed pages. The same numbers as kvtier-client's endpoints. Requests that are not
/// their method's message get `InvalidArgument` ([`crate::malformed`]).
pub fn grpc_server() -> tonic::transport::Server<
    tower::layer::util::Stack<
        crate::malformed::MalformedIsInvalidArgument,
        tower::layer::util::Identity,
    >,
> {
    tonic::transport::Server::builder()
        .initial_stream_window_size(kvtier_client::STREAM_WINDOW)
        .initial_connection_window_size(kvtier_client::CONNECTION_WINDOW)
        .max_frame_size(kvtier_client::MAX_FRAME)
        .tcp_nodelay(true)
        .layer(crate::malformed::layer())
}
