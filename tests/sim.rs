//! The whole system end to end, through kvtier-sim: real kvtierd and kvtier-agent processes
//! (this test binary re-executed into those roles), a replay of the Mooncake synthetic trace,
//! and every page the simulated engines receive checked against recomputation.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use kvtier_core::{DType, KvKind, LayoutSpec};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::workload::{self, Request};
use kvtier_sim::{Chaos, Options, Report, Target};

/// Not a test: the entry point of the kvtierd and agent processes the tests start.
#[test]
#[ignore = "entry point of the simulator's child servers"]
fn sim_child_entry() {
    assert!(
        kvtier_sim::cluster::serve_child_from_env(),
        "run by the tests, not by hand"
    );
}

/// The trace, in `shared/traces/` beside the checkout (where CI has it too).
fn trace() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/mooncake_synthetic_trace.jsonl");
    assert!(
        p.exists(),
        "{} is missing: the tests expect shared/traces/ beside the checkout",
        p.display()
    );
    p
}

fn requests(limit: usize) -> Vec<Request> {
    workload::mooncake(&trace(), limit, 64).unwrap()
}

/// A small layout (16 KiB pages of 64 tokens) so a thousand long requests fit the machine.
fn layout() -> LayoutSpec {
    LayoutSpec {
        model_id: "sim-test".into(),
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
    }
}

struct Run {
    workers: usize,
    device_pages: u64,
    daemon: Vec<String>,
    agent: Vec<String>,
    prefetch: Option<PrefetchPolicy>,
    chaos: Vec<Chaos>,
}

impl Default for Run {
    fn default() -> Self {
        Self {
            workers: 2,
            // Room for the longest request of the first thousand (135k tokens), not much more:
            // L1 evicts all the time.
            device_pages: 2600,
            daemon: Vec::new(),
            agent: Vec::new(),
            prefetch: Some(PrefetchPolicy::WaitComplete),
            chaos: Vec::new(),
        }
    }
}

fn simulate(reqs: Vec<Request>, run: Run) -> Report {
    let mut daemon_sets = vec![
        // L2 smaller than a few long requests: it evicts all the time too, so L3 serves.
        "l2.pool_pages=3000".to_string(),
        "l3.backend=file".to_string(),
        "prefetch.recompute_tokens_per_second=0".to_string(),
        "prefetch.threshold_tokens=0".to_string(),
        "prefetch.budget_fraction=1.0".to_string(),
    ];
    daemon_sets.extend(run.daemon);
    let launcher = Launcher {
        program: std::env::current_exe().unwrap(),
        args: [
            "sim_child_entry",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ]
        .map(String::from)
        .to_vec(),
    };
    let opts = Options {
        layout: layout(),
        device_pages: run.device_pages,
        prefetch: run.prefetch,
        sequential: true,
        time_scale: 0.0,
        prefill_tokens_per_second: 10_000.0,
        chaos: run.chaos,
        progress: false,
    };
    let target = Target::Embedded(ClusterSpec {
        workers: run.workers,
        daemon_sets,
        agent_sets: run.agent,
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let report = rt
        .block_on(kvtier_sim::run(reqs, opts, target, launcher))
        .unwrap();
    eprintln!("{}", report.table());
    report
}

#[test]
fn replay_serves_every_tier_and_never_a_wrong_page() {
    let r = simulate(requests(1000), Run::default());
    assert_eq!(r.pages_corrupt, 0, "{:?}", r.corrupt_samples);
    assert_eq!((r.requests, r.failed_requests), (1000, 0));
    let h = &r.hit_tokens;
    assert!(h.device > 0 && h.host > 0 && h.storage > 0, "{h:?}");
    assert!(
        r.hits() as f64 >= 0.95 * r.ideal_reusable_tokens as f64,
        "hits {} of ideal {}",
        r.hits(),
        r.ideal_reusable_tokens
    );
    assert!(r.pages_verified * 64 >= r.hits());
    assert!(r.bytes.l3_read > 0 && r.bytes.l3_write > 0 && r.bytes.backup > 0);
}

#[test]
fn an_unreliable_l3_costs_hits_never_correctness() {
    let r = simulate(
        requests(400),
        Run {
            daemon: vec![
                "l3.fault_error_rate=0.05".into(),
                "l3.fault_get_delay=1ms".into(),
                "l3.breaker_failures=1000".into(),
            ],
            ..Run::default()
        },
    );
    assert_eq!(r.pages_corrupt, 0, "{:?}", r.corrupt_samples);
    assert_eq!(r.requests + r.failed_requests, 400);
    assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
}

#[test]
fn killed_and_restarted_daemon_and_agent_never_corrupt() {
    let r = simulate(
        requests(400),
        Run {
            chaos: vec![Chaos::KillDaemonAt(150), Chaos::KillAgentAt(280)],
            ..Run::default()
        },
    );
    assert_eq!(r.pages_corrupt, 0, "{:?}", r.corrupt_samples);
    assert_eq!(r.requests + r.failed_requests, 400);
    assert!(r.requests >= 396, "{} of 400 served", r.requests);
    // The file L3 survives the daemon's death: later requests still hit storage.
    assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
}

#[test]
fn each_write_and_prefetch_policy_serves_correct_pages() {
    let reqs = requests(250);
    for (write, l3_write, prefetch) in [
        (
            "write_through_selective",
            "write_back",
            Some(PrefetchPolicy::BestEffort),
        ),
        (
            "write_back",
            "write_through_selective",
            Some(PrefetchPolicy::Timeout),
        ),
        ("write_through", "write_through", None),
    ] {
        let r = simulate(
            reqs.clone(),
            Run {
                agent: vec![format!("cache.write_policy={write}")],
                daemon: vec![format!("l3.write_policy={l3_write}")],
                prefetch,
                ..Run::default()
            },
        );
        assert_eq!(
            r.pages_corrupt, 0,
            "{write}/{l3_write}: {:?}",
            r.corrupt_samples
        );
        assert_eq!(r.requests, 250, "{write}/{l3_write}");
        assert!(r.hits() > 0, "{write}/{l3_write}: no hit at all");
    }
}
