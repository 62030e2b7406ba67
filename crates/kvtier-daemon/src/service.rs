//! The `kvtier.v1.HostTier` gRPC service: validates every request once, on receive, then
//! calls into [`HostState`]. Errors are [`ApiError`]s, turned into gRPC status codes by the
//! one conversion in kvtier-proto.

use std::sync::Arc;
use std::time::Instant;

use kvtier_core::host_index::Reserve;
use kvtier_core::{Layout, Namespace, PageHasher, PageKey};
use kvtier_core::{SessionId, TenantScope};
use kvtier_proto::v1::host_tier_server::HostTier;
use kvtier_proto::v1::{self, ReserveStatus};
use kvtier_proto::{ApiError, page_keys, request_key_count, request_keys, session_id};
use tonic::{Request, Response, Status};

use crate::l3::L3Slot;
use crate::prefetch::Prefetcher;
use crate::roles::Roles;
use crate::state::Shared;
use crate::state::{HostState, L2Metrics, StateGuard};
use kvtier_config::tenants::Tenants;
use kvtier_server::metrics::MetricRegistry;

/// Shortest, default and longest interval between WatchMetrics snapshots.
const WATCH_MIN_MS: u64 = 100;
const WATCH_DEFAULT_MS: u64 = 1000;
/// Most sessions one Stats answer lists (the rest are counted in `sessions_omitted`), so
/// the answer stays far below the 4 MiB message limit however many sessions there are.
const STATS_MAX_SESSIONS: usize = 1000;
const WATCH_MAX_MS: u64 = 60_000;

/// The stream a WatchMetrics call returns.
type SnapshotStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::MetricsSnapshot, Status>> + Send>>;

mod events_route;
mod lease;
mod routing;

pub use events_route::HostTierRoutes;

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

/// Most tokens a hash self-test may carry.
const MAX_SELF_TEST_TOKENS: usize = 1 << 16;

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
    shutdown: tokio_util::sync::CancellationToken,
    /// Who is which tenant (empty: tenancy off), and who sees all of them.
    roles: Arc<Roles>,
    /// The tenants of `roles`.
    tenants: Arc<Tenants>,
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
        shutdown: tokio_util::sync::CancellationToken,
    ) -> Result<Self, prometheus::Error> {
        state
            .lock()
            .set_event_metrics(crate::events::EventMetrics::new(&registry)?);
        Ok(Self {
            metrics: L2Metrics::new(&registry, state.clone())?,
            state,
            registry,
            max_batch,
            started: Instant::now(),
            metrics_address,
            l3,
            prefetcher,
            shutdown,
            roles: Arc::new(Roles::open()),
            tenants: Arc::new(Tenants::default()),
        })
    }

    /// Binds sessions to their caller's tenant at registration and scopes their keys
    /// (`[tenants]`); shows each tenant only its own sessions in Stats and WatchMetrics.
    pub fn with_roles(mut self, roles: Arc<Roles>) -> Self {
        self.tenants = roles.tenants().clone();
        self.roles = roles;
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
            Err(ApiError::NotFound(_)) => "not_found",
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

    /// Every tenant's use of L2 and L3, for Stats.
    fn tenant_usage(&self, st: &HostState) -> Vec<v1::TenantUsage> {
        let l3 = self
            .l3
            .current()
            .map(|l3| l3.store.store_stats().tenants)
            .unwrap_or_default();
        st.tenant_usage()
            .into_iter()
            .map(|(tenant, tag, u)| {
                let b = l3
                    .iter()
                    .find(|t| t.tag == tag)
                    .cloned()
                    .unwrap_or_default();
                v1::TenantUsage {
                    tenant,
                    l2_pages: u.pages,
                    l2_quota_pages: u.quota.unwrap_or(0),
                    l2_quota_evictions: u.quota_evictions,
                    l2_quota_refusals: u.quota_refusals,
                    l3_objects: b.objects,
                    l3_bytes: b.bytes,
                    l3_quota_bytes: b.quota,
                    l3_quota_evictions: b.evictions,
                }
            })
            .collect()
    }

    fn register_inner(
        &self,
        req: v1::RegisterRequest,
        tenant: String,
    ) -> Result<v1::RegisterResponse, ApiError> {
        let layout = Layout::try_from(
            req.layout
                .ok_or_else(|| ApiError::invalid("layout", "required"))?,
        )
        .map_err(|e| e.within("layout"))?;
        if req.name.len() > 256 {
            return Err(ApiError::invalid("name", "longer than 256 bytes"));
        }
        let info = v1::LayoutInfo::from(&layout);
        if let Some(exp) = req.expected_layout {
            let checks = [
                ("fingerprint", exp.fingerprint != info.fingerprint),
                ("page_bytes", exp.page_bytes != info.page_bytes),
                ("slot_stride", exp.slot_stride != info.slot_stride),
                ("run_bytes", exp.run_bytes != info.run_bytes),
                ("runs_per_page", exp.runs_per_page != info.runs_per_page),
                ("format_version", exp.format_version != info.format_version),
            ];
            if let Some((field, _)) = checks.iter().find(|(_, differs)| *differs) {
                return Err(ApiError::FailedPrecondition(format!(
                    "layout mismatch: the client derived a different {field} from the same \
                     descriptor (client {exp:?}, daemon {info:?}); upgrade the older side"
                )));
            }
        }
        let ns = check_self_test(&layout, req.hash_self_test)?;
        if self.tenants.any() && !ns.tenant.is_empty() && ns.tenant != tenant {
            return Err(ApiError::PermissionDenied(format!(
                "hash_self_test.namespace.tenant is {:?}, but this caller is tenant {tenant:?} \
                 (by its peer uid or token, [tenants] in kvtierd's config)",
                ns.tenant
            )));
        }
        let name = if req.name.is_empty() {
            "unnamed".to_string()
        } else {
            req.name
        };
        let mut st = self.state();
        let reg = st.register(name.clone(), &tenant, &layout, Instant::now())?;
        let ttl = st.ttl();
        drop(st);
        tracing::info!(session = %reg.session_id, client = %name, tenant = %tenant, fingerprint = %layout.fingerprint(), "session registered");
        Ok(v1::RegisterResponse {
            session_id: reg.session_id.to_bytes().to_vec(),
            ttl_ms: ttl.as_millis() as u64,
            layout: Some(info),
            pool_path: reg.pool_path.display().to_string(),
            pool_slots: reg.slots,
            slot_stride: reg.stride as u64,
            tenant,
        })
    }
}

/// Recomputes the client's self-test keys; refuses a client whose hashing differs.
fn check_self_test(layout: &Layout, t: Option<v1::HashSelfTest>) -> Result<Namespace, ApiError> {
    let t = t.ok_or_else(|| {
        ApiError::invalid(
            "hash_self_test",
            "required: the keys the client computes for a few pages of tokens",
        )
    })?;
    if t.page_size as usize != layout.page_size() {
        return Err(ApiError::invalid(
            "hash_self_test.page_size",
            format!(
                "{} differs from layout.page_size {}",
                t.page_size,
                layout.page_size()
            ),
        ));
    }
    if t.tokens.len() > MAX_SELF_TEST_TOKENS {
        return Err(ApiError::invalid(
            "hash_self_test.tokens",
            format!("more than {MAX_SELF_TEST_TOKENS} tokens"),
        ));
    }
    if t.tokens.len() < layout.page_size() {
        return Err(ApiError::invalid(
            "hash_self_test.tokens",
            "fewer than one full page of tokens",
        ));
    }
    let ns = Namespace::try_from(t.namespace.unwrap_or_default())
        .map_err(|e| e.within("hash_self_test.namespace"))?;
    let theirs = page_keys("hash_self_test.keys", &t.keys)?;
    let ours = PageHasher::new(layout.page_size(), &ns)?.keys(&t.tokens);
    if theirs.len() != ours.len() {
        return Err(ApiError::FailedPrecondition(format!(
            "hash self-test failed: the client sent {} keys for {} tokens of page size {}, the \
             daemon computes {}",
            theirs.len(),
            t.tokens.len(),
            layout.page_size(),
            ours.len()
        )));
    }
    if let Some(i) = ours.iter().zip(&theirs).position(|(a, b)| a != b) {
        return Err(ApiError::FailedPrecondition(format!(
            "hash self-test failed at page {i}: client key {} but daemon key {}; the client \
             does not hash pages as docs/hash-spec.md specifies",
            theirs[i].to_hex(),
            ours[i].to_hex()
        )));
    }
    Ok(ns)
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
        let mine = |tenant: &str| only.as_deref().is_none_or(|t| t == tenant);
        self.observe("stats", || {
            let st = self.state();
            let now = Instant::now();
            let mut sessions: Vec<_> = st.sessions().filter(|(_, s)| mine(&s.tenant)).collect();
            let seen: std::collections::HashSet<_> = sessions.iter().map(|(_, s)| s.pool).collect();
            let pools = st
                .pools()
                .filter(|p| only.is_none() || seen.contains(&p.key))
                .map(|p| {
                    let s = p.index.stats();
                    v1::PoolStats {
                        fingerprint: p.layout.fingerprint().0.to_vec(),
                        model_id: p.layout.spec().model_id.clone(),
                        pool_path: p.shm.path().display().to_string(),
                        slots: s.capacity,
                        slot_stride: p.shm.stride() as u64,
                        ready_pages: s.ready,
                        writing_pages: s.writing,
                        pinned_pages: s.pinned,
                        pins: s.pins,
                        evictions: s.evictions,
                        mlocked: p.shm.is_locked(),
                        huge_pages: p.shm.huge_pages(),
                    }
                })
                .collect();
            // The most recently seen first, at most STATS_MAX_SESSIONS of them.
            sessions.sort_by_key(|(_, s)| std::cmp::Reverse(s.last_seen));
            let omitted = sessions.len().saturating_sub(STATS_MAX_SESSIONS);
            sessions.truncate(STATS_MAX_SESSIONS);
            let sessions = sessions
                .into_iter()
                .map(|(id, s)| v1::SessionInfo {
                    session_label: id.to_string(),
                    name: s.name.clone(),
                    fingerprint: s.fingerprint.0.to_vec(),
                    pins: s.pins.values().map(|&n| u64::from(n)).sum(),
                    writing_pages: s.writing as u32,
                    idle_ms: now.saturating_duration_since(s.last_seen).as_millis() as u64,
                    report: s.report.map(crate::wire::report_out),
                    tenant: s.tenant.clone(),
                })
                .collect();
            let c = st.counters;
            let mut tenants = self.tenant_usage(&st);
            tenants.retain(|u| mine(&u.tenant));
            Ok(v1::StatsResponse {
                version: env!("CARGO_PKG_VERSION").to_string(),
                uptime_ms: self.started.elapsed().as_millis() as u64,
                pools,
                sessions,
                reserve_calls: c.reserve_calls,
                commit_calls: c.commit_calls,
                acquire_calls: c.acquire_calls,
                dedup_pages: c.dedup_pages,
                expired_sessions: c.expired_sessions,
                metrics_address: self.metrics_address.clone(),
                l3: self
                    .l3
                    .current()
                    .map(|l3| crate::l3::wire_stats(&l3, st.write_policy())),
                tenants,
                sessions_omitted: omitted as u32,
            })
        })
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
            let ms = match request.get_ref().interval_ms {
                0 => WATCH_DEFAULT_MS,
                ms if (WATCH_MIN_MS..=WATCH_MAX_MS).contains(&ms) => ms,
                ms => {
                    return Err(ApiError::invalid(
                        "interval_ms",
                        format!("{ms} is outside {WATCH_MIN_MS}..={WATCH_MAX_MS}"),
                    ));
                }
            };
            let svc = self.clone();
            let only = only.clone();
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(ms));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let stream = futures::stream::unfold((svc, tick, 0u64), move |(svc, mut tick, seq)| {
                let only = only.clone();
                async move {
                    tokio::select! {
                        () = svc.shutdown.cancelled() => return None,
                        _ = tick.tick() => {}
                    }
                    let families = svc.registry.gather();
                    let snap = v1::MetricsSnapshot {
                        seq: seq + 1,
                        unix_ms: std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map(|d| d.as_millis() as u64)
                            .unwrap_or_default(),
                        uptime_ms: svc.started.elapsed().as_millis() as u64,
                        samples: crate::wire::samples(&families, only.as_deref()),
                    };
                    Some((Ok(snap), (svc, tick, seq + 1)))
                }
            });
            Ok(Box::pin(stream) as SnapshotStream)
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
