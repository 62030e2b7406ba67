//! The agent's metrics. Names follow kvtierd's scheme (`kvtier_agent_<noun>_<unit>`,
//! bounded labels), are declared once, here, in the process's
//! [`MetricRegistry`](kvtier_server::metrics::MetricRegistry), and docs/metrics.md lists
//! every one (a test holds the two together).

use kvtier_server::metrics::{MetricRegistry, Result};
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

/// Every metric of the agent.
#[derive(Clone, Debug)]
pub struct Metrics {
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
    /// `kvtier_agent_load_failed_pages_total{reason}`: engine-cache Load pages not loaded.
    pub load_failed_pages: IntCounterVec,
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
    /// `kvtier_agent_copy_method{method, state}`: 1 for the method in use (`selected`) and
    /// for each method's self-check result (`passed`, `disabled`).
    pub copy_method: IntGaugeVec,
    /// `kvtier_agent_host_register_duration_seconds`: registering kvtierd's pool with the
    /// GPU driver at attach.
    pub host_register_seconds: Histogram,
}

const SECONDS: [f64; 12] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05, 0.25, 1.0,
];

impl Metrics {
    /// Counts one Match or Lookup: of `total` pages, `device` on the device, then `l2` in L2,
    /// then `l3` in L3, the rest missed; served since `started`.
    pub fn count_match(
        &self,
        total: usize,
        device: usize,
        l2: usize,
        l3: usize,
        started: std::time::Instant,
    ) {
        self.matches.inc();
        let pages =
            |tier: &str, n: usize| self.match_pages.with_label_values(&[tier]).inc_by(n as u64);
        pages("device", device);
        pages("l2", l2);
        pages("l3", l3);
        pages("miss", total.saturating_sub(device + l2 + l3));
        self.match_seconds.observe(started.elapsed().as_secs_f64());
    }

    /// Declares every series in `r`; known label values start at zero.
    pub fn new(r: &MetricRegistry) -> Result<Self> {
        let m = Self {
            matches: r.counter("kvtier_agent_matches_total", "Match calls")?,
            match_pages: r.counter_vec(
                "kvtier_agent_match_pages_total",
                "Matched request pages by where they were: device, l2, l3, miss",
                &["tier"],
            )?,
            match_seconds: r.histogram(
                "kvtier_agent_match_duration_seconds",
                "Time to serve a Match, kvtierd lookup included",
                &SECONDS,
            )?,
            load_back_pages: r.counter(
                "kvtier_agent_load_back_pages_total",
                "Pages copied from L2 into the engine's pool",
            )?,
            load_back_bytes: r.counter(
                "kvtier_agent_load_back_bytes_total",
                "Bytes copied from L2 into the engine's pool",
            )?,
            load_back_seconds: r.histogram(
                "kvtier_agent_load_back_duration_seconds",
                "Time to serve a LoadBack (pin, copy, release, insert)",
                &SECONDS,
            )?,
            backup_pages: r.counter_vec(
                "kvtier_agent_backup_pages_total",
                "Device pages sent to L2 by policy and outcome: stored, present \
                 (already in L2), failed (retried before eviction), deferred (the \
                 early-backup queue was full; backed up before eviction)",
                &["policy", "outcome"],
            )?,
            lost_pages: r.counter_vec(
                "kvtier_agent_lost_pages_total",
                "Device pages evicted without a copy in L2, by reason: \
                 daemon_unreachable, l2_full, copy_failed, refused",
                &["reason"],
            )?,
            backup_waits: r.counter_vec(
                "kvtier_agent_backup_waits_total",
                "Calls that waited for backups to L2 (backpressure), by where: insert \
                 (room in the early-backup queue), evict (victims backed up first), link (a \
                 Save waiting for the kvtierd session to come up), daemon (a background backup \
                 waiting for a kvtierd that went away to come back)",
                &["at"],
            )?,
            backup_wait_seconds: r.histogram_vec(
                "kvtier_agent_backup_wait_seconds",
                "Time a call waited for backups to L2, by where: insert, evict, link, daemon",
                &["at"],
                &SECONDS,
            )?,
            backup_bytes: r.counter_vec(
                "kvtier_agent_backup_bytes_total",
                "Bytes copied from the engine's pool into L2, by policy",
                &["policy"],
            )?,
            backup_seconds: r.histogram_vec(
                "kvtier_agent_backup_duration_seconds",
                "Time of one backup (reserve, copy, commit), by policy",
                &["policy"],
                &SECONDS,
            )?,
            load_failed_pages: r.counter_vec(
                "kvtier_agent_load_failed_pages_total",
                "Pages a Load was asked for and did not load (the engine computes them), \
                 by reason: missing, daemon_unreachable, copy_failed",
                &["reason"],
            )?,
            evicted_pages: r.counter(
                "kvtier_agent_evicted_pages_total",
                "Device pages given back to the engine by Evict",
            )?,
            inserted_pages: r.counter(
                "kvtier_agent_inserted_pages_total",
                "Device pages added to the tree by Insert and LoadBack",
            )?,
            daemon_sessions: r.counter(
                "kvtier_agent_daemon_sessions_total",
                "Sessions established with kvtierd (more than one: it restarted, or a \
                 session expired)",
            )?,
            rechecked_pages: r.counter(
                "kvtier_agent_rechecked_pages_total",
                "Device pages believed in L2 whose mark a new kvtierd session cleared, to \
                 be backed up or found there again before eviction",
            )?,
            device_pages: r.gauge("kvtier_agent_device_pages", "Device pages in the tree")?,
            locked_pages: r.gauge(
                "kvtier_agent_locked_pages",
                "Device pages locked by open handles or backups in flight",
            )?,
            open_handles: r.gauge("kvtier_agent_open_handles", "Handles not yet released")?,
            daemon_connected: r.gauge(
                "kvtier_agent_daemon_connected",
                "1 while the agent has a session with kvtierd",
            )?,
            copy_method: r.gauge_vec(
                "kvtier_agent_copy_method",
                "1 for the device's copy method in use (state selected) and for what each \
                 method's start-up self-check found (state passed or disabled; the log \
                 says why)",
                &["method", "state"],
            )?,
            host_register_seconds: r.histogram(
                "kvtier_agent_host_register_duration_seconds",
                "Time to register kvtierd's host pool with the GPU driver when the agent \
                 attaches it (page-locking, in chunks of at most 64 GiB)",
                &[0.001, 0.01, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0],
            )?,
        };
        for tier in ["device", "l2", "l3", "miss"] {
            m.match_pages.with_label_values(&[tier]);
        }
        for reason in crate::outcome::Loss::ALL {
            m.lost_pages.with_label_values(&[reason.label()]);
        }
        for reason in crate::outcome::LoadFailure::ALL {
            m.load_failed_pages.with_label_values(&[reason.label()]);
        }
        for at in ["insert", "evict", "link", "daemon"] {
            m.backup_waits.with_label_values(&[at]);
            m.backup_wait_seconds.with_label_values(&[at]);
        }
        Ok(m)
    }
}

impl Metrics {
    /// Records (and logs) which copy method the device uses and what every method's
    /// self-check found, replacing what an earlier registration recorded.
    pub fn copy_methods(&self, r: &kvtier_device::CopyReport<'_>) {
        use kvtier_core::copy_method::Check;
        self.copy_method.reset();
        self.copy_method
            .with_label_values(&[r.method, "selected"])
            .set(1);
        for (m, c) in r.checks {
            match c {
                Check::Passed { bytes_per_sec } => {
                    self.copy_method
                        .with_label_values(&[m.name(), "passed"])
                        .set(1);
                    tracing::info!(
                        method = m.name(),
                        gbps = bytes_per_sec / 1e9,
                        "copy method passed its self-check"
                    );
                }
                Check::Disabled { reason } => {
                    self.copy_method
                        .with_label_values(&[m.name(), "disabled"])
                        .set(1);
                    tracing::warn!(method = m.name(), %reason, "copy method disabled");
                }
            }
        }
        if let Some((m, why)) = r.fallback_from {
            tracing::warn!(configured = m.name(), using = r.method, %why, "device.copy_method is not usable here; using another");
        } else {
            tracing::info!(method = r.method, "device copy method");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_declared_once_and_documented() {
        let r = MetricRegistry::new();
        Metrics::new(&r).unwrap();
        crate::memory_door::Deposits::new(&r).unwrap();
        let doc = include_str!("../../../docs/metrics.md");
        let wrong = r.check_documented(doc, |n| n.starts_with("kvtier_agent_"));
        assert!(wrong.is_empty(), "{wrong:#?}");
        assert!(r.declared().len() >= 20);
    }
}
