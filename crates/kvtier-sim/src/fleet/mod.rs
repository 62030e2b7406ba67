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
//! the busiest node's prefill work against the mean, and the lag of the events the router
//! reads.
//!
//! Two baselines change what a node is: [`FleetL3::Isolated`] takes the shared L3 away (each
//! node keeps only its own pool, as a fleet of per-instance caches does), and
//! [`FleetOptions::private_l2`] gives each worker of a node its own kvtierd with its share of
//! the node's L2 (one pool per instance, against one pool the node's workers share).
//!
//! Chaos ([`FleetChaos`]): a node's kvtierd killed and started again, a node taken out of the
//! fleet and brought back. The router forgets a node's pages when its event stream ends and
//! learns them again from the snapshot a new stream starts with; at the end of the run every
//! node's view is checked against what the node answers to `Locate`.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use tokio::sync::Mutex;

mod chaos;
mod report;

pub use chaos::FleetChaos;
pub use report::{FleetReport, table};
use report::{add, quantile};

use crate::cluster::{Cluster, ClusterSpec, Launcher};
use crate::engine::Worker;
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
    /// Whether the nodes share an L3.
    pub l3: FleetL3,
    /// Each worker gets its own kvtierd, with the node's `l2.pool_pages` divided among them.
    pub private_l2: bool,
    /// What goes wrong, and when.
    pub chaos: Vec<FleetChaos>,
    /// Where the shared L3's directory goes (`None`: the temp directory). On this machine's
    /// disk, its stalls set the pace of the whole fleet; on a tmpfs (`/dev/shm`) it stands
    /// for a shared store with bandwidth to spare.
    pub l3_dir: Option<PathBuf>,
}

/// Where a node's pages go past its L2.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FleetL3 {
    /// One file directory every node's kvtierd writes and reads.
    #[default]
    Shared,
    /// None: a node finds only what its own L2 holds.
    Isolated,
}

/// A request the router sent, with when it arrived.
struct Sent {
    req: Request,
    keys: Vec<kvtier_core::PageKey>,
    arrived: Instant,
    expected: u64,
}

/// One node: its processes (one cluster; with private L2s, one per worker) and its queue.
struct Node {
    clusters: parking_lot::Mutex<Vec<Cluster>>,
    queue: Mutex<tokio::sync::mpsc::UnboundedReceiver<Sent>>,
    /// Requests sent and not yet served.
    outstanding: AtomicUsize,
    /// Its kvtierds were stopped on purpose (the node left the fleet).
    stopped: std::sync::atomic::AtomicBool,
    /// The kvtierd whose events and `Locate` stand for the node's L2 (its first cluster's).
    daemon: String,
}

impl Node {
    /// Every kvtierd of the node: SIGKILLed then started again (`Crash`), stopped
    /// (`Stop`), or started again after a stop (`Start`), on the same socket and data
    /// directory. Blocking: call off the runtime.
    fn daemons(&self, launcher: &Launcher, what: DaemonAction) -> Result<()> {
        for c in self.clusters.lock().iter_mut() {
            match what {
                DaemonAction::Crash | DaemonAction::Start => c.daemon.restart(launcher)?,
                DaemonAction::Stop => c.daemon.stop(),
            }
        }
        Ok(())
    }

    /// Sends every kvtierd of the node `signal` (`-STOP`, `-CONT`).
    fn signal_daemons(&self, signal: &str) {
        for c in self.clusters.lock().iter() {
            c.daemon.signal(signal);
        }
    }
}

/// See [`Node::daemons`].
#[derive(Clone, Copy)]
enum DaemonAction {
    Crash,
    Stop,
    Start,
}

/// What the router's event followers share.
#[derive(Default)]
struct Followed {
    view: parking_lot::Mutex<FleetView>,
    /// Every event's age when applied, ms.
    lags: parking_lot::Mutex<Vec<f64>>,
    /// Streams that ended (the node's pages forgotten).
    resyncs: AtomicUsize,
    /// When the last batch was applied.
    last: parking_lot::Mutex<Option<Instant>>,
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
    if !(opts.base.time_scale.is_finite() && opts.base.time_scale > 0.0) {
        bail!(
            "--time-scale {}: a fleet replay needs a finite factor above 0: queueing is what \
             routing balances",
            opts.base.time_scale
        );
    }
    if !opts.base.chaos.is_empty() {
        bail!(
            "--kill-daemon-at and --kill-agent-at are for one node; a fleet's are \
             --kill-node-at, --remove-node-at and --add-node-at"
        );
    }
    if opts.private_l2 && opts.policy == Policy::Kvtier && opts.nodes > 1 {
        bail!(
            "--private-l2 with the kvtier router: the router follows one kvtierd a node; run \
             private L2s with --nodes 1 or another policy"
        );
    }
    let mut chaos = opts.chaos.clone();
    FleetChaos::validate(&mut chaos, opts.nodes, requests.len())?;
    let page_size = opts.base.layout.page_size as usize;
    let id = run_id();
    let shared_l3: PathBuf = opts
        .l3_dir
        .clone()
        .unwrap_or_else(std::env::temp_dir)
        .join(format!("kvtier-sim-{id}-l3"));
    let _ = std::fs::remove_dir_all(&shared_l3);
    // Removed however the run ends (a failed start, a node that stopped answering, a panic).
    let _shared_l3 = RemoveDir(shared_l3.clone());
    let mut spec = opts.node.clone();
    match opts.l3 {
        FleetL3::Shared => spec.daemon_sets.extend([
            "l3.backend=file".to_string(),
            format!("l3.file.path={}", shared_l3.display()),
            // Every node's store lists only its own writes: a bound would evict by a
            // partial view.
            "l3.file.capacity_bytes=0".to_string(),
            "l3.file.min_free_bytes=0".to_string(),
        ]),
        FleetL3::Isolated => spec.daemon_sets.push("l3.backend=none".to_string()),
    }
    // A node is one cluster of its workers, or (private L2s) one cluster per worker with its
    // share of the pool.
    let clusters_per_node = if opts.private_l2 {
        let pages: u64 = spec
            .daemon_sets
            .iter()
            .rev()
            .find_map(|s| s.strip_prefix("l2.pool_pages="))
            .context("--private-l2 divides the node's l2.pool_pages among its workers: set it")?
            .trim()
            .parse()
            .context("l2.pool_pages: not a number of pages")?;
        let share = pages / opts.node.workers as u64;
        if share == 0 || share * opts.node.workers as u64 != pages {
            bail!(
                "--private-l2: {pages} L2 pages do not divide among {} workers (the private \
                 pools together are the shared one's size: give a multiple)",
                opts.node.workers
            );
        }
        spec.daemon_sets.push(format!("l2.pool_pages={share}"));
        spec.workers = 1;
        opts.node.workers
    } else {
        1
    };
    let mut nodes = Vec::new();
    let mut senders = Vec::new();
    let mut workers: Vec<Vec<Arc<Mutex<Worker>>>> = Vec::new();
    for n in 0..opts.nodes {
        let mut clusters = Vec::new();
        let mut ws = Vec::new();
        for c in 0..clusters_per_node {
            let (l, s, cid) = (launcher.clone(), spec.clone(), format!("{id}-n{n}-{c}"));
            let cluster = tokio::task::spawn_blocking(move || Cluster::start(l, &s, &cid))
                .await
                .context("starting a node")??;
            for a in &cluster.agents {
                let i = ws.len();
                let mut w = Worker::new(
                    n * opts.node.workers + i,
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
            clusters.push(cluster);
        }
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        senders.push(tx);
        nodes.push(Arc::new(Node {
            daemon: clusters[0].daemon.socket.display().to_string(),
            clusters: parking_lot::Mutex::new(clusters),
            queue: Mutex::new(rx),
            outstanding: AtomicUsize::new(0),
            stopped: Default::default(),
        }));
        workers.push(ws);
    }

    // The router's view, fed by every node's events (every policy: the end of the run checks
    // it, and the lag is the stream's, whoever reads it).
    let followed = Arc::new(Followed::default());
    let watchers: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            let (followed, sock) = (followed.clone(), node.daemon.clone());
            tokio::spawn(async move { follow(n, &sock, &followed).await })
        })
        .collect();

    let router = Arc::new(parking_lot::Mutex::new(Router::new(
        opts.policy,
        opts.nodes,
        opts.node.workers,
        opts.base.prefill_tokens_per_second,
        opts.seed,
    )));
    let fp = kvtier_core::LayoutFingerprint::of(&opts.base.layout);
    let stalls: Arc<Vec<AtomicUsize>> =
        Arc::new((0..opts.nodes).map(|_| AtomicUsize::new(0)).collect());
    let health: Vec<_> = nodes
        .iter()
        .enumerate()
        .map(|(n, node)| {
            let (node, router, stalls) = (node.clone(), router.clone(), stalls.clone());
            tokio::spawn(async move { check_health(n, &node, fp, &router, &stalls).await })
        })
        .collect();
    let results = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let done = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        for w in &workers[n] {
            let (node, w, results, router, done, followed) = (
                node.clone(),
                w.clone(),
                results.clone(),
                router.clone(),
                done.clone(),
                followed.clone(),
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
                        followed.view.lock().finished(n, &sent.keys);
                    }
                    node.outstanding.fetch_sub(1, Ordering::AcqRel);
                    results
                        .lock()
                        .push((n, ttft, r.map_err(|e| format!("{e:#}"))));
                    done.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
    }
    let mut rep = FleetReport::default();
    // Arrivals, at trace time, each routed as it comes; chaos before the request it names.
    // The keys come from a hasher of the router's own: a worker's is behind its lock while
    // it serves.
    let hasher = kvtier_core::PageHasher::new(page_size, &kvtier_core::Namespace::default())?;
    let total = requests.len();
    let mut chaos = chaos.into_iter().peekable();
    let mut removals: Vec<Option<tokio::task::JoinHandle<Result<()>>>> =
        (0..opts.nodes).map(|_| None).collect();
    let mut chaos_tasks = Vec::new();
    for (i, req) in requests.iter().enumerate() {
        let at = Duration::from_secs_f64(req.at_ms as f64 / 1000.0 * opts.base.time_scale);
        let left = at.saturating_sub(started.elapsed());
        if !left.is_zero() {
            tokio::time::sleep(left).await;
        }
        while let Some(c) = chaos.next_if(|c| c.at() <= i) {
            let n = c.node();
            let (node, l) = (nodes[n].clone(), launcher.clone());
            match c {
                FleetChaos::KillNode { .. } => {
                    rep.node_kills += 1;
                    chaos_tasks.push(tokio::spawn(async move {
                        tokio::task::spawn_blocking(move || node.daemons(&l, DaemonAction::Crash))
                            .await
                            .context("restarting a node's kvtierd")?
                            .with_context(|| format!("restarting node {n}'s kvtierd"))
                    }));
                }
                FleetChaos::HangNode { ms, .. } => {
                    rep.node_hangs += 1;
                    node.signal_daemons("-STOP");
                    chaos_tasks.push(tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(ms)).await;
                        node.signal_daemons("-CONT");
                        Ok(())
                    }));
                }
                FleetChaos::RemoveNode { .. } => {
                    rep.nodes_removed += 1;
                    router.lock().present[n] = false;
                    removals[n] = Some(tokio::spawn(async move {
                        // It serves what it was sent, then its kvtierd goes.
                        while node.outstanding.load(Ordering::Acquire) > 0 {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                        node.stopped.store(true, Ordering::Release);
                        tokio::task::spawn_blocking(move || node.daemons(&l, DaemonAction::Stop))
                            .await
                            .context("stopping a node's kvtierd")?
                    }));
                }
                FleetChaos::AddNode { .. } => {
                    rep.nodes_added += 1;
                    let (removal, router, ws) =
                        (removals[n].take(), router.clone(), workers[n].clone());
                    chaos_tasks.push(tokio::spawn(async move {
                        if let Some(r) = removal {
                            r.await.context("removing a node")??;
                        }
                        let started = node.clone();
                        tokio::task::spawn_blocking(move || {
                            started.daemons(&l, DaemonAction::Start)
                        })
                        .await
                        .context("starting a node's kvtierd")?
                        .with_context(|| format!("starting node {n}'s kvtierd again"))?;
                        node.stopped.store(false, Ordering::Release);
                        for w in &ws {
                            if !w.lock().await.wait_daemon(Duration::from_secs(30)).await? {
                                bail!("node {n}'s workers never reached its new kvtierd");
                            }
                        }
                        router.lock().present[n] = true;
                        Ok(())
                    }));
                }
            }
        }
        let keys = hasher.keys(&req.input);
        let ask = Ask {
            keys: &keys,
            tokens: req.input.len() as u64,
            page_size: page_size as u64,
        };
        let (n, expected) = {
            let mut v = followed.view.lock();
            let mut r = router.lock();
            let (n, expected) = r.route(&ask, &v);
            r.queued[n] += expected;
            if r.policy() == Policy::Kvtier {
                v.sent(n, &keys);
            }
            (n, expected)
        };
        nodes[n].outstanding.fetch_add(1, Ordering::AcqRel);
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
    for t in chaos_tasks
        .into_iter()
        .chain(removals.into_iter().flatten())
    {
        t.await.context("a chaos task")??;
    }
    let present = router.lock().present.clone();
    let keys: Vec<_> = requests.iter().map(|r| hasher.keys(&r.input)).collect();
    check_view(&nodes, &present, &followed, &fp, &keys, &mut rep).await;
    for w in watchers.iter().chain(&health) {
        w.abort();
    }
    rep.stalls = stalls
        .iter()
        .map(|s| s.load(Ordering::Relaxed) as u64)
        .collect();
    rep.policy = opts.policy.name().to_string();
    rep.nodes = opts.nodes;
    rep.workers_per_node = opts.node.workers;
    rep.ideal_reusable_tokens = workload::ideal_reusable_tokens(&requests, page_size);
    rep.computed_tokens_per_node = vec![0; opts.nodes];
    rep.requests_per_node = vec![0; opts.nodes];
    rep.view_resyncs = followed.resyncs.load(Ordering::Relaxed) as u64;
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
    let mut lags = std::mem::take(&mut *followed.lags.lock());
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
    Ok(rep)
}

/// Removes a directory when dropped.
struct RemoveDir(PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How long the end-of-run check waits for a node's answer.
const ASK: Duration = Duration::from_secs(2);

/// Once the events have settled, compares the router's view with each node: for every
/// prompt of the run, the leading pages the view puts in a node's L2 against what the node
/// answers to `Locate` (a node out of the fleet: nothing). A node that does not answer
/// within [`ASK`] is counted in `view_unreachable` and left out.
async fn check_view(
    nodes: &[Arc<Node>],
    present: &[bool],
    followed: &Followed,
    layout: &kvtier_core::LayoutFingerprint,
    prompts: &[Vec<kvtier_core::PageKey>],
    rep: &mut FleetReport,
) {
    // Settled: no batch for 300 ms (at most 10 s).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let quiet = followed
            .last
            .lock()
            .is_none_or(|t| t.elapsed() > Duration::from_millis(300));
        if quiet || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut clients = Vec::new();
    for (n, node) in nodes.iter().enumerate() {
        clients.push(if present[n] {
            match tokio::time::timeout(ASK, kvtier_client::HostClient::connect(&node.daemon)).await
            {
                Ok(Ok(c)) => Some(Some(c)),
                _ => {
                    tracing::warn!(node = n, "node does not answer: its view is not checked");
                    rep.view_unreachable += 1;
                    None
                }
            }
        } else {
            Some(None)
        });
    }
    let mut seen = std::collections::HashSet::new();
    for keys in prompts {
        let Some(last) = keys.last() else { continue };
        if !seen.insert(*last) {
            continue;
        }
        let runs = followed.view.lock().prefix(keys, nodes.len());
        for (n, c) in clients.iter_mut().enumerate() {
            let held = match c {
                // Present and answering.
                Some(Some(client)) => {
                    match tokio::time::timeout(ASK, client.locate(layout, keys, false)).await {
                        Ok(Ok(l)) => l.l2_pages,
                        _ => {
                            tracing::warn!(node = n, "node stopped answering Locate");
                            rep.view_unreachable += 1;
                            *c = None;
                            continue;
                        }
                    }
                }
                // Out of the fleet: nothing.
                Some(None) => 0,
                // Not answering.
                None => continue,
            };
            rep.view_checked += 1;
            if held != runs[n].0 {
                rep.view_disagreements += 1;
                tracing::warn!(
                    node = n,
                    view = runs[n].0,
                    node_says = held,
                    "the router's view disagrees"
                );
            }
        }
    }
}

/// Asks node `n`'s kvtierd every 200 ms whether it answers (a `Locate`, [`HEALTH`] to
/// answer) and tells the router: a node that stopped answering (hung, or down and not back)
/// is sent nothing while another node answers. `stalls[n]` counts the times it stopped
/// answering (unless it was stopped on leaving the fleet).
async fn check_health(
    n: usize,
    node: &Node,
    layout: kvtier_core::LayoutFingerprint,
    router: &parking_lot::Mutex<Router>,
    stalls: &[AtomicUsize],
) {
    let mut client = None;
    loop {
        let ok = tokio::time::timeout(HEALTH, async {
            if client.is_none() {
                client = Some(kvtier_client::HostClient::connect(&node.daemon).await?);
            }
            let c = client
                .as_mut()
                .ok_or_else(|| anyhow::anyhow!("no client"))?;
            c.locate(&layout, &[kvtier_core::PageKey([0; 32])], false)
                .await?;
            anyhow::Ok(())
        })
        .await
        .is_ok_and(|r| r.is_ok());
        if !ok {
            client = None;
        }
        let was = std::mem::replace(&mut router.lock().answering[n], ok);
        // (A node stopped on leaving the fleet is not expected to answer.)
        if was && !ok && !node.stopped.load(Ordering::Acquire) {
            stalls[n].fetch_add(1, Ordering::Relaxed);
            tracing::warn!(node = n, "node stopped answering: routed around");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How long a node has to answer its health check.
const HEALTH: Duration = Duration::from_secs(1);

/// Follows node `n`'s events into the view (again after its kvtierd restarts: the stream
/// starts over with a snapshot), recording each event's age. When a stream ends the node's
/// pages are forgotten: until a new stream's snapshot says otherwise, nothing is known there.
async fn follow(n: usize, socket: &str, followed: &Followed) {
    loop {
        if let Ok(mut c) = kvtier_client::HostClient::connect(socket).await
            && let Ok(mut s) = c.watch_events(0, 0).await
        {
            while let Ok(Some(b)) = s.next().await {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(0);
                followed.view.lock().apply(n, &b.events);
                *followed.last.lock() = Some(Instant::now());
                let mut l = followed.lags.lock();
                for e in b.events.iter().filter(|e| e.seq > 0) {
                    l.push(now.saturating_sub(e.unix_nanos) as f64 / 1e6);
                }
            }
            followed.view.lock().forget_node(n);
            *followed.last.lock() = Some(Instant::now());
            followed.resyncs.fetch_add(1, Ordering::Relaxed);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
