//! Who may use a Unix socket (`[server.unix]`): the socket file's mode and owner, set when it
//! is bound, and a check of every accepted connection's peer credentials (`SO_PEERCRED`, and
//! `SO_PEERGROUPS` for its supplementary groups) against the allow-lists. A refused peer is
//! closed before a byte is read, logged, and counted in
//! `kvtier_server_denied_connections_total{socket}`. Each socket's admitted connections are
//! also kept under `[server.connections]` (per uid and in all, with a handshake deadline;
//! [`crate::conn`]), and its accept loop waits instead of spinning when the process is out
//! of descriptors.

use std::io;
use std::path::Path;
use std::sync::Arc;

use futures::Stream;
use kvtier_config::connections::ConnectionLimits;
use kvtier_config::unix::UnixAccess;
use tokio::net::{UnixListener, UnixStream};

use crate::conn::{Cap, ConnMetrics, Limited, Permit};
use crate::doors::Listener;
use crate::metrics::MetricRegistry;
use crate::serving::{BindError, bind_unix};

/// The allow-list of one process and its denial counter; cheap to clone.
#[derive(Clone, Debug)]
pub struct PeerGate {
    access: Arc<UnixAccess>,
    own_uid: u32,
    denied: prometheus::IntCounterVec,
    limits: ConnectionLimits,
    conns: ConnMetrics,
}

impl PeerGate {
    /// The gate for `access`, admitting this process's own uid besides the listed peers, and
    /// keeping each socket's connections within `limits`; declares
    /// `kvtier_server_denied_connections_total` and the [`ConnMetrics`] in `metrics`.
    pub fn new(
        access: &UnixAccess,
        limits: &ConnectionLimits,
        metrics: &MetricRegistry,
    ) -> prometheus::Result<Self> {
        let denied = metrics.counter_vec(
            "kvtier_server_denied_connections_total",
            "connections to a Unix socket closed because the peer's uid and gid are not in server.unix's allow-lists",
            &["socket"],
        )?;
        Ok(Self {
            access: Arc::new(access.clone()),
            own_uid: rustix::process::geteuid().as_raw(),
            denied,
            limits: limits.clone(),
            conns: ConnMetrics::new(metrics)?,
        })
    }

    /// The series every listener's connection cap counts in (for kvtierd's TCP listener).
    pub fn conn_metrics(&self) -> &ConnMetrics {
        &self.conns
    }

    /// The connection limits.
    pub fn limits(&self) -> &ConnectionLimits {
        &self.limits
    }

    /// Binds `path` (see [`bind_unix`]), gives the file `[server.unix]`'s mode and owner, and
    /// returns a listener that admits only allowed peers. `door`'s row in the doors table
    /// names it in logs and the counter's label.
    pub async fn bind(&self, path: &Path, door: Listener) -> Result<GatedListener, BindError> {
        let socket = door.door().name;
        let listener = bind_unix(path).await?;
        set_file_access(path, &self.access).map_err(|source| BindError::Io {
            what: "setting server.unix's mode and owner on",
            path: path.display().to_string(),
            source,
        })?;
        // The series exists, at 0, for every socket served.
        self.denied.with_label_values(&[socket]);
        Ok(GatedListener {
            listener,
            gate: self.clone(),
            socket,
            cap: Cap::new(&self.limits, door, &self.conns),
        })
    }

    /// Whether `stream`'s peer is admitted; a refusal is logged and counted.
    fn admits(&self, stream: &UnixStream, socket: &'static str) -> bool {
        let cred = match stream.peer_cred() {
            Ok(c) => c,
            Err(e) => {
                self.denied.with_label_values(&[socket]).inc();
                tracing::warn!(
                    socket,
                    "refused a connection whose credentials are unreadable: {e}"
                );
                return false;
            }
        };
        if self.access.admits_uid(self.own_uid, cred.uid()) {
            return true;
        }
        if !self.access.allow_gids.is_empty() {
            let mut groups = kvtier_shm::peer::peer_groups(stream).unwrap_or_else(|e| {
                tracing::warn!(socket, "cannot read a peer's supplementary groups: {e}");
                Vec::new()
            });
            groups.push(cred.gid());
            if self.access.admits_groups(&groups) {
                return true;
            }
        }
        self.denied.with_label_values(&[socket]).inc();
        tracing::warn!(
            socket,
            uid = cred.uid(),
            gid = cred.gid(),
            pid = cred.pid(),
            "refused a connection: its uid and gid are not in server.unix.allow_uids / allow_gids"
        );
        false
    }
}

/// Sets the mode, then the owner and group when configured, of the socket file at `path`.
fn set_file_access(path: &Path, access: &UnixAccess) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(access.mode.bits()))?;
    if access.owner().is_some() || access.group().is_some() {
        std::os::unix::fs::chown(path, access.owner(), access.group())?;
    }
    Ok(())
}

/// A Unix listener whose `accept` yields only admitted peers, each under the socket's
/// connection cap.
#[derive(Debug)]
pub struct GatedListener {
    listener: UnixListener,
    gate: PeerGate,
    socket: &'static str,
    cap: Cap,
}

impl GatedListener {
    /// The next admitted connection and its place under the cap; refused ones (by the
    /// allow-lists or the cap) are closed on the way. Never fails: an accept that fails for
    /// want of descriptors waits and tries again (see [`Cap::accept_failed`]).
    pub async fn accept(&self) -> (UnixStream, Permit) {
        let mut backoff = std::time::Duration::ZERO;
        loop {
            let stream = match self.listener.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    self.cap.accept_failed(&e, &mut backoff).await;
                    continue;
                }
            };
            backoff = std::time::Duration::ZERO;
            if !self.gate.admits(&stream, self.socket) {
                continue;
            }
            let uid = stream.peer_cred().map_or(u32::MAX, |c| c.uid());
            if let Some(permit) = self.cap.admit(u64::from(uid)) {
                return (stream, permit);
            }
        }
    }

    /// The socket's connection cap (its handshake timeout, and wrapping a connection).
    pub fn cap(&self) -> &Cap {
        &self.cap
    }

    /// The admitted connections as a stream, for tonic's `serve_with_incoming*`: each closed
    /// if it does not start within the handshake timeout.
    pub fn incoming(self) -> impl Stream<Item = io::Result<Limited<UnixStream>>> + Send + 'static {
        futures::stream::unfold(self, |l| async move {
            let (stream, permit) = l.accept().await;
            let io = l.cap.limit(stream, permit);
            Some((Ok(io), l))
        })
    }
}
