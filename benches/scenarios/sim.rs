//! End to end: a fixed slice of the Mooncake synthetic trace through kvtier-sim (kvtierd and
//! two agents as child processes of the running binary, file L3, every page verified).
//! Reports requests/s and verified pages/s; there is no baseline to divide by.

use kvtier_core::{DType, KvKind, LayoutSpec};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::{Options, Target, workload};

/// Runs the scenario. Needs the binary it runs in to serve child roles
/// (`kvtier_sim::cluster::serve_child_from_env` first thing in `main`), as `kvtier-bench` does.
pub fn run(quick: bool) {
    let trace = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/mooncake_synthetic_trace.jsonl");
    let limit = if quick { 100 } else { 500 };
    let requests = match workload::mooncake(&trace, limit, 64) {
        Ok(r) => r,
        Err(e) => {
            crate::say!("sim: skipped ({e:#})");
            return;
        }
    };
    let opts = Options {
        layout: LayoutSpec {
            model_id: "bench-sim".into(),
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
        device_pages: 4096,
        prefetch: Some(PrefetchPolicy::WaitComplete),
        sequential: true,
        time_scale: 0.0,
        prefill_tokens_per_second: 10_000.0,
        chaos: Vec::new(),
        progress: false,
    };
    let target = Target::Embedded(ClusterSpec {
        workers: 2,
        daemon_sets: vec![
            "l2.pool_pages=4096".into(),
            "l3.backend=file".into(),
            "prefetch.recompute_tokens_per_second=0".into(),
            "prefetch.threshold_tokens=0".into(),
            "prefetch.budget_fraction=1.0".into(),
        ],
        agent_sets: Vec::new(),
    });
    let Ok(launcher) = Launcher::this_binary() else {
        crate::say!("sim: skipped (cannot locate this binary)");
        return;
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            crate::say!("sim: skipped ({e})");
            return;
        }
    };
    match rt.block_on(kvtier_sim::run(requests, opts, target, launcher)) {
        Ok(r) => {
            crate::say!("{}", r.table());
            let secs = r.wall_seconds.max(1e-9);
            crate::record(
                &format!("replay {} requests: requests/s", r.requests),
                r.requests as f64 / secs,
                "req/s",
                "-",
                0.0,
                None,
            );
            crate::record(
                &format!("replay {} requests: verified pages/s", r.requests),
                r.pages_verified as f64 / secs,
                "pages/s",
                "-",
                0.0,
                None,
            );
            crate::record(
                &format!("replay: hits / ideal ({} corrupt pages)", r.pages_corrupt),
                r.hits() as f64 / (r.ideal_reusable_tokens.max(1)) as f64,
                "fraction",
                "ideal",
                1.0,
                None,
            );
        }
        Err(e) => crate::say!("sim: failed: {e:#}"),
    }
}
