//! What a simulation reports: tokens served per tier, bytes moved, waits, prefetches, the
//! time-to-first-token estimate and the correctness counts, as a [`Report`] that prints as
//! text or serializes as JSON.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::engine::Corrupt;

/// Token counts served by each tier.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HitTokens {
    /// From the worker's own device (L1).
    pub device: u64,
    /// From the node's host pool (L2).
    pub host: u64,
    /// From the storage tier (L3), through prefetch.
    pub storage: u64,
}

/// Bytes moved between tiers.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Bytes {
    /// L2 → device.
    pub load_back: u64,
    /// Device → L2.
    pub backup: u64,
    /// L3 → L2 (backend reads).
    pub l3_read: u64,
    /// L2 → L3 (backend writes).
    pub l3_write: u64,
}

/// Waits for backups.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Waits {
    /// How many.
    pub count: u64,
    /// Their total time.
    pub seconds: f64,
}

/// How long requests waited for storage (prefetch and load back of what it fetched).
#[derive(Clone, Debug, Default, Serialize)]
pub struct StorageWaits {
    /// Requests that asked for a prefetch.
    pub requests: u64,
    /// Their total wait.
    pub seconds: f64,
    /// The longest one.
    pub max_seconds: f64,
    /// Requests that waited longer than their prefetch's deadline (plus 0.5 s for the load
    /// back): the policy's bound broken.
    pub over_deadline: u64,
}

/// Prefetch counts.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Prefetches {
    /// Asked for (revoked included).
    pub started: u64,
    /// Ended with every hit page landed.
    pub completed: u64,
}

/// The estimated time-to-first-token effect, from a stated cost model.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TtftEstimate {
    /// The model, in words.
    pub model: String,
    /// Prefill of every prompt token, no cache.
    pub no_cache_seconds: f64,
    /// Prefill of the computed tokens plus transfer of the loaded ones.
    pub with_cache_seconds: f64,
    /// 1 − with / without.
    pub saving: f64,
    /// Measured load-back throughput the model uses, GB/s.
    pub transfer_gbps: f64,
}

/// The result of a simulation (`--json` prints it).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    /// Requests served.
    pub requests: usize,
    /// Requests that failed (an agent or daemon went away mid-request); they are retried on
    /// a fresh connection once and counted here if that fails too.
    pub failed_requests: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// What an unbounded cache would have served (from the workload itself).
    pub ideal_reusable_tokens: u64,
    /// Served per tier.
    pub hit_tokens: HitTokens,
    /// Computed (prefill).
    pub computed_tokens: u64,
    /// Pages checked against recomputation.
    pub pages_verified: u64,
    /// Pages that differed.
    pub pages_corrupt: u64,
    /// The first corrupt pages (at most 20).
    pub corrupt_samples: Vec<Corrupt>,
    /// Prefetch outcomes by name.
    pub prefetch: BTreeMap<String, u64>,
    /// Bytes moved.
    pub bytes: Bytes,
    /// Pages computed (prompt and generated tokens, full pages).
    pub pages_computed: u64,
    /// Pages the agents backed up to L2 (copied there, or found there already).
    pub pages_backed_up: u64,
    /// Pages kvtierd wrote to L3.
    pub pages_written_l3: u64,
    /// Pages given up, by tier and reason: `device:<reason>` left a worker's device without
    /// a copy in L2, `l2:<reason>` left L2 without a copy in L3. Nothing computed is lost
    /// silently: every page that is gone from every tier is here.
    pub pages_lost: BTreeMap<String, u64>,
    /// The sum of `pages_lost`.
    pub pages_lost_total: u64,
    /// Evicts that had to wait for backups to L2 first (backpressure), and for how long in
    /// total.
    pub backup_waits: Waits,
    /// Prefetches asked for (revoked ones included) and how many completed.
    pub prefetches: Prefetches,
    /// Time requests spent waiting for storage.
    pub storage_waits: StorageWaits,
    /// Pages some request computed that no tier holds at the end, after every worker gave
    /// its device pages back (each backed up first, as eviction does) and the writes
    /// settled. With an unbounded L3 this is at most `pages_lost_total`: a page missing and
    /// not counted was lost silently.
    pub pages_unreachable: u64,
    /// Of the ideal, the tokens whose pages some finished request had computed when a
    /// request asked for them: the most any cache can serve under this schedule (requests in
    /// flight at the same time cannot reuse what the others are still computing). Equal to
    /// the ideal when requests run one at a time.
    pub reachable_reusable_tokens: u64,
    /// Served tokens over ideal reusable tokens.
    pub served_fraction: f64,
    /// Served tokens over reachable reusable tokens: what kvtier itself missed.
    pub served_of_reachable: f64,
    /// Requests served per second of wall time (the sustained rate).
    pub requests_per_second: f64,
    /// Wall time.
    pub wall_seconds: f64,
    /// The cost-model estimate.
    pub ttft: TtftEstimate,
}

impl Report {
    /// Hit tokens of every tier.
    pub fn hits(&self) -> u64 {
        self.hit_tokens.device + self.hit_tokens.host + self.hit_tokens.storage
    }

    /// A readable table.
    pub fn table(&self) -> String {
        let pct = |n: u64, d: u64| {
            if d == 0 {
                0.0
            } else {
                100.0 * n as f64 / d as f64
            }
        };
        let h = &self.hit_tokens;
        let mut s = String::new();
        let mut line = |k: &str, v: String| s.push_str(&format!("{k:<28} {v}\n"));
        line(
            "requests",
            format!("{} ({} failed)", self.requests, self.failed_requests),
        );
        line("page size", format!("{} tokens", self.page_size));
        line("input tokens", self.input_tokens.to_string());
        line(
            "ideal reusable tokens",
            format!(
                "{} ({:.1}% of input)",
                self.ideal_reusable_tokens,
                pct(self.ideal_reusable_tokens, self.input_tokens)
            ),
        );
        line(
            "hit tokens",
            format!(
                "{} = {:.1}% of ideal: device {} / host {} / storage {}",
                self.hits(),
                pct(self.hits(), self.ideal_reusable_tokens),
                h.device,
                h.host,
                h.storage
            ),
        );
        line(
            "reachable reusable tokens",
            format!(
                "{} (computed by a finished request when asked for); served {:.1}% of it",
                self.reachable_reusable_tokens,
                pct(self.hits(), self.reachable_reusable_tokens)
            ),
        );
        line("computed tokens", self.computed_tokens.to_string());
        line(
            "pages verified / corrupt",
            format!("{} / {}", self.pages_verified, self.pages_corrupt),
        );
        let pf: Vec<String> = self
            .prefetch
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        line(
            "prefetch",
            if pf.is_empty() {
                "-".into()
            } else {
                pf.join(", ")
            },
        );
        let w = &self.storage_waits;
        line(
            "storage waits",
            format!(
                "{} requests, {:.1} s in all, longest {:.2} s, {} over their deadline",
                w.requests, w.seconds, w.max_seconds, w.over_deadline
            ),
        );
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / f64::from(1 << 20));
        line(
            "bytes",
            format!(
                "load-back {}, backup {}, L3 read {}, L3 write {}",
                mib(self.bytes.load_back),
                mib(self.bytes.backup),
                mib(self.bytes.l3_read),
                mib(self.bytes.l3_write)
            ),
        );
        line(
            "pages",
            format!(
                "computed {}, backed up to L2 {}, written to L3 {}",
                self.pages_computed, self.pages_backed_up, self.pages_written_l3
            ),
        );
        let lost: Vec<String> = self
            .pages_lost
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect();
        line(
            "pages lost",
            if lost.is_empty() {
                "0".into()
            } else {
                format!("{} ({})", self.pages_lost_total, lost.join(", "))
            },
        );
        line(
            "pages unreachable",
            format!(
                "{} (computed, in no tier after the final flush)",
                self.pages_unreachable
            ),
        );
        line(
            "backup waits",
            format!(
                "{} calls waited {:.2} s in total",
                self.backup_waits.count, self.backup_waits.seconds
            ),
        );
        line(
            "wall time",
            format!(
                "{:.2} s ({:.1} requests/s)",
                self.wall_seconds, self.requests_per_second
            ),
        );
        line(
            "TTFT estimate",
            format!(
                "{:.1}% less prefill time ({:.2} s vs {:.2} s; {})",
                100.0 * self.ttft.saving,
                self.ttft.with_cache_seconds,
                self.ttft.no_cache_seconds,
                self.ttft.model
            ),
        );
        s
    }
}
