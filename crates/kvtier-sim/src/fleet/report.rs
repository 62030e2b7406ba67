//! What a fleet replay measured ([`FleetReport`]), and its table.

use crate::engine::Outcome;

/// What a fleet replay measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct FleetReport {
    /// The routing policy.
    pub policy: String,
    /// Nodes, and workers on each.
    pub nodes: usize,
    /// See `nodes`.
    pub workers_per_node: usize,
    /// Requests served, and failed.
    pub requests: u64,
    /// See `requests`.
    pub failed_requests: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Prompt tokens an unbounded cache shared by the whole fleet would serve.
    pub ideal_reusable_tokens: u64,
    /// Prompt tokens served by the workers' devices, their nodes' L2, and the shared L3.
    pub hit_tokens_device: u64,
    /// See `hit_tokens_device`.
    pub hit_tokens_host: u64,
    /// See `hit_tokens_device`.
    pub hit_tokens_storage: u64,
    /// All hits against the ideal.
    pub served_fraction: f64,
    /// Modeled time to first token, trace seconds: arrival to the end of prefill.
    pub ttft_p50_s: f64,
    /// See `ttft_p50_s`.
    pub ttft_p99_s: f64,
    /// Requests per trace second.
    pub requests_per_second: f64,
    /// Prompt tokens each node computed.
    pub computed_tokens_per_node: Vec<u64>,
    /// Requests each node served.
    pub requests_per_node: Vec<u64>,
    /// The busiest node's computed tokens against the mean.
    pub busiest_over_mean: f64,
    /// Age of the events when the router applied them, ms (the `kvtier` policy).
    pub event_lag_p50_ms: f64,
    /// See `event_lag_p50_ms`.
    pub event_lag_p99_ms: f64,
    /// Pages checked against the deterministic KV, and those that differed.
    pub pages_verified: u64,
    /// See `pages_verified`.
    pub pages_corrupt: u64,
    /// Chaos done: kvtierds killed and restarted, nodes removed and added back.
    pub node_kills: u64,
    /// See `node_kills`.
    pub node_hangs: u64,
    /// See `node_kills`.
    pub nodes_removed: u64,
    /// See `node_kills`.
    pub nodes_added: u64,
    /// Times the router forgot a node's pages because its event stream ended.
    pub view_resyncs: u64,
    /// Prompts whose leading L2 run the router's view and the node's `Locate` were compared
    /// on, per node, at the end of the run; and those where they differed.
    pub view_checked: u64,
    /// See `view_checked`.
    pub view_disagreements: u64,
    /// Nodes in the fleet that did not answer the end-of-run check (left out of it).
    pub view_unreachable: u64,
    /// Times each node stopped answering its health check, other than when stopped on
    /// leaving the fleet (the router sent it nothing until it answered again).
    pub stalls: Vec<u64>,
}

impl FleetReport {
    /// Hits of every tier, tokens.
    pub fn hits(&self) -> u64 {
        self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_storage
    }
}

pub(super) fn add(rep: &mut FleetReport, node: usize, o: &Outcome) {
    rep.requests += 1;
    rep.input_tokens += o.input_tokens;
    rep.hit_tokens_device += o.device;
    rep.hit_tokens_host += o.host;
    rep.hit_tokens_storage += o.storage;
    rep.computed_tokens_per_node[node] += o.computed;
    rep.requests_per_node[node] += 1;
    rep.pages_verified += o.verified;
    rep.pages_corrupt += o.corrupt.len() as u64;
    for c in &o.corrupt {
        tracing::error!(node, "corrupt page: {c:?}");
    }
}

/// The `q` quantile of `v` (sorted here); 0 when empty.
pub(super) fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// The reports side by side, a row per policy.
pub fn table(reports: &[FleetReport]) -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<12} {:>8} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>9} {:>8}",
        "policy",
        "reuse",
        "device",
        "L2",
        "L3",
        "ttft p50",
        "ttft p99",
        "req/s",
        "busiest",
        "lag p99",
        "corrupt"
    );
    for r in reports {
        let ideal = r.ideal_reusable_tokens.max(1) as f64;
        let _ = writeln!(
            out,
            "{:<12} {:>8.3} {:>8.3} {:>8.3} {:>8.3} {:>8.2}s {:>8.2}s {:>8.2} {:>7.2}x {:>7.1}ms {:>8}",
            r.policy,
            r.served_fraction,
            r.hit_tokens_device as f64 / ideal,
            r.hit_tokens_host as f64 / ideal,
            r.hit_tokens_storage as f64 / ideal,
            r.ttft_p50_s,
            r.ttft_p99_s,
            r.requests_per_second,
            r.busiest_over_mean,
            r.event_lag_p99_ms,
            r.pages_corrupt,
        );
    }
    let _ = writeln!(
        out,
        "reuse: hit tokens / what an unbounded cache shared by the fleet serves; ttft: arrival to \
         the end of prefill, trace seconds; busiest: the busiest node's prefill against the mean"
    );
    out
}
