//! Who may use a Unix socket (`[server.unix]`): the socket file's mode and owner, set when it
//! is bound, and a check of every accepted connection's peer credentials (`SO_PEERCRED`, and
//! `SO_PEERGROUPS` for its supplementary groups) against the allow-lists. A refused peer is closed before a byte is read, logged, and
//! counted in `kvtier_server_denied_connections_total{socket}`.

use std::io;
use std::path::Path;
use std::sync::Arc;

use futures::Stream;
use kvtier_config::unix::UnixAccess;
use tokio::net::{UnixListener, UnixStream};

use crate::metrics::MetricRegistry;
use crate::serving::{BindError, bind_unix};

/// The allow-list of one process and its denial counter; cheap to clone.
#[derive(Clone, Debug)]
pub struct PeerGate {
    access: Arc<UnixAccess>,
    own_uid: u32,
    denied: prometheus::IntCounterVec,
}

impl PeerGate {
    /// The gate for `access`, admitting this process's own uid besides the listed peers;
    /// declares `kvtier_server_denied_connections_total` in `metrics`.
    pub fn new(access: &UnixAccess, metrics: &MetricRegistry) -> prometheus::Result<Self> {
        let denied = metrics.counter_vec(
            "kvtier_server_denied_connections_total",
            "connections to a Unix socket closed because the peer's uid and gid are not in server.unix's allow-lists",
            &["socket"],
        )?;
        Ok(Self {
            access: Arc::new(access.clone()),
            own_uid: rustix::process::geteuid().as_raw(),
            denied,
        })
    }

    /// Binds `path` (see [`bind_unix`]), gives the file `[server.unix]`'s mode and owner, and
    /// returns a listener that admits only allowed peers. `socket` names it in logs and the
    /// counter's label.
    pub async fn bind(
        &self,
        path: &Path,
        socket: &'static str,
    ) -> Result<GatedListener, BindError> {
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

/// A Unix listener whose `accept` yields only admitted peers.
#[derive(Debug)]
pub struct GatedListener {
    listener: UnixListener,
    gate: PeerGate,
    socket: &'static str,
}

impl GatedListener {
    /// The next admitted connection; refused ones are closed on the way.
    pub async fn accept(&self) -> io::Result<UnixStream> {
        loop {
            let (stream, _) = self.listener.accept().await?;
            if self.gate.admits(&stream, self.socket) {
                return Ok(stream);
            }
        }
    }

    /// The admitted connections as a stream, for tonic's `serve_with_incoming*`.
    pub fn incoming(self) -> impl Stream<Item = io::Result<UnixStream>> + Send + 'static {
        futures::stream::unfold(self, |l| async move {
            let next = l.accept().await;
            Some((next, l))
        })
    }
}
