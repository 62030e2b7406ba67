//! The prefetcher's metrics: outcomes, pages and bytes by stage, timings and bandwidth, and
//! gauges of running prefetches and their L2 budget, refreshed from the state at scrape
//! time.

use std::sync::Arc;

use kvtier_server::metrics::{GBPS_BUCKETS, MetricRegistry, Result};
use prometheus::{Histogram, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use crate::state::Shared;

/// Series of the prefetcher.
#[derive(Clone, Debug)]
pub struct PrefetchMetrics {
    /// Prefetches by outcome and reason.
    pub requests: IntCounterVec,
    /// Pages by stage: requested, in_l2, hit, landed.
    pub pages: IntCounterVec,
    /// Bytes by stage: requested, hit, landed.
    pub bytes: IntCounterVec,
    /// Start to done.
    pub seconds: Histogram,
    /// Page reads tried again after a transient failure.
    pub rereads: IntCounter,
    /// How long a take waited.
    pub wait_seconds: Histogram,
    /// Per prefetch that landed pages.
    pub bandwidth: Histogram,
    /// Keys remembered as failed.
    pub negative_keys: IntGauge,
    inflight: IntGauge,
    budget: IntGaugeVec,
}

impl PrefetchMetrics {
    /// Declares the series in `r`, with known label values at zero, and refreshes the
    /// running and budget gauges from `state` at each scrape.
    pub fn new(r: &MetricRegistry, state: Arc<Shared>) -> Result<Self> {
        let m = Self {
            requests: r.counter_vec(
                "kvtier_prefetch_requests_total",
                "Prefetches by outcome (completed, partial, timed_out, revoked, failed) and \
                 reason",
                &["outcome", "reason"],
            )?,
            pages: r.counter_vec(
                "kvtier_prefetch_pages_total",
                "Prefetch pages by stage: requested, in_l2 (skipped), hit (fetched from L3), \
                 landed",
                &["stage"],
            )?,
            bytes: r.counter_vec(
                "kvtier_prefetch_bytes_total",
                "Prefetch page bytes by stage: requested, hit, landed",
                &["stage"],
            )?,
            rereads: r.counter(
                "kvtier_prefetch_rereads_total",
                "Prefetch page reads tried again after a transient failure the store's own \
                 retries did not save",
            )?,
            seconds: r.histogram(
                "kvtier_prefetch_duration_seconds",
                "Time from a prefetch's start until it is done (landed, timed out, failed or \
                 taken)",
                &[
                    1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ],
            )?,
            wait_seconds: r.histogram(
                "kvtier_prefetch_wait_seconds",
                "Time a TakePrefetch waited for its prefetch to be done",
                &[
                    1e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                ],
            )?,
            bandwidth: r.histogram(
                "kvtier_prefetch_bandwidth_gigabytes_per_second",
                "Bandwidth of each prefetch that landed pages (landed bytes over its duration), \
                 in GB/s",
                GBPS_BUCKETS,
            )?,
            negative_keys: r.gauge(
                "kvtier_prefetch_negative_keys",
                "Keys remembered as failed L3 reads (not prefetched again until they expire)",
            )?,
            inflight: r.gauge("kvtier_prefetch_inflight", "Prefetches loading now")?,
            budget: r.gauge_vec(
                "kvtier_prefetch_budget_pages",
                "L2 slots prefetches hold (used) and may hold (limit), over every pool",
                &["state"],
            )?,
        };
        for stage in ["requested", "in_l2", "hit", "landed"] {
            m.pages.with_label_values(&[stage]);
        }
        for stage in ["requested", "hit", "landed"] {
            m.bytes.with_label_values(&[stage]);
        }
        for outcome in ["completed", "partial", "timed_out"] {
            m.requests.with_label_values(&[outcome, ""]);
        }
        let me = m.clone();
        r.on_scrape(move || {
            let (running, held, limit) = state.lock().prefetch_totals();
            me.inflight.set(running as i64);
            me.budget.with_label_values(&["used"]).set(held as i64);
            me.budget.with_label_values(&["limit"]).set(limit as i64);
        });
        Ok(m)
    }
}
