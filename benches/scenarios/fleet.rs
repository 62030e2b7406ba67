//! A fleet (issue 64): 4 nodes of one worker each over one shared file L3, the trace slice
//! replayed at trace time × 0.1 (`kvtier-sim fleet`), once routed round-robin and once by
//! kvtier's events. Tiers are small against the slice (2,600 device pages, 3,000 L2 pages a
//! node, as `tests/sim.rs`'s small runs), so where a request lands decides what it finds.
//! The baseline is round-robin in the same run: reuse and the modeled time to first token
//! p99 against it, the reuse against the unbounded ideal, and the busiest node's prefill
//! against the mean.

use kvtier_core::{DType, KvKind, LayoutSpec};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::fleet::{FleetOptions, FleetReport, run_fleet};
use kvtier_sim::router::Policy;
use kvtier_sim::{Options, workload};

/// Nodes, and workers per node.
const NODES: usize = 4;
const WORKERS: usize = 1;

/// Runs the scenario (`quick`: fewer requests). Needs the binary it runs in to serve child
/// roles, as `kvtier-bench` does.
pub fn run(quick: bool) {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let trace = root.join("tests/data/mooncake_synthetic_first1000.jsonl");
    let limit = if quick { 80 } else { 200 };
    let requests = match workload::mooncake(&trace, limit, 64) {
        Ok(r) => r,
        Err(e) => {
            crate::say!("fleet: skipped ({e:#})");
            return;
        }
    };
    let (Ok(launcher), Ok(rt)) = (
        Launcher::this_binary(),
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
    ) else {
        crate::say!("fleet: skipped (no launcher or runtime)");
        return;
    };
    let base = Options {
        layout: LayoutSpec {
            model_id: "bench-fleet".into(),
            model_version: String::new(),
            dtype: DType::Bf16,
            num_layers: 2,
            kind: KvKind::Mha {
                kv_heads: 1,
                head_dim: 32,
            },
            page_size: 64,
            tp_rank: 0,
            tp_size: 1,
        },
        device_pages: 2600,
        device: Default::default(),
        prefetch: Some(PrefetchPolicy::WaitComplete),
        sequential: false,
        time_scale: 0.1,
        prefill_tokens_per_second: 10_000.0,
        chaos: Vec::new(),
        progress: false,
    };
    let fleet = |policy: Policy| -> Option<FleetReport> {
        let opts = FleetOptions {
            base: base.clone(),
            nodes: NODES,
            node: ClusterSpec {
                workers: WORKERS,
                daemon_sets: vec![
                    "l2.pool_pages=3000".into(),
                    "prefetch.recompute_tokens_per_second=0".into(),
                    "prefetch.threshold_tokens=0".into(),
                    "prefetch.budget_fraction=1.0".into(),
                ],
                agent_sets: Vec::new(),
            },
            policy,
            seed: 1,
        };
        match rt.block_on(run_fleet(requests.clone(), opts, launcher.clone())) {
            Ok(r) => Some(r),
            Err(e) => {
                crate::say!("fleet: {} failed: {e:#}", policy.name());
                None
            }
        }
    };
    let (Some(rr), Some(kv)) = (fleet(Policy::RoundRobin), fleet(Policy::Kvtier)) else {
        return;
    };
    crate::say!("{}", kvtier_sim::fleet::table(&[rr.clone(), kv.clone()]));
    let name = format!("fleet of {NODES} nodes, {} requests", kv.requests);
    crate::record(
        &format!("{name}: reuse, kvtier router against round-robin"),
        kv.served_fraction,
        "of ideal",
        "round-robin, same run",
        rr.served_fraction,
        Some(kv.served_fraction / rr.served_fraction.max(1e-9)),
    );
    crate::record(
        &format!("{name}: reuse against the unbounded ideal, kvtier router"),
        kv.served_fraction,
        "of ideal",
        "the ideal",
        1.0,
        Some(kv.served_fraction),
    );
    crate::record(
        &format!("{name}: TTFT p99, round-robin over the kvtier router"),
        kv.ttft_p99_s,
        "s",
        "round-robin, same run",
        rr.ttft_p99_s,
        Some(rr.ttft_p99_s / kv.ttft_p99_s.max(1e-9)),
    );
    crate::record(
        &format!("{name}: busiest node's prefill over the mean, kvtier router"),
        kv.busiest_over_mean,
        "x",
        "",
        0.0,
        None,
    );
    crate::record(
        &format!("{name}: event lag p99 at the router"),
        kv.event_lag_p99_ms,
        "ms",
        "",
        0.0,
        None,
    );
    let corrupt = rr.pages_corrupt + kv.pages_corrupt;
    crate::record(
        &format!("{name}: corrupt pages"),
        corrupt as f64,
        "pages",
        "",
        0.0,
        None,
    );
}
