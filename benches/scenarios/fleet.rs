//! A fleet (issue 64): 4 nodes of one worker each, the trace slice replayed at trace time ×
//! 0.1 (`kvtier-sim fleet`), once routed round-robin and once by kvtier's events; first over
//! one shared file L3 (in /dev/shm where there is one) behind small L2s (2,600 device pages, 3,000 L2 pages a node, as
//! `tests/sim.rs`'s small runs), then as isolated pools (no L3: a node finds only its own L2,
//! of 40,000 pages, room for a quarter of the slice), so where a request lands decides what
//! it finds. The baseline is round-robin
//! in the same run: reuse and the modeled time to first token p99 against it, the reuse
//! against the unbounded ideal, and the busiest node's prefill against the mean.
//!
//! Then one node of 8 workers, chat sessions arriving faster than they compute, with one L2
//! the workers share against 8 private L2s of an eighth of its size each: throughput and
//! time to first token.

use kvtier_core::{DType, KvKind, LayoutSpec};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::fleet::{FleetL3, FleetOptions, FleetReport, run_fleet};
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
    let pools = |pages: u64| {
        vec![
            format!("l2.pool_pages={pages}"),
            "prefetch.recompute_tokens_per_second=0".into(),
            "prefetch.threshold_tokens=0".into(),
            "prefetch.budget_fraction=1.0".into(),
        ]
    };
    let fleet = |requests: &[workload::Request], opts: FleetOptions| -> Option<FleetReport> {
        let policy = opts.policy;
        match rt.block_on(run_fleet(requests.to_vec(), opts, launcher.clone())) {
            Ok(r) => Some(r),
            Err(e) => {
                crate::say!("fleet: {} failed: {e:#}", policy.name());
                None
            }
        }
    };
    // The shared L3 on a tmpfs where there is one: on this machine's disk its stalls set the
    // pace of the whole fleet (round-robin's p50 moved 7 to 21 s run to run there).
    let l3_dir = Some(std::path::PathBuf::from("/dev/shm")).filter(|d| d.is_dir());
    let mut corrupt = 0;
    // Each has room for the slice somewhere: the shared L3 (unbounded) behind small L2s, or
    // (isolated) each node's L2 big enough for a quarter of it, so the ideal is reachable by
    // routing alone.
    for (label, l3, l2_pages) in [
        ("shared L3", FleetL3::Shared, 3000),
        ("isolated pools", FleetL3::Isolated, 40_000),
    ] {
        let opts = |policy| FleetOptions {
            base: base.clone(),
            nodes: NODES,
            node: ClusterSpec {
                workers: WORKERS,
                daemon_sets: pools(l2_pages),
                agent_sets: Vec::new(),
            },
            policy,
            seed: 1,
            l3,
            private_l2: false,
            chaos: Vec::new(),
            l3_dir: l3_dir.clone(),
        };
        let (Some(rr), Some(kv)) = (
            fleet(&requests, opts(Policy::RoundRobin)),
            fleet(&requests, opts(Policy::Kvtier)),
        ) else {
            return;
        };
        crate::say!(
            "{label}:\n{}",
            kvtier_sim::fleet::table(&[rr.clone(), kv.clone()])
        );
        record_fleet(
            &format!("fleet of {NODES} nodes, {label}, {} requests", kv.requests),
            &rr,
            &kv,
        );
        corrupt += rr.pages_corrupt + kv.pages_corrupt;
    }
    // One node of 8 workers, one L2 they share against one each of an eighth of its size
    // (PegaFlow's comparison), no L3: multi-turn chat arriving faster than the workers
    // compute, so the throughput is the prefill the pool saves. 30 sessions over 8 workers:
    // a session's turns land on different workers (no accidental affinity).
    let chat = workload::chat(&workload::ChatSpec {
        sessions: if quick { 16 } else { 30 },
        turns: 6,
        system_prompts: 4,
        system_tokens: 2048,
        user_tokens: 256,
        output_tokens: 128,
        interval_ms: 20,
    });
    let one_node = |private_l2| FleetOptions {
        base: Options {
            device_pages: 160,
            time_scale: 1.0,
            prefill_tokens_per_second: 1000.0,
            ..base.clone()
        },
        nodes: 1,
        node: ClusterSpec {
            workers: 8,
            daemon_sets: pools(2400),
            agent_sets: Vec::new(),
        },
        policy: Policy::RoundRobin,
        seed: 1,
        l3: FleetL3::Isolated,
        private_l2,
        chaos: Vec::new(),
        l3_dir: None,
    };
    let (Some(shared), Some(private)) =
        (fleet(&chat, one_node(false)), fleet(&chat, one_node(true)))
    else {
        return;
    };
    crate::say!(
        "one node of 8 workers, shared L2 then 8 private L2s:\n{}",
        kvtier_sim::fleet::table(&[shared.clone(), private.clone()])
    );
    let name = format!("one node of 8 workers, chat, {} requests", shared.requests);
    crate::record(
        &format!("{name}: throughput, one shared L2 against 8 private L2s"),
        shared.requests_per_second,
        "req/s",
        "8 private L2s of 1/8 the size, same run",
        private.requests_per_second,
        Some(shared.requests_per_second / private.requests_per_second.max(1e-9)),
    );
    crate::record(
        &format!("{name}: TTFT p50, 8 private L2s over one shared L2"),
        shared.ttft_p50_s,
        "s",
        "8 private L2s, same run",
        private.ttft_p50_s,
        Some(private.ttft_p50_s / shared.ttft_p50_s.max(1e-9)),
    );
    corrupt += shared.pages_corrupt + private.pages_corrupt;
    crate::record(
        "fleet: corrupt pages, every run",
        corrupt as f64,
        "pages",
        "",
        0.0,
        None,
    );
}

/// The rows of one fleet's comparison, named `name: …`.
fn record_fleet(name: &str, rr: &FleetReport, kv: &FleetReport) {
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
}
