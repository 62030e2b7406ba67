//! What kvtierd shows of itself over HostTier: `Stats` (pools, sessions, counters, every
//! tenant's use of L2 and L3) and `WatchMetrics` (snapshots of the Prometheus registry at an
//! interval). A tenant's caller sees only its own sessions, usage and series, and of the
//! pools what the tenant table lets it ([`HostState::sees`]): of a pool tenants share, its own
//! pages only.

use std::time::Instant;

use kvtier_proto::{ApiError, v1};
use tonic::Status;

use super::HostService;
use crate::state::{HostState, Sees};

/// Shortest, default and longest interval between WatchMetrics snapshots.
const WATCH_MIN_MS: u64 = 100;
const WATCH_DEFAULT_MS: u64 = 1000;
const WATCH_MAX_MS: u64 = 60_000;
/// Most sessions one Stats answer lists (the rest are counted in `sessions_omitted`), so
/// the answer stays far below the 4 MiB message limit however many sessions there are.
const STATS_MAX_SESSIONS: usize = 1000;

/// The stream a WatchMetrics call returns.
pub(super) type SnapshotStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::MetricsSnapshot, Status>> + Send>>;

impl HostService {
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

    /// The Stats answer; `only`: the tenant the caller is limited to.
    pub(super) fn stats_inner(&self, only: Option<&str>) -> Result<v1::StatsResponse, ApiError> {
        let mine = |tenant: &str| only.is_none_or(|t| t == tenant);
        let st = self.state();
        let now = Instant::now();
        let mut sessions: Vec<_> = st.sessions().filter(|(_, s)| mine(&s.tenant)).collect();
        let used: std::collections::HashSet<_> = sessions.iter().map(|(_, s)| s.pool).collect();
        // What the tenant table lets the caller see of each pool: all of it (the operator, or
        // a pool that holds this tenant's pages alone), nothing (another tenant's own pool),
        // or, of a pool tenants share, its own pages only (the other counts are the pool's
        // and so everyone's: 0), listed when it has pages or a session there.
        let pools = st
            .pools()
            .filter_map(|p| {
                let s = p.index.stats();
                let mut out = v1::PoolStats {
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
                };
                match st.sees(only, p) {
                    Sees::Nothing => None,
                    Sees::All => Some(out),
                    Sees::Only(t) if st.own_pool_tenant(p) == Some(t) => Some(out),
                    Sees::Only(t) => {
                        let mine = p.index.tenant_usage(t).map_or(0, |u| u.pages);
                        (mine > 0 || used.contains(&p.key)).then(|| {
                            out.ready_pages = mine;
                            out.writing_pages = 0;
                            out.pinned_pages = 0;
                            out.pins = 0;
                            out.evictions = 0;
                            out
                        })
                    }
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
    }

    /// A WatchMetrics stream, a snapshot every `interval_ms` (0: the default); `only`: the
    /// tenant whose series alone the caller may see.
    pub(super) fn watch_metrics_inner(
        &self,
        interval_ms: u64,
        only: Option<String>,
        slot: crate::streams::StreamSlot,
    ) -> Result<SnapshotStream, ApiError> {
        let ms = match interval_ms {
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
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(ms));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The slot goes with the stream's state: the caller's place is back when it ends.
        let state = (svc, tick, 0u64, slot);
        let stream = futures::stream::unfold(state, move |(svc, mut tick, seq, slot)| {
            let only = only.clone();
            async move {
                tokio::select! {
                    () = svc.tasks.shutdown.cancelled() => return None,
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
                Some((Ok(snap), (svc, tick, seq + 1, slot)))
            }
        });
        Ok(Box::pin(stream) as SnapshotStream)
    }
}
