//! The whole system end to end, through kvtier-sim: real kvtierd and kvtier-agent processes
//! (this test binary re-executed into those roles), a replay of the Mooncake synthetic trace
//! (the slice in `tests/data/`), and every page the simulated engines receive checked against
//! recomputation.
//!
//! Replays are concurrent unless a test says otherwise: workers take requests from one queue
//! in arrival order, as an engine does, at `--time-scale 0` (as fast as possible), so backups,
//! writes to L3, prefetches and evictions all race. At the end every worker gives its device
//! pages back and every computed page is looked up: a page no tier holds and no counter
//! explains would be a page lost silently.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
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

/// The first 1,000 requests of the trace, kept in the repository (see tests/data/README.md).
fn trace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("data/mooncake_synthetic_first1000.jsonl")
}

fn requests(limit: usize) -> Vec<Request> {
    workload::mooncake(&trace(), limit, 64).unwrap()
}

/// A small layout (4 KiB pages of 64 tokens) so a thousand long requests fit the machine and
/// the tests measure kvtier, not the disk.
fn layout() -> LayoutSpec {
    LayoutSpec {
        model_id: "sim-test".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 2,
        kind: KvKind::Mha {
            kv_heads: 1,
            head_dim: 8,
        },
        page_size: 64,
        tp_rank: 0,
        tp_size: 1,
    }
}

struct Run {
    workers: usize,
    device_pages: u64,
    l2_pages: u64,
    daemon: Vec<String>,
    agent: Vec<String>,
    prefetch: Option<PrefetchPolicy>,
    chaos: Vec<Chaos>,
    sequential: bool,
}

impl Default for Run {
    /// `kvtier-sim replay`'s defaults.
    fn default() -> Self {
        Self {
            workers: 2,
            device_pages: 4096,
            l2_pages: 8192,
            daemon: Vec::new(),
            agent: Vec::new(),
            prefetch: Some(PrefetchPolicy::WaitComplete),
            chaos: Vec::new(),
            sequential: false,
        }
    }
}

impl Run {
    /// Small tiers: room for the longest request of the first thousand (135k tokens) in L1,
    /// not much more, and an L2 smaller than a few long requests, so every tier serves.
    fn small() -> Self {
        Self {
            device_pages: 2600,
            l2_pages: 3000,
            ..Self::default()
        }
    }
}

/// The test binary re-executed into a server role.
fn launcher() -> Launcher {
    Launcher {
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
    }
}

fn simulate(reqs: Vec<Request>, run: Run) -> Report {
    let mut daemon_sets = vec![
        format!("l2.pool_pages={}", run.l2_pages),
        "l3.backend=file".to_string(),
        "prefetch.recompute_tokens_per_second=0".to_string(),
        "prefetch.threshold_tokens=0".to_string(),
        "prefetch.budget_fraction=1.0".to_string(),
    ];
    daemon_sets.extend(run.daemon);
    let launcher = launcher();
    let opts = Options {
        layout: layout(),
        device_pages: run.device_pages,
        device: Default::default(),
        prefetch: run.prefetch,
        sequential: run.sequential,
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

/// What every healthy run must show: every request served, no wrong page, nothing lost,
/// every computed page in some tier at the end, and at least `share` of the ideal reuse.
fn assert_healthy(what: &str, r: &Report, n: usize, share: f64) {
    assert_eq!(r.pages_corrupt, 0, "{what}: {:?}", r.corrupt_samples);
    assert_eq!((r.requests, r.failed_requests), (n, 0), "{what}");
    assert_eq!(r.pages_lost_total, 0, "{what}: lost {:?}", r.pages_lost);
    assert_eq!(
        r.pages_unreachable, 0,
        "{what}: computed pages in no tier at the end, and not counted as lost"
    );
    assert_served(what, r, share);
    assert!(r.pages_verified * 64 >= r.hits(), "{what}");
    // Requests finished before another starts come before it in the queue.
    assert!(
        r.reachable_reusable_tokens <= r.ideal_reusable_tokens,
        "{what}"
    );
}

/// `share` is asked of what kvtier itself controls: the tokens served over those some
/// finished request had computed when they were asked for. Concurrent requests that share a
/// prefix and run at the same time cannot reuse each other's pages; how many do depends on
/// how fast this (shared, 2-core) machine runs the workers, so the share of the full ideal
/// only has a looser floor (a 5.1% overlap was seen with every reachable token served).
fn assert_served(what: &str, r: &Report, share: f64) {
    assert!(
        r.served_of_reachable >= share,
        "{what}: served {:.3} of the reachable reuse, want at least {share}",
        r.served_of_reachable
    );
    assert!(
        r.served_fraction >= 0.9 * share,
        "{what}: served {:.3} of the ideal reuse, want at least {:.3}",
        r.served_fraction,
        0.9 * share
    );
}

/// The ideal reuse, counted without page keys or token ids: page `p` of a prompt is the same
/// page as in an earlier prompt exactly when the hash ids of the 512-token blocks up to the
/// one holding it are the same. Generated tokens are unique to their request, so only full
/// prompt pages can be reused.
fn ideal_from_block_ids(limit: usize, page: usize) -> u64 {
    let text = std::fs::read_to_string(trace()).unwrap();
    let mut seen: HashSet<(Vec<u64>, usize)> = HashSet::new();
    let mut total = 0;
    for line in text.lines().take(limit) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let len = v["input_length"].as_u64().unwrap() as usize;
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap())
            .collect();
        let pages: Vec<(Vec<u64>, usize)> = (0..len / page)
            .map(|p| (ids[..p * page / 512 + 1].to_vec(), p))
            .collect();
        total += (pages.iter().take_while(|p| seen.contains(*p)).count() * page) as u64;
        seen.extend(pages);
    }
    total
}

#[test]
fn the_ideal_agrees_with_an_independent_count() {
    for (limit, page) in [(1000, 64), (300, 16), (1000, 512)] {
        assert_eq!(
            workload::ideal_reusable_tokens(&requests(limit), page),
            ideal_from_block_ids(limit, page),
            "first {limit} requests, {page}-token pages"
        );
    }
    // The slice's figure quoted in tests/data/README.md.
    assert_eq!(ideal_from_block_ids(1000, 64), 2_045_824);
}

#[test]
fn concurrent_replay_keeps_the_reuse_and_loses_nothing() {
    for workers in [2, 4] {
        let r = simulate(
            requests(1000),
            Run {
                workers,
                ..Run::default()
            },
        );
        assert_healthy(&format!("{workers} workers"), &r, 1000, 0.95);
        assert!(r.bytes.l3_write > 0 && r.bytes.backup > 0);
        assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
    }
}

#[test]
fn sequential_replay_serves_exactly_the_ideal_from_every_tier() {
    let r = simulate(
        requests(1000),
        Run {
            sequential: true,
            ..Run::small()
        },
    );
    assert_healthy("sequential", &r, 1000, 1.0);
    assert_eq!(r.hits(), r.ideal_reusable_tokens);
    assert_eq!(r.reachable_reusable_tokens, r.ideal_reusable_tokens);
    let h = &r.hit_tokens;
    assert!(h.device > 0 && h.host > 0 && h.storage > 0, "{h:?}");
    assert!(r.bytes.l3_read > 0 && r.bytes.l3_write > 0 && r.bytes.backup > 0);
}

#[test]
fn each_write_policy_keeps_the_reuse_under_concurrency() {
    let reqs = requests(1000);
    // Under write_back (and for the pages write_through_selective does not pick) a page
    // reaches L2, where the other worker can find it, only when its own worker evicts it:
    // with 4,096 device pages that is several requests later, so some reuse across workers
    // is missed by design (kvtier-sim measures 0.955 to 0.97 of the ideal for write_back on
    // these requests). Nothing may be lost under any policy.
    for (write, l3_write, prefetch, share) in [
        (
            "write_back",
            "write_through",
            PrefetchPolicy::WaitComplete,
            0.9,
        ),
        (
            "write_through_selective",
            "write_back",
            PrefetchPolicy::WaitComplete,
            0.9,
        ),
        (
            "write_through",
            "write_through_selective",
            PrefetchPolicy::Timeout,
            0.95,
        ),
    ] {
        let r = simulate(
            reqs.clone(),
            Run {
                agent: vec![format!("cache.write_policy={write}")],
                daemon: vec![format!("l3.write_policy={l3_write}")],
                prefetch: Some(prefetch),
                ..Run::default()
            },
        );
        assert_healthy(&format!("{write}/{l3_write}"), &r, 1000, share);
    }
}

#[test]
fn a_small_l2_passes_long_prefixes_through_to_l3() {
    // L2 holds 1,024 pages; the longest prefixes are twice that. Pages reach L3 through L2
    // in chunks, and come back the same way.
    let r = simulate(
        requests(1000),
        Run {
            l2_pages: 1024,
            ..Run::default()
        },
    );
    // 1.000 alone; 0.949 of the ideal once in a full `scripts/test` run on this 2-core
    // machine, where pages still queued for backup on the other worker are invisible to the
    // first. The floor leaves room for that, not for lost pages: assert_healthy still wants
    // 0 lost and 0 unreachable.
    assert_healthy("l2 1024 pages", &r, 1000, 0.93);
    assert!(
        r.hit_tokens.storage > r.hit_tokens.host + r.hit_tokens.device,
        "most hits come from L3: {:?}",
        r.hit_tokens
    );
}

#[test]
fn pages_given_up_are_counted_with_their_reason() {
    // No L3: every page L2 evicts is gone from the node's shared tiers. Each one is counted,
    // and nothing is missing at the end that the counts do not explain.
    let r = simulate(
        requests(300),
        Run {
            daemon: vec!["l3.backend=none".into()],
            ..Run::small()
        },
    );
    assert_eq!(r.pages_corrupt, 0, "{:?}", r.corrupt_samples);
    let no_l3 = r.pages_lost.get("l2:no_l3").copied().unwrap_or(0);
    assert!(no_l3 > 0, "{:?}", r.pages_lost);
    assert_eq!(r.pages_lost_total, no_l3, "{:?}", r.pages_lost);
    assert!(
        r.pages_unreachable > 0 && r.pages_unreachable <= r.pages_lost_total,
        "unreachable {} vs lost {}",
        r.pages_unreachable,
        r.pages_lost_total
    );
}

/// What a run with faults must still show: every request served, no wrong page, nothing
/// lost, and at least `share` of the ideal reuse. (The end-of-run audit asks L3 through the
/// same faults, so its count of unreachable pages is not asserted here.)
fn assert_recovers(what: &str, r: &Report, n: usize, share: f64) {
    assert_eq!(r.pages_corrupt, 0, "{what}: {:?}", r.corrupt_samples);
    assert_eq!((r.requests, r.failed_requests), (n, 0), "{what}");
    assert_eq!(r.pages_lost_total, 0, "{what}: lost {:?}", r.pages_lost);
    assert_served(what, r, share);
}

#[test]
fn transient_l3_faults_are_retried_and_cost_little_reuse() {
    // One L3 call in twenty fails, then one in three: retries (in the store, and page by
    // page in prefetch) save nearly all of them, and the breaker, judging the rate, stays
    // closed. Before retries, 5% faults cost 89% of the reuse.
    for (rate, n, share) in [(0.05, 1000, 0.9), (0.3, 400, 0.6)] {
        let r = simulate(
            requests(n),
            Run {
                daemon: vec![format!("l3.fault_error_rate={rate}")],
                ..Run::default()
            },
        );
        assert_recovers(&format!("fault rate {rate}"), &r, n, share);
        assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
    }
}

#[test]
fn a_killed_daemon_or_agent_is_a_blip() {
    // kvtierd is SIGKILLed mid-run and started again, then an agent: the agents re-register
    // at once, backups wait for the daemon instead of giving pages up, the file L3 serves
    // everything written before the kill, and reuse comes back.
    let r = simulate(
        requests(1000),
        Run {
            chaos: vec![Chaos::KillDaemonAt(400), Chaos::KillAgentAt(700)],
            ..Run::default()
        },
    );
    assert_recovers("concurrent", &r, 1000, 0.95);
    let r = simulate(
        requests(400),
        Run {
            chaos: vec![Chaos::KillDaemonAt(150)],
            sequential: true,
            ..Run::small()
        },
    );
    assert_recovers("sequential", &r, 400, 0.95);
    assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
}

#[test]
fn l2_survives_a_daemon_crash() {
    // No L3, and an L2 that holds everything: after kvtierd is SIGKILLed, its successor takes
    // over the pool's verified pages, so every page computed before the kill is still in a
    // tier at the end (without the takeover, tens of thousands are not).
    let n = 400;
    let r = simulate(
        requests(n),
        Run {
            l2_pages: 200_000,
            daemon: vec!["l3.backend=none".into()],
            chaos: vec![Chaos::KillDaemonAt(200)],
            ..Run::default()
        },
    );
    assert_healthy("kill without L3", &r, n, 0.9);
    assert!(r.hit_tokens.host > 0, "{:?}", r.hit_tokens);
}

#[test]
fn slow_storage_never_slows_the_engine() {
    let n = 400;
    let slow = |delay: &str, extra: &[&str], policy| {
        let mut daemon = vec![format!("l3.fault_get_delay={delay}")];
        daemon.extend(extra.iter().map(|s| s.to_string()));
        simulate(
            requests(n),
            Run {
                daemon,
                prefetch: Some(policy),
                ..Run::default()
            },
        )
    };
    // 200 ms per L3 read. Each read waits the same however many run, so the prefetch widens
    // its read window and the pages still arrive within the timeout policy's deadline (with
    // 16 reads at once they would not).
    let r = slow("200ms", &[], PrefetchPolicy::Timeout);
    assert_recovers("200 ms reads, timeout", &r, n, 0.95);
    assert!(r.hit_tokens.storage > 0, "{:?}", r.hit_tokens);
    assert_eq!(r.storage_waits.over_deadline, 0, "{:?}", r.storage_waits);
    // 3 s per read against a 300 ms deadline: a request waits out its deadline, no more,
    // then computes what did not arrive.
    let r = slow(
        "3s",
        &[
            "prefetch.timeout_base=300ms",
            "prefetch.timeout_per_1k_tokens=0s",
        ],
        PrefetchPolicy::Timeout,
    );
    assert_recovers("3 s reads, timeout", &r, n, 0.0);
    assert!(
        r.prefetch.get("timed_out").is_some_and(|&t| t > 0),
        "{:?}",
        r.prefetch
    );
    assert_eq!(r.storage_waits.over_deadline, 0, "{:?}", r.storage_waits);
    assert!(
        r.storage_waits.max_seconds < 1.5,
        "a request waited {:.2} s on a 300 ms deadline",
        r.storage_waits.max_seconds
    );
    // Best effort: the engine never waits; it takes what landed when it runs the request.
    let r = slow("200ms", &[], PrefetchPolicy::BestEffort);
    assert_recovers("200 ms reads, best effort", &r, n, 0.0);
    assert!(r.storage_waits.requests > 0, "{:?}", r.storage_waits);
    assert!(
        r.storage_waits.max_seconds < 0.5,
        "best effort waited {:.2} s",
        r.storage_waits.max_seconds
    );
}

#[test]
fn several_faults_at_once() {
    // Flaky, slow L3 (1 call in 20 fails, every read 50 ms late), kvtierd killed, then an
    // agent, under the timeout policy: reuse holds, nothing is wrong, nothing is lost, and no
    // request waits past its deadline.
    let n = 400;
    let r = simulate(
        requests(n),
        Run {
            daemon: vec![
                "l3.fault_error_rate=0.05".into(),
                "l3.fault_get_delay=50ms".into(),
            ],
            chaos: vec![Chaos::KillDaemonAt(150), Chaos::KillAgentAt(300)],
            prefetch: Some(PrefetchPolicy::Timeout),
            ..Run::default()
        },
    );
    assert_recovers("all at once", &r, n, 0.9);
    assert_eq!(r.storage_waits.over_deadline, 0, "{:?}", r.storage_waits);
}

/// A fleet of `nodes` nodes of one worker over one shared file L3, tiers small against the
/// trace slice (2,600 device pages, 3,000 L2 pages a node), at trace time × 0.05.
fn small_fleet(
    nodes: usize,
    policy: kvtier_sim::router::Policy,
    daemon_sets: &[&str],
    chaos: Vec<kvtier_sim::fleet::FleetChaos>,
) -> kvtier_sim::fleet::FleetOptions {
    let sets: Vec<String> = [
        "l2.pool_pages=3000",
        "prefetch.recompute_tokens_per_second=0",
        "prefetch.threshold_tokens=0",
        "prefetch.budget_fraction=1.0",
    ]
    .iter()
    .chain(daemon_sets)
    .map(|s| s.to_string())
    .collect();
    kvtier_sim::fleet::FleetOptions {
        base: Options {
            layout: layout(),
            device_pages: 2600,
            device: Default::default(),
            prefetch: Some(PrefetchPolicy::WaitComplete),
            sequential: false,
            time_scale: 0.05,
            prefill_tokens_per_second: 10_000.0,
            chaos: Vec::new(),
            progress: false,
        },
        nodes,
        node: ClusterSpec {
            workers: 1,
            daemon_sets: sets,
            agent_sets: Vec::new(),
        },
        policy,
        seed: 1,
        l3: Default::default(),
        private_l2: false,
        chaos,
        l3_dir: None,
    }
}

/// A fleet of two nodes over one shared L3, routed by kvtier's events: every page any worker
/// receives is the recomputed one, nothing fails, the events reach the router, and routing by
/// them serves more of the reuse than round-robin (which the shared L3 already gives some).
/// How much of the ideal either serves depends on how fast this machine runs the compressed
/// trace (0.71 against 0.40 seen here), so the test holds only the order.
#[test]
fn a_fleet_routed_by_kvtier_events_serves_the_reuse_and_no_wrong_page() {
    use kvtier_sim::fleet::run_fleet;
    use kvtier_sim::router::Policy;
    let n = 80;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut reports = Vec::new();
    for policy in [Policy::RoundRobin, Policy::Kvtier] {
        let opts = small_fleet(2, policy, &[], Vec::new());
        let r = rt
            .block_on(run_fleet(requests(n), opts, launcher()))
            .unwrap();
        eprintln!("{}", kvtier_sim::fleet::table(std::slice::from_ref(&r)));
        assert_eq!((r.requests, r.failed_requests), (n as u64, 0), "{r:?}");
        assert_eq!(r.pages_corrupt, 0, "{r:?}");
        assert!(r.pages_verified > 0 && r.hits() > 0, "{r:?}");
        reports.push(r);
    }
    let (rr, kv) = (&reports[0], &reports[1]);
    assert!(kv.event_lag_p99_ms > 0.0, "the router saw no event: {kv:?}");
    assert!(
        kv.served_fraction > rr.served_fraction,
        "kvtier {:.3} of the ideal, round-robin {:.3}",
        kv.served_fraction,
        rr.served_fraction
    );
}

/// Chaos in a fleet of three nodes routed by kvtier's events, over a shared L3 that fails
/// one get or set in twenty: node 2 hangs for 3 s and then leaves for good, node 0's kvtierd
/// is killed and restarted, node 1 leaves and comes back with an empty L2. No page served is
/// wrong, no request fails, the hang is noticed, nothing is routed to a node out of the
/// fleet, the router's view of every node agrees with what the node answers to `Locate` at
/// the end, and it forgot and relearned the nodes whose streams ended.
#[test]
fn a_fleet_under_chaos_serves_no_wrong_page_and_its_router_follows() {
    use kvtier_sim::fleet::{FleetChaos, run_fleet};
    use kvtier_sim::router::Policy;
    let n = 90;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let opts = small_fleet(
        3,
        Policy::Kvtier,
        &["l3.fault_error_rate=0.05"],
        vec![
            FleetChaos::kill(15, 0),
            FleetChaos::remove(20, 2),
            FleetChaos::remove(30, 1),
            FleetChaos::add(50, 1),
            FleetChaos::HangNode {
                at: 10,
                node: 2,
                ms: 3000,
            },
        ],
    );
    let r = rt
        .block_on(run_fleet(requests(n), opts, launcher()))
        .unwrap();
    eprintln!("{}", kvtier_sim::fleet::table(std::slice::from_ref(&r)));
    eprintln!("{r:?}");
    assert_eq!((r.requests, r.failed_requests), (n as u64, 0), "{r:?}");
    assert_eq!(r.pages_corrupt, 0, "{r:?}");
    assert!(r.pages_verified > 0 && r.hits() > 0, "{r:?}");
    assert_eq!(
        (r.node_kills, r.node_hangs, r.nodes_removed, r.nodes_added),
        (1, 1, 2, 1)
    );
    // The hang was noticed (and routed around) within its 3 s.
    assert!(r.stalls[2] >= 1, "{r:?}");
    assert_eq!(r.view_unreachable, 0, "{r:?}");
    assert!(
        r.requests_per_node[2] <= 20,
        "node 2 left before request 20 and was sent {}",
        r.requests_per_node[2]
    );
    assert!(
        r.requests_per_node[1] > 0 && r.requests_per_node[0] > 0,
        "{:?}",
        r.requests_per_node
    );
    // Node 0's kill and the two removals each ended a stream.
    assert!(r.view_resyncs >= 3, "{r:?}");
    assert!(r.view_checked > 0, "{r:?}");
    assert_eq!(r.view_disagreements, 0, "{r:?}");
}
