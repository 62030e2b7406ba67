//! The fleet replay (`kvtier-sim fleet`): N nodes, each a kvtierd (its own L2) with its
//! workers and their agents, over one shared L3 (a file directory every node's kvtierd
//! writes and reads, as a shared filesystem or an object store would be), and a router in
//! front ([`crate::router`]). Requests arrive at trace time (`time_scale`), the router picks
//! a node, and the node's workers take its requests in arrival order; prefill takes the
//! cost model's time, so queues are real. Every page a worker receives is checked against
//! the deterministic KV, as in [`crate::run`].
//!
//! Per policy the report has the reuse by tier against the unbounded ideal, the modeled time
//! to first token (arrival to the end of prefill, in trace time) p50 and p99, throughput,
//! the busiest node's prefill work against the mean, and, for the `kvtier` policy, the lag
//! of the events it routed by.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::sync::Mutex;

use crate::cluster::{Cluster, ClusterSpec, Launcher};
use crate::engine::{Outcome, Worker};
use crate::router::{Ask, FleetView, Policy, Router};
use crate::workload::{self, Request};
use crate::{Options, run_id};

/// A fleet replay.
#[derive(Clone, Debug)]
pub struct FleetOptions {
    /// What every worker does (layout, device pages, prefetch, time scale, cost model).
    pub base: Options,
    /// Nodes (each its own kvtierd), at most 64.
    pub nodes: usize,
    /// What each node runs: its workers and its kvtierd's and agents' settings.
    pub node: ClusterSpec,
    /// The routing policy.
    pub policy: Policy,
    /// Seed of the `random` policy.
    pub seed: u64,
}

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
}

impl FleetReport {
    /// Hits of every tier, tokens.
    pub fn hits(&self) -> u64 {
        self.hit_tokens_device + self.hit_tokens_host + self.hit_tokens_storage
    }
}

/// A request the router sent, with when it arrived.
struct Sent {
    req: Request,
    keys: Vec<kvtier_core::PageKey>,
    arrived: Instant,
    expected: u64,
}

/// One node: its processes and its queue.
struct Node {
    _cluster: Cluster,
    queue: Mutex<tokio::sync::mpsc::UnboundedReceiver<Sent>>,
}

/// Runs `requests` through a fleet as `opts` says; `launcher` starts its processes.
pub async fn run_fleet(
    requests: Vec<Request>,
    opts: FleetOptions,
    launcher: Launcher,
) -> Result<FleetReport> {
    if !(1..=64).contains(&opts.nodes) {
        bail!("--nodes {}: a fleet has 1 to 64 nodes", opts.nodes);
    }
    if opts.node.workers == 0 {
        bail!("--workers 0: each node needs a worker");
    }
    if opts.base.time_scale <= 0.0 {
        bail!("a fleet replay needs --time-scale above 0: queueing is what routing balances");
    }
    let page_size = opts.base.layout.page_size as usize;
    let id = run_id();
    let shared_l3: PathBuf = std::env::temp_dir().join(format!("kvtier-sim-{id}-l3"));
    let _ = std::fs::remove_dir_all(&shared_l3);
    let mut spec = opts.node.clone();
    spec.daemon_sets.extend([
        "l3.backend=file".to_string(),
        format!("l3.file.path={}", shared_l3.display()),
        // Every node's store lists only its own writes: a bound would evict by a partial view.
        "l3.file.capacity_bytes=0".to_string(),
        "l3.file.min_free_bytes=0".to_string(),
    ]);
    let mut nodes = Vec::new();
    let mut senders = Vec::new();
    let mut workers: Vec<Vec<Arc<Mutex<Worker>>>> = Vec::new();
    let mut daemons = Vec::new();
    for n in 0..opts.nodes {
        let (l, s, cid) = (launcher.clone(), spec.clone(), format!("{id}-n{n}"));
        let cluster = tokio::task::spawn_blocking(move || Cluster::start(l, &s, &cid))
            .await
            .context("starting a node")??;
        let mut ws = Vec::new();
        for (i, a) in cluster.agents.iter().enumerate() {
            let mut w = Worker::new(
                n * spec.workers + i,
                a.socket.clone(),
                opts.base.layout.clone(),
                opts.base.device_pages,
                opts.base.prefetch,
                &id,
                opts.base.device,
            )?;
            w.set_compute_time(opts.base.prefill_tokens_per_second, opts.base.time_scale);
            w.connect().await?;
            if !w.wait_daemon(Duration::from_secs(30)).await? {
                bail!("node {n}'s worker {i} never reached its kvtierd");
            }
            ws.push(Arc::new(Mutex::new(w)));
        }
        daemons.push(cluster.daemon.socket.clone());
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        senders.push(tx);
        nodes.push(Arc::new(Node {
            _cluster: cluster,
            queue: Mutex::new(rx),
        }));
        workers.push(ws);
    }

    // The router's view, fed by every node's events.
    let view = Arc::new(parking_lot::Mutex::new(FleetView::default()));
    let lags = Arc::new(parking_lot::Mutex::new(Vec::<f64>::new()));
    let mut watchers = Vec::new();
    if opts.policy == Policy::Kvtier {
        for (n, sock) in daemons.iter().enumerate() {
            let (view, lags, sock) = (view.clone(), lags.clone(), sock.display().to_string());
            watchers.push(tokio::spawn(async move {
                follow(n, &sock, &view, &lags).await;
            }));
        }
    }

    let router = Arc::new(parking_lot::Mutex::new(Router::new(
        opts.policy,
        opts.nodes,
        opts.node.workers,
        opts.base.prefill_tokens_per_second,
        opts.seed,
    )));
    let results = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        for w in &workers[n] {
            let (node, w, results, router, done, view) = (
                node.clone(),
                w.clone(),
                results.clone(),
                router.clone(),
                done.clone(),
                view.clone(),
            );
            tasks.push(tokio::spawn(async move {
                loop {
                    let Some(sent) = node.queue.lock().await.recv().await else {
                        return;
                    };
                    let mut w = w.lock().await;
                    let r = w.serve(&sent.req).await;
                    let ttft = sent.arrived.elapsed();
                    // One lock at a time: the dispatcher takes the view's, then the router's.
                    let follows = {
                        let mut r = router.lock();
                        r.queued[n] = r.queued[n].saturating_sub(sent.expected);
                        r.policy() == Policy::Kvtier
                    };
                    if follows {
                        view.lock().finished(n, &sent.keys);
                    }
                    results
                        .lock()
                        .push((n, ttft, r.map_err(|e| format!("{e:#}"))));
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    // Arrivals, at trace time, each routed as it comes. The keys come from a hasher of the
    // router's own: a worker's is behind its lock while it serves.
    let hasher = kvtier_core::PageHasher::new(page_size, &kvtier_core::Namespace::default())?;
    let total = requests.len();
    for req in requests.iter() {
        let at = Duration::from_secs_f64(req.at_ms as f64 / 1000.0 * opts.base.time_scale);
        let left = at.saturating_sub(started.elapsed());
        if !left.is_zero() {
            tokio::time::sleep(left).await;
        }
        let keys = hasher.keys(&req.input);
        let ask = Ask {
            keys: &keys,
            tokens: req.input.len() as u64,
            page_size: page_size as u64,
        };
        let (n, expected) = {
            let mut v = view.lock();
            let mut r = router.lock();
            let (n, expected) = r.route(&ask, &v);
            r.queued[n] += expected;
            if r.policy() == Policy::Kvtier {
                v.sent(n, &keys);
            }
            (n, expected)
        };
        let sent = Sent {
            req: req.clone(),
            keys,
            arrived: Instant::now(),
            expected,
        };
        if senders[n].send(sent).is_err() {
            bail!("node {n}'s workers are gone");
        }
        if opts.base.progress {
            eprint!(
                "\r{} routed, {} done",
                req.index + 1,
                done.load(Ordering::Relaxed)
            );
        }
    }
    drop(senders);
    for t in tasks {
        t.await.context("a worker task")?;
    }
    let wall = started.elapsed().as_secs_f64();
    if opts.base.progress {
        eprintln!("\r{total} routed, {total} done");
    }
    for w in &watchers {
        w.abort();
    }
    let mut rep = FleetReport {
        policy: opts.policy.name().to_string(),
        nodes: opts.nodes,
        workers_per_node: opts.node.workers,
        ideal_reusable_tokens: workload::ideal_reusable_tokens(&requests, page_size),
        computed_tokens_per_node: vec![0; opts.nodes],
        ..FleetReport::default()
    };
    let mut ttfts = Vec::new();
    for (n, ttft, r) in std::mem::take(&mut *results.lock()) {
        match r {
            Ok(o) => {
                add(&mut rep, n, &o);
                ttfts.push(ttft.as_secs_f64() / opts.base.time_scale);
            }
            Err(e) => {
                tracing::warn!("{e}");
                rep.failed_requests += 1;
            }
        }
    }
    rep.ttft_p50_s = quantile(&mut ttfts, 0.5);
    rep.ttft_p99_s = quantile(&mut ttfts, 0.99);
    let mut lags = std::mem::take(&mut *lags.lock());
    rep.event_lag_p50_ms = quantile(&mut lags, 0.5);
    rep.event_lag_p99_ms = quantile(&mut lags, 0.99);
    if rep.ideal_reusable_tokens > 0 {
        rep.served_fraction = rep.hits() as f64 / rep.ideal_reusable_tokens as f64;
    }
    rep.requests_per_second = rep.requests as f64 / (wall / opts.base.time_scale);
    let mean = rep.computed_tokens_per_node.iter().sum::<u64>() as f64 / opts.nodes as f64;
    let max = rep
        .computed_tokens_per_node
        .iter()
        .copied()
        .max()
        .unwrap_or(0) as f64;
    rep.busiest_over_mean = if mean > 0.0 { max / mean } else { 1.0 };
    drop(workers);
    drop(nodes);
    let _ = std::fs::remove_dir_all(&shared_l3);
    Ok(rep)
}

fn add(rep: &mut FleetReport, node: usize, o: &Outcome) {
    rep.requests += 1;
    rep.input_tokens += o.input_tokens;
    rep.hit_tokens_device += o.device;
    rep.hit_tokens_host += o.host;
    rep.hit_tokens_storage += o.storage;
    rep.computed_tokens_per_node[node] += o.computed;
    rep.pages_verified += o.verified;
    rep.pages_corrupt += o.corrupt.len() as u64;
    for c in &o.corrupt {
        tracing::error!(node, "corrupt page: {c:?}");
    }
}

/// Follows node `n`'s events into `view` (again after its kvtierd restarts: the stream
/// starts over with a snapshot), recording each event's age.
async fn follow(
    n: usize,
    socket: &str,
    view: &parking_lot::Mutex<FleetView>,
    lags: &parking_lot::Mutex<Vec<f64>>,
) {
    loop {
        if let Ok(mut c) = kvtier_client::HostClient::connect(socket).await
            && let Ok(mut s) = c.watch_events(0, 0).await
        {
            while let Ok(Some(b)) = s.next().await {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                view.lock().apply(n, &b.events);
                let mut l = lags.lock();
                for e in b.events.iter().filter(|e| e.seq > 0) {
                    l.push(now.saturating_sub(e.unix_nanos) as f64 / 1e6);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `q` quantile of `v` (sorted here); 0 when empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
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
