//! The agent's link to kvtierd: one session for the engine's layout, kept alive with
//! heartbeats, re-established at once (then with backoff) when the daemon restarts or the
//! session expires. While there is no link the agent serves from L1 alone: every host or
//! storage lookup is a miss. Backups wait for the link to come back for up to
//! `cache.evict_wait` after it broke ([`Link::current_or_wait`]): a restarting kvtierd is a
//! blip, not a loss. Each new session has a new generation; the agent is told before the
//! session is used ([`Link::set_on_linked`]), so it re-checks what it believed L2 held.

use kvtier_server::tasks::Tasks;
use parking_lot::{Mutex, RwLock};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_client::{ClientError, HostClient, SlotLease};
use kvtier_config::agent::AgentConfig;
use kvtier_core::LayoutSpec;
use kvtier_proto::Lost;
use kvtier_shm::ShmPool;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// A live session with kvtierd and its pool mapped.
#[derive(Debug)]
pub struct Linked {
    /// A client to clone per call.
    pub client: HostClient,
    /// The session.
    pub session: kvtier_core::SessionId,
    /// kvtierd's pool for this layout, mapped here.
    pub pool: Arc<ShmPool>,
    /// Session lease.
    pub ttl: Duration,
    /// Which link this is: 1 for the first session, one more for each one after.
    pub generation: u64,
    /// L2 slots the session holds leased, for one-call small writes.
    pub lease: SlotLease,
}

/// Slots the agent asks kvtierd to keep leased per session: a decode step's pages for a few
/// concurrent saves (kvtierd grants at most 16, none in a small pool).
pub const LEASE_SLOTS: u32 = 16;

/// The link, shared by the service and the background task that maintains it.
pub struct Link {
    /// Where its background calls run.
    tasks: Tasks,
    address: String,
    name: String,
    timeout: Duration,
    backoff: (Duration, Duration),
    want: watch::Sender<Option<LayoutSpec>>,
    current: RwLock<Option<Arc<Linked>>>,
    reporter: RwLock<Option<Reporter>>,
    on_linked: RwLock<Option<OnLinked>>,
    /// Sessions established so far.
    generation: std::sync::atomic::AtomicU64,
    /// When the last link broke (`None` while linked, or before the first link).
    down_since: Mutex<Option<Instant>>,
    /// Wakes the maintenance task when a call finds the link broken.
    wake: Notify,
    /// Bumped each time a session is published, for waiters.
    linked: watch::Sender<u64>,
    /// Sessions given up as broken: closed once a new session is up. A kvtierd that was
    /// only slow (stopped, starved) still holds their pins and reservations, which would
    /// otherwise stay until their lease runs out.
    abandoned: Mutex<Vec<kvtier_core::SessionId>>,
}

/// Called with a new session (its generation set) before the session is used.
pub type OnLinked = Arc<dyn Fn(&Linked) + Send + Sync>;

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

/// Whether an error means the link itself is gone (daemon down, restarted, session expired),
/// rather than a refused request (a `NOT_FOUND` of a prefetch or a request is not: only one
/// whose trailer says the session is lost).
pub fn is_link_error(e: &ClientError) -> bool {
    match e {
        ClientError::Connect { .. } => true,
        ClientError::Status(s) => {
            matches!(
                s.code(),
                tonic::Code::Unavailable
                    | tonic::Code::Unknown
                    | tonic::Code::Cancelled
                    | tonic::Code::DeadlineExceeded
            ) || Lost::of(s) == Some(Lost::Session)
        }
        _ => false,
    }
}

impl Link {
    /// A link to the daemon `cfg` names; nothing happens until [`Link::want`] gives a layout.
    pub fn new(cfg: &AgentConfig, tasks: Tasks) -> Self {
        Self {
            tasks,
            address: cfg.daemon_address(),
            name: cfg.daemon.name.clone(),
            timeout: cfg.daemon.timeout.0,
            backoff: (cfg.daemon.reconnect_min.0, cfg.daemon.reconnect_max.0),
            want: watch::channel(None).0,
            current: RwLock::new(None),
            reporter: RwLock::new(None),
            on_linked: RwLock::new(None),
            generation: std::sync::atomic::AtomicU64::new(0),
            down_since: Mutex::new(None),
            wake: Notify::new(),
            linked: watch::channel(0).0,
            abandoned: Mutex::new(Vec::new()),
        }
    }

    /// Sets what runs when a new session is established, before anything uses it.
    pub fn set_on_linked(&self, f: OnLinked) {
        *self.on_linked.write() = Some(f);
    }

    fn down_since(&self) -> Option<Instant> {
        *self.down_since.lock()
    }

    fn set_down_since(&self, at: Option<Instant>) {
        *self.down_since.lock() = at;
    }

    /// The live session; when there is none but the link broke (or was asked for) less than
    /// `grace` ago, waits (until `grace` after that) for it to come back. `None` at once when
    /// no layout was ever wanted, or the link has been down longer: a daemon that is gone
    /// must not stall the engine.
    pub async fn current_or_wait(&self, grace: Duration) -> Option<Arc<Linked>> {
        let mut seen = self.linked.subscribe();
        loop {
            if let Some(l) = self.current() {
                return Some(l);
            }
            let until = self.down_since()? + grace;
            if Instant::now() >= until {
                return None;
            }
            let changed = seen.changed();
            if tokio::time::timeout_at(until.into(), changed)
                .await
                .is_err()
            {
                return self.current();
            }
        }
    }

    /// Whether a call that failed for want of a link may wait for it: it broke less than
    /// `grace` ago (or is back already).
    pub fn may_come_back(&self, grace: Duration) -> bool {
        self.current().is_some() || self.down_since().is_some_and(|t| t.elapsed() < grace)
    }

    /// Sets what each heartbeat reports to kvtierd (its per-session view of this worker).
    pub fn set_reporter(&self, r: Reporter) {
        *self.reporter.write() = Some(r);
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
            *self.current.write() = None;
            // A session being set up counts as a link that just broke: saves issued before
            // it is up wait for it (up to their grace) instead of being given up at once.
            self.set_down_since(Some(Instant::now()));
        }
    }

    /// The live session, if any.
    pub fn current(&self) -> Option<Arc<Linked>> {
        self.current.read().clone()
    }

    /// Reports that a call on `linked` failed in a way that means the session is gone; the
    /// background task reconnects.
    pub fn broken(&self, linked: &Arc<Linked>, why: &ClientError) {
        let mut cur = self.current.write();
        if cur.as_ref().is_some_and(|c| Arc::ptr_eq(c, linked)) {
            tracing::warn!(
                session = %linked.session,
                "kvtierd link lost: {why}; serving L1 only until it is back"
            );
            *cur = None;
            self.set_down_since(Some(Instant::now()));
            self.abandoned.lock().push(linked.session);
            self.wake.notify_one();
        }
    }

    /// Closes the sessions given up before `linked` (best effort, in the background): what
    /// the calls in flight on them held in kvtierd goes at once. A restarted kvtierd knows
    /// none of them (nothing to close).
    fn close_abandoned(&self, linked: &Linked) {
        let old = std::mem::take(&mut *self.abandoned.lock());
        if old.is_empty() {
            return;
        }
        let mut c = linked.client.clone();
        let timeout = self.timeout;
        self.tasks.spawn(async move {
            for session in old {
                match tokio::time::timeout(timeout, c.close(session)).await {
                    Ok(Ok(())) => tracing::info!(%session, "closed a session given up as broken"),
                    Ok(Err(e)) => tracing::debug!(%session, "old session not closed: {e}"),
                    Err(_) => tracing::debug!(%session, "old session close timed out"),
                }
            }
        });
    }

    async fn connect(&self, layout: &LayoutSpec) -> Result<Linked, ClientError> {
        let mut client = HostClient::connect(&self.address).await?;
        let s = client.register(&self.name, layout).await?;
        Ok(Linked {
            client,
            session: s.id,
            pool: Arc::new(s.pool),
            ttl: s.ttl,
            generation: 0,
            lease: SlotLease::new(LEASE_SLOTS),
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
                        Ok(Ok(mut linked)) => {
                            let generation = self
                                .generation
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                                + 1;
                            linked.generation = generation;
                            tracing::info!(session = %linked.session, generation, address = %self.address, "registered with kvtierd");
                            let hook = self.on_linked.read().clone();
                            if let Some(hook) = hook {
                                hook(&linked);
                            }
                            let ttl = linked.ttl;
                            self.close_abandoned(&linked);
                            *self.current.write() = Some(Arc::new(linked));
                            self.set_down_since(None);
                            self.linked.send_replace(generation);
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
                    let report = self.reporter.read().as_ref().map(|r| r());
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
                // A call found the link broken: reconnect now, not at the next heartbeat.
                () = self.wake.notified() => {}
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
