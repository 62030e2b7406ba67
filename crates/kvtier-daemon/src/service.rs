//! The `kvtier.v1.HostTier` gRPC service: validates every request once, on receive, then
//! calls into [`HostState`](crate::state::HostState). Errors are [`ApiError`]s, turned into
//! gRPC status codes by the one conversion in kvtier-proto. Calls with a concept of their
//! own keep their bodies beside it: `register.rs`, `lease.rs` (CommitLeased), `stats.rs`
//! (Stats, WatchMetrics), `routing.rs` (Locate, WatchEvents) and `events_route.rs` (how
//! WatchEvents' encoded messages are served).

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::PageKey;
use kvtier_core::host_index::Reserve;
use kvtier_core::{SessionId, TenantScope};
use kvtier_proto::v1::host_tier_server::HostTier;
use kvtier_proto::v1::{self, ReserveStatus};
use kvtier_proto::{ApiError, request_key_count, request_keys, session_id};
use tonic::{Request, Response, Status};

use crate::l3::L3Slot;
use crate::prefetch::Prefetcher;
use crate::roles::Roles;
use crate::state::Shared;
use crate::state::{L2Metrics, StateGuard};
use kvtier_config::tenants::Tenants;
use kvtier_server::metrics::MetricRegistry;

mod events_route;
mod lease;
mod register;
mod routing;
mod stats;
mod watch;

pub use events_route::HostTierRoutes;
use stats::SnapshotStream;

/// The stream a WatchEvents call returns, as [`HostTierRoutes`] sends it: `EventBatch`
/// messages, encoded.
type EncodedEventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, Status>> + Send>>;

/// The same stream decoded, for the generated server's `watch_events` (kvtierd serves the
/// call through [`HostTierRoutes`], which never reaches it).
type EventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::EventBatch, Status>> + Send>>;

/// The stream a Prefetch call returns.
type WireProgressStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::PrefetchProgress, Status>> + Send>>;

/// The service.
#[derive(Clone)]
pub struct HostService {
    state: Arc<Shared>,
    metrics: L2Metrics,
    registry: MetricRegistry,
    max_batch: usize,
    started: Instant,
    metrics_address: String,
    l3: Arc<L3Slot>,
    prefetcher: Arc<Prefetcher>,
    /// Where its streams' tasks run, and the shutdown that ends them.
    tasks: kvtier_server::tasks::Tasks,
    /// Who is which tenant (empty: tenancy off), and who sees all of them.
    roles: Arc<Roles>,
    /// The tenants of `roles`.
    tenants: Arc<Tenants>,
    /// The pool door's socket, told to every session at registration.
    pool_socket: Option<std::path::PathBuf>,
    /// Streams each caller holds open.
    streams: Arc<crate::streams::StreamCaps>,
}

/// A request's `parent` field (empty: none), in the session's tenant scope when given.
fn scoped_parent(raw: &[u8], scope: Option<&TenantScope>) -> Result<Option<PageKey>, ApiError> {
    if raw.is_empty() {
        return Ok(None);
    }
    let p = PageKey::from_slice("parent", raw)?;
    Ok(Some(scope.map_or(p, |s| s.apply(&p))))
}

impl HostService {
    /// A service over `state`, with its series declared in `registry` (what WatchMetrics
    /// streams).
    pub fn new(
        state: Arc<Shared>,
        registry: MetricRegistry,
        max_batch: usize,
        metrics_address: String,
        l3: Arc<L3Slot>,
        prefetcher: Arc<Prefetcher>,
        tasks: kvtier_server::tasks::Tasks,
    ) -> Result<Self, prometheus::Error> {
        state
            .lock()
            .set_event_metrics(crate::events::EventMetrics::new(&registry)?);
        Ok(Self {
            streams: crate::streams::StreamCaps::new(32, &registry)?,
            metrics: L2Metrics::new(&registry, state.clone())?,
            state,
            registry,
            max_batch,
            started: Instant::now(),
            metrics_address,
            l3,
            prefetcher,
            tasks,
            roles: Arc::new(Roles::open()),
            tenants: Arc::new(Tenants::default()),
            pool_socket: None,
        })
    }

    /// Binds sessions to their caller's tenant at registration and scopes their keys
    /// (`[tenants]`); shows each tenant only its own sessions in Stats and WatchMetrics.
    pub fn with_roles(mut self, roles: Arc<Roles>) -> Self {
        self.tenants = roles.tenants().clone();
        self.roles = roles;
        self
    }

    /// At most `n` streams of each kind per caller (`server.max_streams_per_caller`).
    pub fn with_max_streams(self, n: u32) -> Self {
        self.streams.set_per_caller(n);
        self
    }

    /// Measures the lookups' hit-rate ceiling over windows of `window`
    /// (`metrics.hit_ceiling_window`).
    pub fn with_hit_ceiling_window(self, window: std::time::Duration) -> Self {
        self.metrics.set_hit_ceiling_window(window);
        self
    }

    /// Tells every registering client where the pool door is.
    pub fn with_pool_socket(mut self, path: std::path::PathBuf) -> Self {
        self.pool_socket = Some(path);
        self
    }

    /// Hands L3 writes to the writer (never waits).
    fn enqueue(&self, jobs: Vec<crate::state::Job>) {
        if jobs.is_empty() {
            return;
        }
        match self.l3.current() {
            Some(l3) => l3.enqueue(jobs, &self.state),
            // Detached between the state's decision and now: unpin, nothing to write to.
            None => {
                let mut st = self.state();
                for j in jobs {
                    st.finish_l3(&j, false);
                }
            }
        }
    }

    fn state(&self) -> StateGuard<'_> {
        self.state.lock()
    }

    fn keys(&self, raw: &[Vec<u8>], packed: &[u8]) -> Result<Vec<PageKey>, ApiError> {
        let n = request_key_count(raw, packed);
        if n > self.max_batch {
            let field = if packed.is_empty() {
                "keys"
            } else {
                "packed_keys"
            };
            return Err(ApiError::invalid(
                field,
                format!(
                    "{n} keys exceed the batch limit of {} (server.max_batch)",
                    self.max_batch
                ),
            ));
        }
        request_keys(raw, packed)
    }

    /// Runs one handler body, recording its outcome and latency.
    fn observe<T>(
        &self,
        op: &str,
        f: impl FnOnce() -> Result<T, ApiError>,
    ) -> Result<Response<T>, Status> {
        let t = Instant::now();
        let r = f();
        self.finish(op, t, r)
    }

    /// Records the outcome and latency of a handler that started at `t`.
    fn finish<T>(
        &self,
        op: &str,
        t: Instant,
        r: Result<T, ApiError>,
    ) -> Result<Response<T>, Status> {
        let outcome = match &r {
            Ok(_) => "ok",
            Err(ApiError::InvalidArgument { .. }) => "invalid_argument",
            Err(ApiError::NotFound(_) | ApiError::Lost(..)) => "not_found",
            Err(ApiError::FailedPrecondition(_)) => "failed_precondition",
            Err(ApiError::AlreadyExists(_)) => "already_exists",
            Err(ApiError::ResourceExhausted(_)) => "resource_exhausted",
            Err(ApiError::PermissionDenied(_)) => "permission_denied",
            Err(ApiError::Unavailable(_)) => "unavailable",
            Err(ApiError::Internal(_)) => "internal",
        };
        self.metrics
            .requests
            .with_label_values(&[op, outcome])
            .inc();
        self.metrics
            .request_seconds
            .with_label_values(&[op])
            .observe(t.elapsed().as_secs_f64());
        if let Err(e) = &r {
            tracing::debug!(op, "request refused: {e}");
        }
        r.map(Response::new).map_err(Status::from)
    }

    fn pages(&self, op: &str, n: usize) {
        self.metrics.pages.with_label_values(&[op]).inc_by(n as u64);
    }

    /// The tenant a registering caller is: by its Unix-socket peer uid (or gid), or by the
    /// bearer token it sent over TCP; `""` when tenancy is off or nothing matches (the
    /// operator and peers included).
    fn caller_tenant<T>(&self, req: &Request<T>) -> String {
        if !self.tenants.any() {
            return String::new();
        }
        self.roles.of(req).tenant().to_string()
    }

    /// The key mapping of session `sid`'s tenant (the default tenant's too); `None`
    /// (without touching the state) when tenancy is off.
    fn scope(&self, sid: SessionId) -> Result<Option<TenantScope>, ApiError> {
        if !self.tenants.any() {
            return Ok(None);
        }
        Ok(self.state().session_scope(sid).map(Some)?)
    }

    /// `keys` (or `packed`) of session `sid`, checked against the batch limit and mapped into
    /// the session's tenant scope: the keys the index and L3 know them by.
    fn session_keys(
        &self,
        sid: SessionId,
        raw: &[Vec<u8>],
        packed: &[u8],
    ) -> Result<(Vec<PageKey>, Option<TenantScope>), ApiError> {
        let mut keys = self.keys(raw, packed)?;
        let scope = self.scope(sid)?;
        if let Some(scope) = &scope {
            scope.apply_all(&mut keys);
        }
        Ok((keys, scope))
    }
}

#[tonic::async_trait]
impl HostTier for HostService {
    async fn register(
        &self,
        request: Request<v1::RegisterRequest>,
    ) -> Result<Response<v1::RegisterResponse>, Status> {
        let tenant = self.caller_tenant(&request);
        self.observe("register", || {
            self.register_inner(request.into_inner(), tenant)
        })
    }

    async fn heartbeat(
        &self,
        request: Request<v1::HeartbeatRequest>,
    ) -> Result<Response<v1::HeartbeatResponse>, Status> {
        self.observe("heartbeat", || {
            let mut st = self.state();
            let r = request.get_ref();
            st.heartbeat(
                session_id(&r.session_id)?,
                r.report.map(crate::wire::report_in),
                Instant::now(),
            )?;
            Ok(v1::HeartbeatResponse {
                ttl_ms: st.ttl().as_millis() as u64,
            })
        })
    }

    async fn close(
        &self,
        request: Request<v1::CloseRequest>,
    ) -> Result<Response<v1::CloseResponse>, Status> {
        self.observe("close", || {
            let id = session_id(&request.get_ref().session_id)?;
            self.state().close(id)?;
            tracing::info!(session = %id, "session closed");
            Ok(v1::CloseResponse {})
        })
    }

    async fn lookup(
        &self,
        request: Request<v1::LookupRequest>,
    ) -> Result<Response<v1::LookupResponse>, Status> {
        let t = Instant::now();
        let r = request.get_ref();
        let l3 = self.l3.current();
        let asked = r.include_storage && l3.is_some();
        let l2 = (|| {
            let id = session_id(&r.session_id)?;
            let (keys, _) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            let mut st = self.state();
            let now = Instant::now();
            let n = st.lookup(id, &keys, now)?;
            let fp = st.session_fingerprint(id)?;
            // Which keys are ready in L2, for L3's walk and for the key-by-key answer.
            let in_l2 = if asked || r.each_key {
                st.ready_mask(id, &keys, now)?
            } else {
                Vec::new()
            };
            Ok((keys, n, fp, in_l2))
        })();
        let result = match l2 {
            Ok((keys, n, fp, in_l2)) => {
                let present = match (&l3, r.each_key) {
                    (_, false) => Vec::new(),
                    (Some(l3), true) if asked => {
                        let ctx = kvtier_storage::OpCtx::timeout(l3.timeout);
                        self.prefetcher.present(l3, &ctx, fp, &keys, &in_l2).await
                    }
                    _ => in_l2.clone(),
                };
                let mut storage_pages = 0;
                if asked
                    && let Some(l3) = l3
                    && n < keys.len()
                {
                    // After the ready prefix, pages in L3 or (behind a page that left for
                    // L3) in L2; keys whose read just failed are not reported again until
                    // they expire.
                    let ctx = kvtier_storage::OpCtx::timeout(l3.timeout);
                    match self
                        .prefetcher
                        .reachable(&l3, &ctx, fp, &keys[n..], &in_l2[n..])
                        .await
                    {
                        Ok(m) => storage_pages = m as u32,
                        Err(e) => {
                            tracing::debug!("l3 lookup failed, reporting no storage hits: {e}")
                        }
                    }
                }
                let beyond = (keys.len() - n) as u64;
                self.metrics.observe_lookup(&keys);
                let tiers = &self.metrics.lookup_pages;
                tiers.with_label_values(&["l2"]).inc_by(n as u64);
                if asked {
                    tiers
                        .with_label_values(&["l3"])
                        .inc_by(u64::from(storage_pages));
                    tiers
                        .with_label_values(&["miss"])
                        .inc_by(beyond - u64::from(storage_pages));
                } else {
                    tiers.with_label_values(&["unchecked"]).inc_by(beyond);
                }
                Ok(v1::LookupResponse {
                    ready_pages: n as u32,
                    storage_pages,
                    present,
                })
            }
            Err(e) => Err(e),
        };
        self.finish("lookup", t, result)
    }

    async fn reserve(
        &self,
        request: Request<v1::ReserveRequest>,
    ) -> Result<Response<v1::ReserveResponse>, Status> {
        self.observe("reserve", || {
            let r = request.get_ref();
            let id = session_id(&r.session_id)?;
            let (keys, scope) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            let parent = scoped_parent(&r.parent, scope.as_ref())?;
            let (out, evicted) = self.state().reserve(id, parent, &keys, Instant::now())?;
            self.metrics.evictions.inc_by(evicted as u64);
            let mut resp = v1::ReserveResponse {
                status: Vec::with_capacity(out.len()),
                slots: Vec::with_capacity(out.len()),
            };
            let (mut reserved, mut present, mut no_space) = (0, 0, 0);
            for o in out {
                let (status, slot) = match o {
                    Reserve::Reserved(s) => {
                        reserved += 1;
                        (ReserveStatus::Reserved, s)
                    }
                    Reserve::Present => {
                        present += 1;
                        (ReserveStatus::Present, 0)
                    }
                    Reserve::NoSpace => {
                        no_space += 1;
                        (ReserveStatus::NoSpace, 0)
                    }
                };
                resp.status.push(status as i32);
                resp.slots.push(slot);
            }
            self.pages("reserved", reserved);
            self.pages("deduplicated", present);
            self.pages("no_space", no_space);
            Ok(resp)
        })
    }

    async fn commit(
        &self,
        request: Request<v1::CommitRequest>,
    ) -> Result<Response<v1::CommitResponse>, Status> {
        self.observe("commit", || {
            let r = request.get_ref();
            let id = session_id(&r.session_id)?;
            let (keys, _) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            let (jobs, leased, evicted) =
                self.state()
                    .commit(id, &keys, r.lease_want as usize, Instant::now())?;
            self.metrics.evictions.inc_by(evicted as u64);
            self.enqueue(jobs);
            self.pages("committed", keys.len());
            self.pages("leased", leased.len());
            Ok(v1::CommitResponse { leased })
        })
    }

    async fn commit_leased(
        &self,
        request: Request<v1::CommitLeasedRequest>,
    ) -> Result<Response<v1::CommitLeasedResponse>, Status> {
        self.observe("commit_leased", || {
            self.commit_leased_inner(request.get_ref())
        })
    }

    async fn abort(
        &self,
        request: Request<v1::AbortRequest>,
    ) -> Result<Response<v1::AbortResponse>, Status> {
        self.observe("abort", || {
            let r = request.get_ref();
            let id = session_id(&r.session_id)?;
            let (keys, _) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            self.state().abort(id, &keys, Instant::now())?;
            self.pages("aborted", keys.len());
            Ok(v1::AbortResponse {})
        })
    }

    async fn acquire(
        &self,
        request: Request<v1::AcquireRequest>,
    ) -> Result<Response<v1::AcquireResponse>, Status> {
        self.observe("acquire", || {
            let r = request.get_ref();
            let id = session_id(&r.session_id)?;
            let (keys, _) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            let (slots, jobs) = self.state().acquire(id, &keys, Instant::now())?;
            self.enqueue(jobs);
            self.pages("acquired", slots.len());
            Ok(v1::AcquireResponse { slots })
        })
    }

    async fn release(
        &self,
        request: Request<v1::ReleaseRequest>,
    ) -> Result<Response<v1::ReleaseResponse>, Status> {
        self.observe("release", || {
            let r = request.get_ref();
            let id = session_id(&r.session_id)?;
            let (keys, _) = self.session_keys(id, &r.keys, &r.packed_keys)?;
            self.state().release(id, &keys, Instant::now())?;
            self.pages("released", keys.len());
            Ok(v1::ReleaseResponse {})
        })
    }

    async fn stats(
        &self,
        request: Request<v1::StatsRequest>,
    ) -> Result<Response<v1::StatsResponse>, Status> {
        // A tenant sees its own sessions, the pools they use and its own usage only.
        let role = self.roles.of(&request);
        let only = self.roles.only_tenant(&role).map(str::to_string);
        self.observe("stats", || self.stats_inner(only.as_deref()))
    }

    type PrefetchStream = WireProgressStream;

    async fn prefetch(
        &self,
        request: Request<v1::PrefetchRequest>,
    ) -> Result<Response<Self::PrefetchStream>, Status> {
        let t = Instant::now();
        let ask = crate::wire::prefetch_ask(request.into_inner()).and_then(|mut ask| {
            // The keys and the parent in the session's tenant scope.
            if let Some(scope) = self.scope(ask.session)? {
                scope.apply_all(&mut ask.keys);
                ask.parent = ask.parent.map(|p| scope.apply(&p));
            }
            Ok(ask)
        });
        let r = match ask {
            Ok(ask) => self.prefetcher.start(ask).await,
            Err(e) => Err(e),
        };
        let r = r.map(|s| {
            use futures::StreamExt;
            Box::pin(s.map(|p| Ok(crate::wire::progress(p)))) as WireProgressStream
        });
        self.finish("prefetch", t, r)
    }

    async fn prefetch_status(
        &self,
        request: Request<v1::PrefetchStatusRequest>,
    ) -> Result<Response<v1::PrefetchProgress>, Status> {
        self.observe("prefetch_status", || {
            let r = request.get_ref();
            let p = self
                .prefetcher
                .status(session_id(&r.session_id)?, &r.request_id)?;
            Ok(crate::wire::progress(p))
        })
    }

    async fn take_prefetch(
        &self,
        request: Request<v1::TakePrefetchRequest>,
    ) -> Result<Response<v1::TakePrefetchResponse>, Status> {
        let t = Instant::now();
        let req = request.get_ref();
        let r = match session_id(&req.session_id) {
            Ok(id) => self.prefetcher.take(id, &req.request_id).await,
            Err(e) => Err(e),
        }
        .map(|(p, slots)| v1::TakePrefetchResponse {
            progress: Some(crate::wire::progress(p)),
            slots,
        });
        if let Ok(resp) = &r {
            self.pages("acquired", resp.slots.len());
        }
        self.finish("take_prefetch", t, r)
    }

    async fn release_prefetch(
        &self,
        request: Request<v1::ReleasePrefetchRequest>,
    ) -> Result<Response<v1::ReleasePrefetchResponse>, Status> {
        self.observe("release_prefetch", || {
            let r = request.get_ref();
            self.prefetcher
                .release(session_id(&r.session_id)?, &r.request_id)?;
            Ok(v1::ReleasePrefetchResponse {})
        })
    }

    type WatchMetricsStream = SnapshotStream;

    async fn watch_metrics(
        &self,
        request: Request<v1::WatchMetricsRequest>,
    ) -> Result<Response<Self::WatchMetricsStream>, Status> {
        // A tenant gets no series labelled with another tenant.
        let role = self.roles.of(&request);
        let only = self.roles.only_tenant(&role).map(str::to_string);
        self.observe("watch_metrics", || {
            let slot = self
                .streams
                .open("watch_metrics", &role, routing::unix_uid(&request))?;
            self.watch_metrics_inner(request.get_ref().interval_ms, only, slot)
        })
    }

    type WatchEventsStream = EventStream;

    async fn watch_events(
        &self,
        request: Request<v1::WatchEventsRequest>,
    ) -> Result<Response<Self::WatchEventsStream>, Status> {
        use futures::StreamExt;
        use prost::Message;
        let encoded = self.watch_events_call(request)?.into_inner();
        let decoded = encoded.map(|m| {
            m.and_then(|b| v1::EventBatch::decode(b).map_err(|e| Status::internal(e.to_string())))
        });
        Ok(Response::new(Box::pin(decoded) as EventStream))
    }

    async fn locate(
        &self,
        request: Request<v1::LocateRequest>,
    ) -> Result<Response<v1::LocateResponse>, Status> {
        self.locate_call(request).await
    }
}
