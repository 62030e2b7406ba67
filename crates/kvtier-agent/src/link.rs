//! The agent's link to kvtierd: one session for the engine's layout, kept alive with
//! heartbeats, re-established with backoff when the daemon restarts or the session expires.
//! While there is no link the agent serves from L1 alone: every host or storage lookup is a
//! miss, backups are dropped (counted), nothing waits.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvtier_client::{ClientError, HostClient};
use kvtier_config::agent::AgentConfig;
use kvtier_core::LayoutSpec;
use kvtier_shm::ShmPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// A live session with kvtierd and its pool mapped.
#[derive(Debug)]
pub struct Linked {
    /// A client to clone per call.
    pub client: HostClient,
    /// The session.
    pub session: u64,
    /// kvtierd's pool for this layout, mapped here.
    pub pool: Arc<ShmPool>,
    /// Session lease.
    pub ttl: Duration,
}

/// The link, shared by the service and the background task that maintains it.
pub struct Link {
    address: String,
    name: String,
    timeout: Duration,
    backoff: (Duration, Duration),
    want: watch::Sender<Option<LayoutSpec>>,
    current: RwLock<Option<Arc<Linked>>>,
    reporter: RwLock<Option<Reporter>>,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("address", &self.address)
            .field("name", &self.name)
            .finish()
    }
}

/// Builds the report each heartbeat carries.
pub type Reporter = Arc<dyn Fn() -> kvtier_proto::v1::ClientReport + Send + Sync>;

fn read<T>(l: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    match l.read() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

fn write<T>(l: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    match l.write() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Whether an error means the link itself is gone (daemon down, restarted, session expired),
/// rather than a refused request.
pub fn is_link_error(e: &ClientError) -> bool {
    match e {
        ClientError::Connect { .. } => true,
        ClientError::Status(s) => matches!(
            s.code(),
            tonic::Code::Unavailable
                | tonic::Code::NotFound
                | tonic::Code::Unknown
                | tonic::Code::Cancelled
                | tonic::Code::DeadlineExceeded
        ),
        _ => false,
    }
}

impl Link {
    /// A link to the daemon `cfg` names; nothing happens until [`Link::want`] gives a layout.
    pub fn new(cfg: &AgentConfig) -> Self {
        Self {
            address: cfg.daemon_address(),
            name: cfg.daemon.name.clone(),
            timeout: cfg.daemon.timeout.0,
            backoff: (cfg.daemon.reconnect_min.0, cfg.daemon.reconnect_max.0),
            want: watch::channel(None).0,
            current: RwLock::new(None),
            reporter: RwLock::new(None),
        }
    }

    /// Sets what each heartbeat reports to kvtierd (its per-session view of this worker).
    pub fn set_reporter(&self, r: Reporter) {
        *write(&self.reporter) = Some(r);
    }

    /// Per-call deadline.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Asks for a session for `layout` (replacing any session of another layout).
    pub fn want(&self, layout: LayoutSpec) {
        let changed = self.want.borrow().as_ref() != Some(&layout);
        if changed {
            self.want.send_replace(Some(layout));
            *write(&self.current) = None;
        }
    }

    /// The live session, if any.
    pub fn current(&self) -> Option<Arc<Linked>> {
        read(&self.current).clone()
    }

    /// Reports that a call on `linked` failed in a way that means the session is gone; the
    /// background task reconnects.
    pub fn broken(&self, linked: &Arc<Linked>, why: &ClientError) {
        let mut cur = write(&self.current);
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, linked)) {
            tracing::warn!(
                session = linked.session,
                "kvtierd link lost: {why}; serving L1 only until it is back"
            );
            *cur = None;
        }
    }

    async fn connect(&self, layout: &LayoutSpec) -> Result<Linked, ClientError> {
        let mut client = HostClient::connect(&self.address).await?;
        let s = client.register(&self.name, layout).await?;
        Ok(Linked {
            client,
            session: s.id,
            pool: Arc::new(s.pool),
            ttl: s.ttl,
        })
    }

    /// Keeps the session alive until `stop`: registers when a layout is wanted, heartbeats
    /// every third of the lease, reconnects with doubling backoff. Closes the session at the
    /// end.
    pub async fn run(self: Arc<Self>, stop: CancellationToken) {
        let mut want = self.want.subscribe();
        let mut backoff = self.backoff.0;
        loop {
            let layout = want.borrow_and_update().clone();
            let wait = match (layout, self.current()) {
                (None, _) => None,
                (Some(layout), None) => {
                    match tokio::time::timeout(self.timeout, self.connect(&layout)).await {
                        Ok(Ok(linked)) => {
                            tracing::info!(session = linked.session, address = %self.address, "registered with kvtierd");
                            let ttl = linked.ttl;
                            *write(&self.current) = Some(Arc::new(linked));
                            backoff = self.backoff.0;
                            Some(ttl / 3)
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(address = %self.address, "kvtierd not reachable: {e}");
                            let w = backoff;
                            backoff = (backoff * 2).min(self.backoff.1);
                            Some(w)
                        }
                        Err(_) => {
                            let w = backoff;
                            backoff = (backoff * 2).min(self.backoff.1);
                            Some(w)
                        }
                    }
                }
                (Some(_), Some(linked)) => {
                    let mut c = linked.client.clone();
                    let report = read(&self.reporter).as_ref().map(|r| r());
                    let beat = c.heartbeat_with(linked.session, report);
                    match tokio::time::timeout(self.timeout, beat).await {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => self.broken(&linked, &e),
                        Err(_) => self.broken(
                            &linked,
                            &ClientError::Protocol("heartbeat timed out".into()),
                        ),
                    }
                    Some((linked.ttl / 3).max(Duration::from_millis(10)))
                }
            };
            tokio::select! {
                () = stop.cancelled() => break,
                _ = want.changed() => {}
                () = async {
                    match wait {
                        Some(w) => tokio::time::sleep(w).await,
                        None => std::future::pending().await,
                    }
                } => {}
            }
        }
        if let Some(linked) = self.current() {
            let mut c = linked.client.clone();
            let _ = tokio::time::timeout(self.timeout, c.close(linked.session)).await;
        }
    }
}
