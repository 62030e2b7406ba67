//! The daemon's metrics, declared in one place, and the Prometheus text endpoint.
//!
//! Names follow `kvtier_<subsystem>_<noun>_<unit>`; counters end in `_total`; durations are
//! `_seconds` histograms; labels are bounded (`op`, `outcome`, `state`). Gauges that mirror the
//! index are refreshed from the state at scrape time, so they can never drift.

use std::sync::Mutex;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::state::HostState;

/// Every metric of kvtierd.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `kvtier_l2_requests_total{op, outcome}`.
    pub requests: IntCounterVec,
    /// `kvtier_l2_request_duration_seconds{op}`.
    pub request_seconds: HistogramVec,
    /// `kvtier_l2_pages_total{op}`: pages reserved, committed, acquired, released, deduplicated, no_space.
    pub pages: IntCounterVec,
    /// `kvtier_l2_evictions_total`.
    pub evictions: IntCounter,
    /// `kvtier_l2_expired_sessions_total`.
    pub expired_sessions: IntCounter,
    /// `kvtier_l2_dropped_pins_total`: pins dropped because a session ended holding them.
    pub dropped_pins: IntCounter,
    /// `kvtier_l2_dropped_reservations_total`.
    pub dropped_reservations: IntCounter,
    /// `kvtier_l2_lost_pages_total{reason}`: pages evicted from L2 that L3 did not hold
    /// (`no_l3`, `l3_down`).
    lost_pages: IntCounterVec,
    /// `kvtier_l2_takeover_pages_total{outcome}`: pages of a crashed kvtierd's pools.
    takeover_pages: IntCounterVec,
    /// `kvtier_l2_takeover_pools_total{outcome}`.
    takeover_pools: IntCounterVec,
    /// `kvtier_l2_sealed_pages_total`.
    sealed_pages: IntCounter,
    /// `kvtier_l3_writes_total{outcome}`: written, present (already in L3), failed, deferred.
    pub l3_writes: IntCounterVec,
    /// `kvtier_l3_write_bytes_total`.
    pub l3_write_bytes: IntCounter,
    /// `kvtier_l3_write_duration_seconds`.
    pub l3_write_seconds: prometheus::Histogram,
    l3_queue: IntGauge,
    l3_objects: IntGauge,
    l3_bytes: IntGauge,
    l3_evictions: IntGauge,
    l3_breaker_open: IntGauge,
    l3_breaker_transitions: IntCounterVec,
    l3_retries: IntCounterVec,
    l3_read_window: IntGauge,
    /// `kvtier_l3_backend_ops_total{backend, op, outcome}`.
    pub l3_ops: IntCounterVec,
    /// `kvtier_l3_backend_bytes_total{backend, op}`.
    pub l3_op_bytes: IntCounterVec,
    /// `kvtier_l3_backend_op_duration_seconds{backend, op}`.
    pub l3_op_seconds: HistogramVec,
    /// `kvtier_l3_write_bandwidth_gigabytes_per_second`: per written page.
    pub l3_write_bandwidth: prometheus::Histogram,
    /// `kvtier_lookup_pages_total{tier}`: where looked-up pages are (l2, l3, miss, unchecked).
    pub lookup_pages: IntCounterVec,
    /// `kvtier_prefetch_requests_total{outcome, reason}`.
    pub prefetch_requests: IntCounterVec,
    /// `kvtier_prefetch_pages_total{stage}`: requested, in_l2, hit, landed.
    pub prefetch_pages: IntCounterVec,
    /// `kvtier_prefetch_bytes_total{stage}`: hit, landed.
    pub prefetch_bytes: IntCounterVec,
    /// `kvtier_prefetch_duration_seconds`: start to done.
    pub prefetch_seconds: prometheus::Histogram,
    /// `kvtier_prefetch_rereads_total`: page reads tried again after a transient failure.
    pub prefetch_rereads: IntCounter,
    /// `kvtier_prefetch_wait_seconds`: how long a take waited.
    pub prefetch_wait_seconds: prometheus::Histogram,
    /// `kvtier_prefetch_bandwidth_gigabytes_per_second`: per prefetch that landed pages.
    pub prefetch_bandwidth: prometheus::Histogram,
    /// `kvtier_prefetch_negative_keys`: keys remembered as failed.
    pub prefetch_negative_keys: IntGauge,
    prefetch_inflight: IntGauge,
    prefetch_budget: IntGaugeVec,
    /// `kvtier_sglang_transfers_total{op, outcome}`: SGLang HiCache RPC objects by operation
    /// (exist, put, get) and outcome (ok, not_found, out_of_range, no_pool, invalid,
    /// unavailable, internal).
    pub sglang_transfers: IntCounterVec,
    /// `kvtier_sglang_bytes_total{op}`: bytes moved by SGLang puts and gets.
    pub sglang_bytes: IntCounterVec,
    /// `kvtier_sglang_batch_duration_seconds{op}`: time of one SGLang batch.
    pub sglang_seconds: HistogramVec,
    /// `kvtier_sglang_pools`: SGLang host pools registered now.
    pub sglang_pools: IntGauge,
    /// `kvtier_sglang_hits_total{op, tier}`: SGLang gets served and exists answered true, by
    /// where the object was (memory, l3).
    pub sglang_hits: IntCounterVec,
    /// `kvtier_sglang_memory_bytes`: bytes of SGLang objects kept in kvtierd's memory.
    pub sglang_memory_bytes: IntGauge,
    /// `kvtier_sglang_memory_objects`: SGLang objects kept in kvtierd's memory.
    pub sglang_memory_objects: IntGauge,
    /// `kvtier_sglang_memory_evictions_total`: SGLang objects pushed out of memory for room.
    pub sglang_memory_evictions: IntCounter,
    pool_bytes: IntGaugeVec,
    pool_pages: IntGaugeVec,
    dirty_pages: IntGauge,
    pinned_pages: IntGauge,
    pins: IntGauge,
    sessions: IntGauge,
    pools: IntGauge,
}

/// Names of every metric, for docs/metrics.md and a test that keeps both in step.
pub const METRIC_NAMES: &[&str] = &[
    "kvtier_l2_requests_total",
    "kvtier_l2_request_duration_seconds",
    "kvtier_l2_pages_total",
    "kvtier_l2_evictions_total",
    "kvtier_l2_expired_sessions_total",
    "kvtier_l2_dropped_pins_total",
    "kvtier_l2_dropped_reservations_total",
    "kvtier_l2_lost_pages_total",
    "kvtier_l2_takeover_pages_total",
    "kvtier_l2_takeover_pools_total",
    "kvtier_l2_sealed_pages_total",
    "kvtier_l2_pool_bytes",
    "kvtier_l2_pool_pages",
    "kvtier_l2_dirty_pages",
    "kvtier_l2_pinned_pages",
    "kvtier_l2_pins",
    "kvtier_l2_sessions",
    "kvtier_l2_pools",
    "kvtier_l3_writes_total",
    "kvtier_l3_write_bytes_total",
    "kvtier_l3_write_duration_seconds",
    "kvtier_l3_queue_pages",
    "kvtier_l3_objects",
    "kvtier_l3_bytes",
    "kvtier_l3_evicted_objects",
    "kvtier_l3_breaker_open",
    "kvtier_l3_breaker_transitions_total",
    "kvtier_l3_retries_total",
    "kvtier_l3_read_window",
    "kvtier_l3_backend_ops_total",
    "kvtier_l3_backend_bytes_total",
    "kvtier_l3_backend_op_duration_seconds",
    "kvtier_l3_write_bandwidth_gigabytes_per_second",
    "kvtier_lookup_pages_total",
    "kvtier_prefetch_requests_total",
    "kvtier_prefetch_pages_total",
    "kvtier_prefetch_bytes_total",
    "kvtier_prefetch_duration_seconds",
    "kvtier_prefetch_rereads_total",
    "kvtier_prefetch_wait_seconds",
    "kvtier_prefetch_bandwidth_gigabytes_per_second",
    "kvtier_prefetch_negative_keys",
    "kvtier_prefetch_inflight",
    "kvtier_prefetch_budget_pages",
    "kvtier_sglang_transfers_total",
    "kvtier_sglang_bytes_total",
    "kvtier_sglang_batch_duration_seconds",
    "kvtier_sglang_pools",
    "kvtier_sglang_hits_total",
    "kvtier_sglang_memory_bytes",
    "kvtier_sglang_memory_objects",
    "kvtier_sglang_memory_evictions_total",
];

/// Buckets of the bandwidth histograms, in GB/s (10^9 bytes per second).
const GBPS_BUCKETS: [f64; 12] = [
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0,
];

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    // Names are unique constants, so registration cannot collide.
    if let Err(e) = r.register(Box::new(m.clone())) {
        unreachable!("duplicate metric: {e}");
    }
    m
}

impl Metrics {
    /// Creates and registers every metric, with the series of known label values at zero
    /// (so dashboards and rates see them before the first event).
    pub fn new() -> Result<Self, prometheus::Error> {
        let m = Self::declare()?;
        for tier in ["l2", "l3", "miss", "unchecked"] {
            m.lookup_pages.with_label_values(&[tier]);
        }
        for stage in ["requested", "in_l2", "hit", "landed"] {
            m.prefetch_pages.with_label_values(&[stage]);
        }
        for stage in ["requested", "hit", "landed"] {
            m.prefetch_bytes.with_label_values(&[stage]);
        }
        for outcome in ["completed", "partial", "timed_out"] {
            m.prefetch_requests.with_label_values(&[outcome, ""]);
        }
        for outcome in ["written", "present", "failed", "deferred"] {
            m.l3_writes.with_label_values(&[outcome]);
        }
        for reason in ["no_l3", "l3_down"] {
            m.lost_pages.with_label_values(&[reason]);
        }
        for op in ["exist", "put", "get"] {
            m.sglang_transfers.with_label_values(&[op, "ok"]);
            m.sglang_seconds.with_label_values(&[op]);
        }
        for op in ["put", "get"] {
            m.sglang_bytes.with_label_values(&[op]);
        }
        for op in ["exist", "get"] {
            for tier in ["memory", "l3"] {
                m.sglang_hits.with_label_values(&[op, tier]);
            }
        }
        Ok(m)
    }

    fn declare() -> Result<Self, prometheus::Error> {
        let r = Registry::new();
        let buckets = vec![
            25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
            0.25, 1.0,
        ];
        Ok(Self {
            requests: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_requests_total",
                        "Host-tier RPCs by operation and outcome",
                    ),
                    &["op", "outcome"],
                )?,
            ),
            request_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_l2_request_duration_seconds",
                        "Time to serve a host-tier RPC, by operation",
                    )
                    .buckets(buckets),
                    &["op"],
                )?,
            ),
            pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_pages_total",
                        "Pages by operation: reserved, deduplicated, no_space, committed, acquired, released",
                    ),
                    &["op"],
                )?,
            ),
            evictions: reg(
                &r,
                IntCounter::new("kvtier_l2_evictions_total", "Pages evicted from L2")?,
            ),
            expired_sessions: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_expired_sessions_total",
                    "Sessions ended because their lease expired",
                )?,
            ),
            dropped_pins: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_dropped_pins_total",
                    "Pins dropped because their session ended holding them",
                )?,
            ),
            dropped_reservations: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_dropped_reservations_total",
                    "Reserved pages freed because their session ended before committing",
                )?,
            ),
            lost_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_lost_pages_total",
                        "Pages evicted from L2 that L3 did not hold, by reason: no_l3, l3_down",
                    ),
                    &["reason"],
                )?,
            ),
            takeover_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_takeover_pages_total",
                        "Pages of a crashed kvtierd's pools found at start, by outcome: \
                         adopted (verified and served), refused_checksum (bytes no longer \
                         match their sealed record), no_room (the new pool was full)",
                    ),
                    &["outcome"],
                )?,
            ),
            takeover_pools: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_takeover_pools_total",
                        "Pools of crashed kvtierd processes found at start: taken_over, or \
                         removed (no or damaged slot table, foreign layout, takeover off)",
                    ),
                    &["outcome"],
                )?,
            ),
            sealed_pages: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_sealed_pages_total",
                    "Committed L2 pages checksummed and recorded beside their pool, so a \
                     kvtierd started after a crash can take them over",
                )?,
            ),
            pool_bytes: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "kvtier_l2_pool_bytes",
                        "Shared-memory pool bytes: total, used",
                    ),
                    &["state"],
                )?,
            ),
            dirty_pages: reg(
                &r,
                IntGauge::new(
                    "kvtier_l2_dirty_pages",
                    "Pages clients wrote to L2 that L3 does not hold yet",
                )?,
            ),
            pool_pages: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "kvtier_l2_pool_pages",
                        "Pool pages by state: ready, writing, free",
                    ),
                    &["state"],
                )?,
            ),
            pinned_pages: reg(
                &r,
                IntGauge::new("kvtier_l2_pinned_pages", "Pages with at least one pin")?,
            ),
            pins: reg(
                &r,
                IntGauge::new("kvtier_l2_pins", "Pins held, with multiplicity")?,
            ),
            sessions: reg(
                &r,
                IntGauge::new("kvtier_l2_sessions", "Live client sessions")?,
            ),
            pools: reg(
                &r,
                IntGauge::new("kvtier_l2_pools", "Pool classes (layouts) served")?,
            ),
            l3_writes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_writes_total",
                        "Pages sent to L3 by outcome: written, present, failed, dropped",
                    ),
                    &["outcome"],
                )?,
            ),
            l3_write_bytes: reg(
                &r,
                IntCounter::new("kvtier_l3_write_bytes_total", "Page bytes written to L3")?,
            ),
            l3_write_seconds: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_l3_write_duration_seconds",
                        "Time to write one page to L3, retries included",
                    )
                    .buckets(vec![1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
                )?,
            ),
            l3_queue: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_queue_pages",
                    "Pages queued or being written to L3",
                )?,
            ),
            l3_objects: reg(&r, IntGauge::new("kvtier_l3_objects", "Pages held by L3")?),
            l3_bytes: reg(&r, IntGauge::new("kvtier_l3_bytes", "Bytes held by L3")?),
            l3_evictions: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_evicted_objects",
                    "Pages L3 evicted to honour its capacity since start",
                )?,
            ),
            l3_breaker_open: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_breaker_open",
                    "1 while the L3 backend's circuit breaker is open or probing",
                )?,
            ),
            l3_breaker_transitions: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_breaker_transitions_total",
                        "L3 circuit breaker transitions: to=open (sustained failure), \
                         half_open (a probe let through), closed (a probe succeeded)",
                    ),
                    &["to"],
                )?,
            ),
            l3_read_window: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_read_window",
                    "Reads a prefetch keeps in flight against L3 now, learnt from their \
                     latencies (between prefetch.concurrency and prefetch.max_concurrency)",
                )?,
            ),
            l3_retries: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_retries_total",
                        "Retries of L3 backend calls after a transient failure: \
                         outcome=retried (attempts), saved (calls a retry turned into success)",
                    ),
                    &["outcome"],
                )?,
            ),
            l3_ops: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_backend_ops_total",
                        "Calls to the L3 backend by operation and outcome (hit, miss, ok, or the error reason)",
                    ),
                    &["backend", "op", "outcome"],
                )?,
            ),
            l3_op_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_backend_bytes_total",
                        "Bytes moved by L3 backend calls",
                    ),
                    &["backend", "op"],
                )?,
            ),
            l3_op_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_l3_backend_op_duration_seconds",
                        "Time of one L3 backend call",
                    )
                    .buckets(vec![1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
                    &["backend", "op"],
                )?,
            ),
            l3_write_bandwidth: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_l3_write_bandwidth_gigabytes_per_second",
                        "Backup (L2 to L3) bandwidth of each written page, in GB/s",
                    )
                    .buckets(GBPS_BUCKETS.to_vec()),
                )?,
            ),
            lookup_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_lookup_pages_total",
                        "Looked-up pages by where they were found: l2, l3, miss (in neither), \
                         unchecked (not in L2; L3 not asked)",
                    ),
                    &["tier"],
                )?,
            ),
            prefetch_requests: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_prefetch_requests_total",
                        "Prefetches by outcome (completed, partial, timed_out, revoked, failed) \
                         and reason",
                    ),
                    &["outcome", "reason"],
                )?,
            ),
            prefetch_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_prefetch_pages_total",
                        "Prefetch pages by stage: requested, in_l2 (skipped), hit (fetched from \
                         L3), landed",
                    ),
                    &["stage"],
                )?,
            ),
            prefetch_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_prefetch_bytes_total",
                        "Prefetch page bytes by stage: requested, hit, landed",
                    ),
                    &["stage"],
                )?,
            ),
            prefetch_rereads: reg(
                &r,
                IntCounter::new(
                    "kvtier_prefetch_rereads_total",
                    "Prefetch page reads tried again after a transient failure the store's own \
                     retries did not save",
                )?,
            ),
            prefetch_seconds: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_prefetch_duration_seconds",
                        "Time from a prefetch's start until it is done (landed, timed out, \
                         failed or taken)",
                    )
                    .buckets(vec![
                        1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                    ]),
                )?,
            ),
            prefetch_wait_seconds: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_prefetch_wait_seconds",
                        "Time a TakePrefetch waited for its prefetch to be done",
                    )
                    .buckets(vec![
                        1e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                        30.0,
                    ]),
                )?,
            ),
            prefetch_bandwidth: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_prefetch_bandwidth_gigabytes_per_second",
                        "Bandwidth of each prefetch that landed pages (landed bytes over its \
                         duration), in GB/s",
                    )
                    .buckets(GBPS_BUCKETS.to_vec()),
                )?,
            ),
            prefetch_negative_keys: reg(
                &r,
                IntGauge::new(
                    "kvtier_prefetch_negative_keys",
                    "Keys remembered as failed L3 reads (not prefetched again until they expire)",
                )?,
            ),
            prefetch_inflight: reg(
                &r,
                IntGauge::new("kvtier_prefetch_inflight", "Prefetches loading now")?,
            ),
            prefetch_budget: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "kvtier_prefetch_budget_pages",
                        "L2 slots prefetches hold (used) and may hold (limit), over every pool",
                    ),
                    &["state"],
                )?,
            ),
            sglang_transfers: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_sglang_transfers_total",
                        "SGLang HiCache RPC objects by operation and outcome",
                    ),
                    &["op", "outcome"],
                )?,
            ),
            sglang_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_sglang_bytes_total",
                        "Bytes moved by SGLang HiCache RPC puts and gets",
                    ),
                    &["op"],
                )?,
            ),
            sglang_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_sglang_batch_duration_seconds",
                        "Time to serve one SGLang HiCache RPC batch",
                    )
                    .buckets(vec![1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
                    &["op"],
                )?,
            ),
            sglang_pools: reg(
                &r,
                IntGauge::new("kvtier_sglang_pools", "SGLang host pools registered now")?,
            ),
            sglang_hits: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_sglang_hits_total",
                        "SGLang gets served and exists found, by the tier that had the object",
                    ),
                    &["op", "tier"],
                )?,
            ),
            sglang_memory_bytes: reg(
                &r,
                IntGauge::new(
                    "kvtier_sglang_memory_bytes",
                    "Bytes of SGLang objects kept in kvtierd's memory",
                )?,
            ),
            sglang_memory_objects: reg(
                &r,
                IntGauge::new(
                    "kvtier_sglang_memory_objects",
                    "SGLang objects kept in kvtierd's memory",
                )?,
            ),
            sglang_memory_evictions: reg(
                &r,
                IntCounter::new(
                    "kvtier_sglang_memory_evictions_total",
                    "SGLang objects pushed out of kvtierd's memory to make room",
                )?,
            ),
            registry: r,
        })
    }

    /// Refreshes the gauges from the state and renders the text format.
    pub fn render(&self, state: &Mutex<HostState>, l3: Option<&crate::l3::L3>) -> String {
        let families = self.gather(state, l3);
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&families, &mut buf) {
            tracing::error!("encoding metrics failed: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Refreshes the gauges from the state and returns every metric family: what both the
    /// Prometheus endpoint and `WatchMetrics` send.
    pub fn gather(
        &self,
        state: &Mutex<HostState>,
        l3: Option<&crate::l3::L3>,
    ) -> Vec<prometheus::proto::MetricFamily> {
        if let Some(l3) = l3 {
            let st = l3.store.store_stats();
            self.l3_objects.set(st.objects as i64);
            self.l3_bytes.set(st.bytes as i64);
            self.l3_evictions.set(st.evictions as i64);
            self.l3_breaker_open.set(i64::from(l3.breaker_open()));
            let (b, r) = (l3.breaker.counts(), l3.retrying.counts());
            for (counter, total) in [
                (
                    &self.l3_breaker_transitions.with_label_values(&["open"]),
                    b.opened,
                ),
                (
                    &self
                        .l3_breaker_transitions
                        .with_label_values(&["half_open"]),
                    b.probes,
                ),
                (
                    &self.l3_breaker_transitions.with_label_values(&["closed"]),
                    b.closed,
                ),
                (&self.l3_retries.with_label_values(&["retried"]), r.retries),
                (&self.l3_retries.with_label_values(&["saved"]), r.saved),
            ] {
                counter.inc_by(total.saturating_sub(counter.get()));
            }
            let window = l3
                .read_window
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .limit();
            self.l3_read_window.set(window as i64);
            self.l3_queue.set(
                l3.counters
                    .queued
                    .load(std::sync::atomic::Ordering::Relaxed) as i64,
            );
        }
        {
            let st = crate::lock(state);
            let t = st.totals();
            let (total, used) = st.pool_bytes();
            self.pool_bytes
                .with_label_values(&["total"])
                .set(total as i64);
            self.pool_bytes
                .with_label_values(&["used"])
                .set(used as i64);
            self.pool_pages
                .with_label_values(&["ready"])
                .set(i64::from(t.ready));
            self.pool_pages
                .with_label_values(&["writing"])
                .set(i64::from(t.writing));
            self.pool_pages
                .with_label_values(&["free"])
                .set(i64::from(t.capacity - t.ready - t.writing));
            self.pinned_pages.set(i64::from(t.pinned));
            self.dirty_pages.set(i64::from(t.dirty));
            self.pins.set(t.pins as i64);
            self.sessions.set(st.sessions().count() as i64);
            let (running, held, limit) = st.prefetch_totals();
            self.prefetch_inflight.set(running as i64);
            self.prefetch_budget
                .with_label_values(&["used"])
                .set(held as i64);
            self.prefetch_budget
                .with_label_values(&["limit"])
                .set(limit as i64);
            self.pools.set(st.pools().count() as i64);
            // Session-end counters live in the state (the sweeper has no metrics handle); bring
            // the exported counters up to them.
            let c = st.counters;
            for (counter, total) in [
                (&self.expired_sessions, c.expired_sessions),
                (&self.dropped_pins, c.dropped_pins),
                (&self.dropped_reservations, c.dropped_reservations),
                (&self.lost_pages.with_label_values(&["no_l3"]), c.lost_no_l3),
                (
                    &self.lost_pages.with_label_values(&["l3_down"]),
                    c.lost_l3_down,
                ),
                (&self.sealed_pages, c.sealed_pages),
                (
                    &self.takeover_pages.with_label_values(&["adopted"]),
                    c.takeover.adopted,
                ),
                (
                    &self.takeover_pages.with_label_values(&["refused_checksum"]),
                    c.takeover.refused_checksum,
                ),
                (
                    &self.takeover_pages.with_label_values(&["no_room"]),
                    c.takeover.no_room,
                ),
                (
                    &self.takeover_pools.with_label_values(&["taken_over"]),
                    c.takeover.pools,
                ),
                (
                    &self.takeover_pools.with_label_values(&["removed"]),
                    c.takeover.pools_removed,
                ),
            ] {
                counter.inc_by(total.saturating_sub(counter.get()));
            }
        }
        self.registry.gather()
    }
}

/// The wire form of gathered metric families: one sample per series, with the same names,
/// labels and values the text endpoint shows.
pub fn samples(
    families: &[prometheus::proto::MetricFamily],
) -> Vec<kvtier_proto::v1::MetricSample> {
    use kvtier_proto::v1::{HistogramBucket, MetricKind, MetricLabel, MetricSample};
    use prometheus::proto::MetricType;
    let mut out = Vec::new();
    for f in families {
        for m in f.get_metric() {
            let labels = m
                .get_label()
                .iter()
                .map(|l| MetricLabel {
                    name: l.name().to_string(),
                    value: l.value().to_string(),
                })
                .collect();
            let mut s = MetricSample {
                name: f.name().to_string(),
                labels,
                ..MetricSample::default()
            };
            match f.get_field_type() {
                MetricType::COUNTER => {
                    s.kind = MetricKind::Counter as i32;
                    s.value = m.get_counter().get_value();
                }
                MetricType::GAUGE => {
                    s.kind = MetricKind::Gauge as i32;
                    s.value = m.get_gauge().get_value();
                }
                MetricType::HISTOGRAM => {
                    let h = m.get_histogram();
                    s.kind = MetricKind::Histogram as i32;
                    s.count = h.get_sample_count();
                    s.sum = h.get_sample_sum();
                    s.buckets = h
                        .get_bucket()
                        .iter()
                        .map(|b| HistogramBucket {
                            upper_bound: b.upper_bound(),
                            cumulative_count: b.cumulative_count(),
                        })
                        .collect();
                    s.buckets.push(HistogramBucket {
                        upper_bound: f64::INFINITY,
                        cumulative_count: h.get_sample_count(),
                    });
                }
                _ => continue,
            }
            out.push(s);
        }
    }
    out
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl kvtier_storage::wrappers::StoreObserver for Metrics {
    fn observe(
        &self,
        backend: &'static str,
        op: &'static str,
        outcome: &'static str,
        bytes: u64,
        seconds: f64,
    ) {
        self.l3_ops.with_label_values(&[backend, op, outcome]).inc();
        if bytes > 0 {
            self.l3_op_bytes
                .with_label_values(&[backend, op])
                .inc_by(bytes);
        }
        self.l3_op_seconds
            .with_label_values(&[backend, op])
            .observe(seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_metric_is_registered_and_documented() {
        let m = Metrics::new().unwrap();
        // Touch the labelled families so they appear in the output.
        m.requests.with_label_values(&["x", "ok"]).inc();
        m.request_seconds.with_label_values(&["x"]).observe(0.0);
        m.pages.with_label_values(&["x"]).inc();
        m.l3_writes.with_label_values(&["x"]).inc();
        m.l3_ops.with_label_values(&["x", "y", "z"]).inc();
        m.l3_op_bytes.with_label_values(&["x", "y"]).inc();
        m.l3_op_seconds.with_label_values(&["x", "y"]).observe(0.0);
        m.lookup_pages.with_label_values(&["x"]).inc();
        m.prefetch_requests.with_label_values(&["x", "y"]).inc();
        m.prefetch_pages.with_label_values(&["x"]).inc();
        m.prefetch_bytes.with_label_values(&["x"]).inc();
        m.sglang_transfers.with_label_values(&["x", "y"]).inc();
        m.sglang_bytes.with_label_values(&["x"]).inc();
        m.sglang_seconds.with_label_values(&["x"]).observe(0.0);
        let cfg = kvtier_config::daemon::DaemonConfig::default();
        let state = Mutex::new(HostState::new(&cfg));
        let store: Arc<dyn kvtier_storage::Store> =
            Arc::new(kvtier_storage::memory::MemoryStore::new());
        let (l3, _writer) = crate::l3::L3::new(store, &cfg, Arc::new(m.clone()));
        let text = m.render(&state, Some(&l3));
        let doc = include_str!("../../../docs/metrics.md");
        for name in METRIC_NAMES {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} not exported"
            );
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{name}` |")))
                .unwrap_or_else(|| panic!("{name} not listed in docs/metrics.md"));
            let documented = row.split('|').nth(2).unwrap_or_default().trim();
            assert!(
                text.contains(&format!("# TYPE {name} {documented}\n")),
                "docs/metrics.md gives {name} the type {documented:?}"
            );
        }
        let exported = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(
            exported,
            METRIC_NAMES.len(),
            "METRIC_NAMES is missing a metric"
        );
    }
}
