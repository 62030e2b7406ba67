//! The agent's metrics and its Prometheus text endpoint. Names follow kvtierd's scheme
//! (`kvtier_agent_<noun>_<unit>`, bounded labels); docs/metrics.md lists every one.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

/// Every metric of the agent.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `kvtier_agent_matches_total`.
    pub matches: IntCounter,
    /// `kvtier_agent_match_pages_total{tier}`: device, l2, l3, miss.
    pub match_pages: IntCounterVec,
    /// `kvtier_agent_match_duration_seconds`.
    pub match_seconds: Histogram,
    /// `kvtier_agent_load_back_pages_total`.
    pub load_back_pages: IntCounter,
    /// `kvtier_agent_load_back_bytes_total`.
    pub load_back_bytes: IntCounter,
    /// `kvtier_agent_load_back_duration_seconds`.
    pub load_back_seconds: Histogram,
    /// `kvtier_agent_backup_pages_total{policy, outcome}`: stored, present, failed,
    /// deferred.
    pub backup_pages: IntCounterVec,
    /// `kvtier_agent_lost_pages_total{reason}`: pages evicted without a copy in L2.
    pub lost_pages: IntCounterVec,
    /// `kvtier_agent_backup_waits_total{at}`: Inserts and Evicts that waited for backups.
    pub backup_waits: IntCounterVec,
    /// `kvtier_agent_backup_wait_seconds{at}`: how long they waited.
    pub backup_wait_seconds: HistogramVec,
    /// `kvtier_agent_backup_bytes_total{policy}`.
    pub backup_bytes: IntCounterVec,
    /// `kvtier_agent_backup_duration_seconds{policy}`.
    pub backup_seconds: HistogramVec,
    /// `kvtier_agent_evicted_pages_total`.
    pub evicted_pages: IntCounter,
    /// `kvtier_agent_inserted_pages_total`.
    pub inserted_pages: IntCounter,
    /// `kvtier_agent_daemon_sessions_total`: sessions established with kvtierd.
    pub daemon_sessions: IntCounter,
    /// `kvtier_agent_rechecked_pages_total`: device pages whose backup mark a new session
    /// cleared, to be backed up (or found in L2) again before eviction.
    pub rechecked_pages: IntCounter,
    /// `kvtier_agent_device_pages`.
    pub device_pages: IntGauge,
    /// `kvtier_agent_locked_pages`.
    pub locked_pages: IntGauge,
    /// `kvtier_agent_open_handles`.
    pub open_handles: IntGauge,
    /// `kvtier_agent_daemon_connected`.
    pub daemon_connected: IntGauge,
}

/// Every metric name, for docs/metrics.md and the test that keeps both in step.
pub const METRIC_NAMES: &[&str] = &[
    "kvtier_agent_matches_total",
    "kvtier_agent_match_pages_total",
    "kvtier_agent_match_duration_seconds",
    "kvtier_agent_load_back_pages_total",
    "kvtier_agent_load_back_bytes_total",
    "kvtier_agent_load_back_duration_seconds",
    "kvtier_agent_backup_pages_total",
    "kvtier_agent_backup_bytes_total",
    "kvtier_agent_backup_duration_seconds",
    "kvtier_agent_lost_pages_total",
    "kvtier_agent_backup_waits_total",
    "kvtier_agent_backup_wait_seconds",
    "kvtier_agent_evicted_pages_total",
    "kvtier_agent_inserted_pages_total",
    "kvtier_agent_daemon_sessions_total",
    "kvtier_agent_rechecked_pages_total",
    "kvtier_agent_device_pages",
    "kvtier_agent_locked_pages",
    "kvtier_agent_open_handles",
    "kvtier_agent_daemon_connected",
];

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    if let Err(e) = r.register(Box::new(m.clone())) {
        unreachable!("duplicate metric: {e}");
    }
    m
}

const SECONDS: [f64; 12] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1.0,
];

impl Metrics {
    /// Creates and registers every metric; known label values start at zero.
    pub fn new() -> Result<Self, prometheus::Error> {
        let r = Registry::new();
        let hist = |name: &str, help: &str| {
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(SECONDS.to_vec()))
        };
        let m = Self {
            matches: reg(
                &r,
                IntCounter::new("kvtier_agent_matches_total", "Match calls")?,
            ),
            match_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_agent_match_pages_total",
                        "Matched request pages by where they were: device, l2, l3, miss",
                    ),
                    &["tier"],
                )?,
            ),
            match_seconds: reg(
                &r,
                hist(
                    "kvtier_agent_match_duration_seconds",
                    "Time to serve a Match, kvtierd lookup included",
                )?,
            ),
            load_back_pages: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_load_back_pages_total",
                    "Pages copied from L2 into the engine's pool",
                )?,
            ),
            load_back_bytes: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_load_back_bytes_total",
                    "Bytes copied from L2 into the engine's pool",
                )?,
            ),
            load_back_seconds: reg(
                &r,
                hist(
                    "kvtier_agent_load_back_duration_seconds",
                    "Time to serve a LoadBack (pin, copy, release, insert)",
                )?,
            ),
            backup_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_agent_backup_pages_total",
                        "Device pages sent to L2 by policy and outcome: stored, present \
                         (already in L2), failed (retried before eviction), deferred (the \
                         early-backup queue was full; backed up before eviction)",
                    ),
                    &["policy", "outcome"],
                )?,
            ),
            lost_pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_agent_lost_pages_total",
                        "Device pages evicted without a copy in L2, by reason: \
                         daemon_unreachable, l2_full, copy_failed, refused",
                    ),
                    &["reason"],
                )?,
            ),
            backup_waits: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_agent_backup_waits_total",
                        "Calls that waited for backups to L2 (backpressure), by where: insert \
                         (room in the early-backup queue), evict (victims backed up first)",
                    ),
                    &["at"],
                )?,
            ),
            backup_wait_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_agent_backup_wait_seconds",
                        "Time a call waited for backups to L2, by where: insert, evict",
                    )
                    .buckets(SECONDS.to_vec()),
                    &["at"],
                )?,
            ),
            backup_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_agent_backup_bytes_total",
                        "Bytes copied from the engine's pool into L2, by policy",
                    ),
                    &["policy"],
                )?,
            ),
            backup_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_agent_backup_duration_seconds",
                        "Time of one backup (reserve, copy, commit), by policy",
                    )
                    .buckets(SECONDS.to_vec()),
                    &["policy"],
                )?,
            ),
            evicted_pages: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_evicted_pages_total",
                    "Device pages given back to the engine by Evict",
                )?,
            ),
            inserted_pages: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_inserted_pages_total",
                    "Device pages added to the tree by Insert and LoadBack",
                )?,
            ),
            daemon_sessions: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_daemon_sessions_total",
                    "Sessions established with kvtierd (more than one: it restarted, or a \
                     session expired)",
                )?,
            ),
            rechecked_pages: reg(
                &r,
                IntCounter::new(
                    "kvtier_agent_rechecked_pages_total",
                    "Device pages believed in L2 whose mark a new kvtierd session cleared, to \
                     be backed up or found there again before eviction",
                )?,
            ),
            device_pages: reg(
                &r,
                IntGauge::new("kvtier_agent_device_pages", "Device pages in the tree")?,
            ),
            locked_pages: reg(
                &r,
                IntGauge::new(
                    "kvtier_agent_locked_pages",
                    "Device pages locked by open handles or backups in flight",
                )?,
            ),
            open_handles: reg(
                &r,
                IntGauge::new("kvtier_agent_open_handles", "Handles not yet released")?,
            ),
            daemon_connected: reg(
                &r,
                IntGauge::new(
                    "kvtier_agent_daemon_connected",
                    "1 while the agent has a session with kvtierd",
                )?,
            ),
            registry: r,
        };
        for tier in ["device", "l2", "l3", "miss"] {
            m.match_pages.with_label_values(&[tier]);
        }
        for reason in crate::backup::Loss::ALL {
            m.lost_pages.with_label_values(&[reason.label()]);
        }
        for at in ["insert", "evict"] {
            m.backup_waits.with_label_values(&[at]);
            m.backup_wait_seconds.with_label_values(&[at]);
        }
        Ok(m)
    }

    /// Renders the text format.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("encoding metrics failed: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_registered_and_documented() {
        let m = Metrics::new().unwrap();
        m.backup_pages.with_label_values(&["x", "y"]).inc();
        m.backup_bytes.with_label_values(&["x"]).inc();
        m.backup_seconds.with_label_values(&["x"]).observe(0.0);
        let text = m.render();
        let doc = include_str!("../../../docs/metrics.md");
        for name in METRIC_NAMES {
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{name}` |")))
                .unwrap_or_else(|| panic!("{name} not listed in docs/metrics.md"));
            let documented = row.split('|').nth(2).unwrap_or_default().trim();
            assert!(
                text.contains(&format!("# TYPE {name} {documented}\n")),
                "{name}: not exported, or documented as {documented:?}"
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
