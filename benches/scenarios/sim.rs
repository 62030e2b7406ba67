//! End to end: a fixed slice of the Mooncake synthetic trace through kvtier-sim (kvtierd and
//! two agents as child processes of the running binary, file L3, every page verified), with
//! the two workers serving concurrently as fast as they can (`--time-scale 0`: the stress
//! case, where backpressure from L3 sets the pace). Reports the sustained requests/s,
//! verified pages/s, the share of the ideal reuse served and the pages lost; there is no
//! baseline to divide the rates by. Then the same replay under `l3.admission = "tinylfu"`:
//! the reuse it keeps and the bytes it writes to L3, against writing every page.

use kvtier_core::{DType, KvKind, LayoutSpec};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::{Options, Target, workload};

/// Runs the scenario. Needs the binary it runs in to serve child roles
/// (`kvtier_sim::cluster::serve_child_from_env` first thing in `main`), as `kvtier-bench` does.
pub fn run(quick: bool) {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let shared = root.join("../shared/traces/mooncake_synthetic_trace.jsonl");
    let trace = if shared.exists() {
        shared
    } else {
        root.join("tests/data/mooncake_synthetic_first1000.jsonl")
    };
    let limit = if quick { 200 } else { 1000 };
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
        device: Default::default(),
        prefetch: Some(PrefetchPolicy::WaitComplete),
        sequential: false,
        time_scale: 0.0,
        prefill_tokens_per_second: 10_000.0,
        chaos: Vec::new(),
        progress: false,
    };
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
    let replay = |admission: &str| {
        let target = Target::Embedded(ClusterSpec {
            workers: 2,
            daemon_sets: vec![
                "l2.pool_pages=8192".into(),
                "l3.backend=file".into(),
                format!("l3.admission={admission}"),
                "prefetch.recompute_tokens_per_second=0".into(),
                "prefetch.threshold_tokens=0".into(),
                "prefetch.budget_fraction=1.0".into(),
            ],
            agent_sets: Vec::new(),
        });
        rt.block_on(kvtier_sim::run(
            requests.clone(),
            opts.clone(),
            target,
            launcher.clone(),
        ))
    };
    let all = match replay("all") {
        Ok(r) => r,
        Err(e) => {
            crate::say!("sim: failed: {e:#}");
            return;
        }
    };
    crate::say!("{}", all.table());
    let secs = all.wall_seconds.max(1e-9);
    crate::record(
        &format!("replay {} requests, concurrent: requests/s", all.requests),
        all.requests_per_second,
        "req/s",
        "-",
        0.0,
        None,
    );
    crate::record(
        &format!("replay {} requests: verified pages/s", all.requests),
        all.pages_verified as f64 / secs,
        "pages/s",
        "-",
        0.0,
        None,
    );
    crate::record(
        &format!(
            "replay: hits / ideal ({} corrupt, {} lost, {} unreachable pages)",
            all.pages_corrupt, all.pages_lost_total, all.pages_unreachable
        ),
        all.served_fraction,
        "fraction",
        "ideal",
        1.0,
        None,
    );
    crate::record(
        &format!("replay: backup waits ({} calls)", all.backup_waits.count),
        all.backup_waits.seconds / secs,
        "s/s",
        "-",
        0.0,
        None,
    );
    // Issue 65: the admission filter against writing every page, on the same trace.
    let lfu = match replay("tinylfu") {
        Ok(r) => r,
        Err(e) => {
            crate::say!("sim: the tinylfu replay failed: {e:#}");
            return;
        }
    };
    let kept = lfu.served_fraction / all.served_fraction.max(1e-9);
    crate::record(
        &format!(
            "replay, l3.admission tinylfu against all: reuse kept ({} corrupt pages)",
            lfu.pages_corrupt
        ),
        lfu.served_fraction,
        "fraction",
        "all",
        all.served_fraction,
        Some(kept),
    );
    let written = lfu.bytes.l3_write as f64 / (all.bytes.l3_write as f64).max(1.0);
    crate::record(
        "replay, l3.admission tinylfu against all: bytes written to L3",
        written,
        "of all",
        "all (bytes)",
        all.bytes.l3_write as f64,
        None,
    );
}
