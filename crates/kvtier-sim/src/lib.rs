//! kvtier-sim: drives kvtier the way inference engines do and proves, on every run, that no
//! tier ever serves a page different from recomputing it.
//!
//! A simulation has workers (each a [`engine::Worker`]: a cpu KV pool and its own
//! kvtier-agent) sharing one kvtierd, and a workload ([`workload`]: a Mooncake trace or
//! generated chat sessions). Requests are spread over the workers round-robin; every page a
//! worker receives (device hit, L2 load-back, L3 prefetch) is compared with the deterministic
//! KV of [`kv`]. [`run`] returns a [`Report`].
//!
//! Where things are: the driver (the run loop, the per-page check, the audit) here; what a
//! run reports, and how it prints, in `report.rs`; workloads, the engine and the embedded
//! cluster in their own modules; the fleet replay (many nodes, a router) in `fleet.rs` and
//! `router.rs`.

/// A name unique to this simulation within the machine (process id, a counter and the
/// clock), for its directories and shared-memory files: several simulations may run at once.
pub fn run_id() -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!(
        "{}-{}-{nanos:x}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

pub mod cluster;
pub mod engine;
pub mod fleet;
pub mod kv;
mod report;
pub mod router;
pub mod workload;

pub use report::{Bytes, HitTokens, Prefetches, Report, StorageWaits, TtftEstimate, Waits};

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvtier_core::LayoutSpec;
use kvtier_proto::v1;
use tokio::sync::Mutex;

use crate::cluster::{Cluster, ClusterSpec, Launcher};
use crate::engine::{Outcome, Worker};
use crate::workload::Request;

/// Where the kvtier processes come from.
#[derive(Clone, Debug)]
pub enum Target {
    /// Start kvtierd and one agent per worker here.
    Embedded(ClusterSpec),
    /// Use running ones: kvtierd's socket (for its metrics) and one agent socket per worker.
    Attach {
        /// kvtierd's socket.
        daemon: PathBuf,
        /// One agent socket per worker.
        agents: Vec<PathBuf>,
    },
}

/// Something to do to the cluster while it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Chaos {
    /// SIGKILL kvtierd after this many requests, then start it again.
    KillDaemonAt(usize),
    /// SIGKILL worker 0's agent after this many requests, then start it again.
    KillAgentAt(usize),
}

/// A simulation.
#[derive(Clone, Debug)]
pub struct Options {
    /// The model layout every worker uses.
    pub layout: LayoutSpec,
    /// Device pages per worker.
    pub device_pages: u64,
    /// Where the workers' pools are: CPU shared memory or GPU 0.
    pub device: kv::SimDevice,
    /// Prefetch policy for L3 hits (`None`: no prefetch; only L2 is loaded).
    pub prefetch: Option<v1::PrefetchPolicy>,
    /// Run requests one at a time, in order (the deterministic mode tests use); otherwise
    /// every worker serves its share concurrently.
    pub sequential: bool,
    /// Replay at trace time scaled by this (0: as fast as possible).
    pub time_scale: f64,
    /// The cost model's prefill rate, tokens per second.
    pub prefill_tokens_per_second: f64,
    /// Chaos events.
    pub chaos: Vec<Chaos>,
    /// Show progress on stderr.
    pub progress: bool,
}

/// The pages finished requests computed, shared by the workers: what a request could have
/// been served at the moment it asked, whatever the cache.
#[derive(Debug, Default)]
struct Reachable {
    done: std::collections::HashSet<kvtier_core::PageKey>,
    tokens: u64,
}

impl Reachable {
    /// Counts the leading `prompt` pages finished requests computed, and returns them in
    /// tokens.
    fn ask(&mut self, prompt: &[kvtier_core::PageKey], page_size: usize) -> u64 {
        let n = prompt.iter().take_while(|k| self.done.contains(*k)).count();
        let tokens = (n * page_size) as u64;
        self.tokens += tokens;
        tokens
    }
}

/// kvtierd's figures the report needs, read from its metrics stream.
#[derive(Debug, Default)]
struct DaemonFigures {
    l3_read_bytes: u64,
    l3_write_bytes: u64,
    l3_written_pages: u64,
    /// Pages evicted from L2 without a copy in L3, by reason.
    lost: Vec<(String, u64)>,
}

async fn daemon_figures(socket: &std::path::Path) -> DaemonFigures {
    let Ok(mut c) = kvtier_client::HostClient::connect(&socket.display().to_string()).await else {
        return DaemonFigures::default();
    };
    let Ok(mut s) = c.watch_metrics(Duration::from_millis(100)).await else {
        return DaemonFigures::default();
    };
    let Ok(Some(snap)) = s.message().await else {
        return DaemonFigures::default();
    };
    let sum = |name: &str, label: Option<(&str, &str)>| {
        snap.samples
            .iter()
            .filter(|s| {
                s.name == name
                    && label
                        .is_none_or(|(k, v)| s.labels.iter().any(|l| l.name == k && l.value == v))
            })
            .map(|s| s.value as u64)
            .sum::<u64>()
    };
    let lost = snap
        .samples
        .iter()
        .filter(|s| s.name == "kvtier_l2_lost_pages_total" && s.value > 0.0)
        .map(|s| {
            let reason = s
                .labels
                .iter()
                .find(|l| l.name == "reason")
                .map(|l| l.value.clone())
                .unwrap_or_default();
            (reason, s.value as u64)
        })
        .collect();
    DaemonFigures {
        l3_read_bytes: sum("kvtier_l3_backend_bytes_total", Some(("op", "get"))),
        l3_write_bytes: sum("kvtier_l3_backend_bytes_total", Some(("op", "set"))),
        l3_written_pages: sum("kvtier_l3_writes_total", Some(("outcome", "written"))),
        lost,
    }
}

/// The end-of-run audit: every worker gives its device pages back (the agent backs each up
/// first, as eviction does), the writes settle, and the pages of every request are looked
/// up in L2 and L3. Returns how many distinct page keys no tier holds.
async fn audit(
    workers: &[Arc<Mutex<Worker>>],
    requests: &[&Request],
    daemon: &mut Option<kvtier_client::HostClient>,
    layout: &LayoutSpec,
) -> Result<u64> {
    for w in workers {
        let mut w = w.lock().await;
        if let Err(e) = w.drain().await {
            tracing::warn!(
                "audit: worker {} could not give its pages back: {e:#}",
                w.id
            );
        }
    }
    for w in workers {
        w.lock().await.settle(daemon, Duration::from_secs(60)).await;
    }
    let Some(first) = workers.first() else {
        return Ok(0);
    };
    let first = first.lock().await;
    let Some(d) = daemon.as_mut() else {
        // No kvtierd to ask: nothing is reachable beyond the devices, which gave theirs up.
        let all: std::collections::HashSet<_> =
            requests.iter().flat_map(|r| first.all_keys(r)).collect();
        return Ok(all.len() as u64);
    };
    let session = d
        .register("kvtier-sim-audit", layout)
        .await
        .context("registering the audit session")?;
    let mut missing = std::collections::HashSet::new();
    for r in requests {
        let keys = first.all_keys(r);
        let mut at = 0;
        while at < keys.len() {
            let (l2, l3) = d
                .lookup_tiers(session.id, &keys[at..], true)
                .await
                .context("audit lookup")?;
            at += l2 + l3;
            if let Some(k) = keys.get(at) {
                missing.insert(*k);
                at += 1;
            }
        }
    }
    let _ = d.close(session.id).await;
    Ok(missing.len() as u64)
}

/// Runs a simulation of `requests`; `launcher` is how embedded servers are started.
pub async fn run(
    requests: Vec<Request>,
    opts: Options,
    target: Target,
    launcher: Launcher,
) -> Result<Report> {
    let page_size = opts.layout.page_size as usize;
    let ideal = workload::ideal_reusable_tokens(&requests, page_size);
    let id = run_id();
    let (cluster, daemon_socket, agent_sockets) = match &target {
        Target::Embedded(spec) => {
            let spec = spec.clone();
            let cid = id.clone();
            let c = tokio::task::spawn_blocking(move || Cluster::start(launcher, &spec, &cid))
                .await
                .context("starting the cluster")??;
            let d = c.daemon.socket.clone();
            let a = c
                .agents
                .iter()
                .map(|a| a.socket.clone())
                .collect::<Vec<_>>();
            (Some(Arc::new(parking_lot::Mutex::new(c))), d, a)
        }
        Target::Attach { daemon, agents } => (None, daemon.clone(), agents.clone()),
    };
    let mut workers = Vec::new();
    for (i, sock) in agent_sockets.iter().enumerate() {
        let mut w = Worker::new(
            i,
            sock.clone(),
            opts.layout.clone(),
            opts.device_pages,
            opts.prefetch,
            &id,
            opts.device,
        )?;
        w.set_compute_time(opts.prefill_tokens_per_second, opts.time_scale);
        w.connect().await?;
        if !w.wait_daemon(Duration::from_secs(30)).await? {
            anyhow::bail!(
                "worker {i}'s agent never reached kvtierd at {}",
                daemon_socket.display()
            );
        }
        workers.push(Arc::new(Mutex::new(w)));
    }
    let page_bytes = workers
        .first()
        .context("at least one worker is needed")?
        .lock()
        .await
        .page_bytes() as u64;
    let n = requests.len();
    let requests = Arc::new(requests);
    let done = Arc::new(AtomicUsize::new(0));
    let outcomes = Arc::new(parking_lot::Mutex::new(
        Vec::<Result<Outcome, String>>::new(),
    ));
    let started = Instant::now();

    // Progress on stderr.
    let progress = opts.progress.then(|| {
        let done = done.clone();
        tokio::spawn(async move {
            loop {
                let k = done.load(Ordering::Relaxed);
                let width = 40;
                let filled = (k * width).checked_div(n).unwrap_or(width);
                eprint!(
                    "\r[{}{}] {k}/{n} requests",
                    "#".repeat(filled),
                    ".".repeat(width - filled)
                );
                if k >= n {
                    eprintln!();
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    });

    // Chaos: a watcher kills and restarts processes when the run reaches each point.
    let chaos = cluster.clone().map(|cluster| {
        let (done, events) = (done.clone(), opts.chaos.clone());
        tokio::spawn(async move {
            for ev in events {
                let at = match ev {
                    Chaos::KillDaemonAt(k) | Chaos::KillAgentAt(k) => k,
                };
                while done.load(Ordering::Relaxed) < at {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let cluster = cluster.clone();
                let r = tokio::task::spawn_blocking(move || -> Result<()> {
                    let mut c = cluster.lock();
                    let launcher = c.launcher().clone();
                    match ev {
                        Chaos::KillDaemonAt(_) => c.daemon.restart(&launcher),
                        Chaos::KillAgentAt(_) => match c.agents.first_mut() {
                            Some(a) => a.restart(&launcher),
                            None => Ok(()),
                        },
                    }
                })
                .await;
                match r {
                    Ok(Ok(())) => tracing::info!(?ev, "chaos: restarted"),
                    Ok(Err(e)) => tracing::error!(?ev, "chaos restart failed: {e:#}"),
                    Err(e) => tracing::error!(?ev, "chaos task failed: {e}"),
                }
            }
        })
    });

    let reachable = Arc::new(parking_lot::Mutex::new(Reachable::default()));
    let (done2, outcomes2, reachable2) = (done.clone(), outcomes.clone(), reachable.clone());
    let serve = move |w: Arc<Mutex<Worker>>, req: Request| {
        let (done, outcomes, reachable) = (done2.clone(), outcomes2.clone(), reachable2.clone());
        async move {
            let mut w = w.lock().await;
            let could = reachable.lock().ask(&w.prompt_keys(&req), page_size);
            let mut r = w.serve(&req).await;
            if r.is_err() {
                // The agent (or the daemon behind it) went away: reconnect once and retry.
                tokio::time::sleep(Duration::from_millis(50)).await;
                let deadline = Instant::now() + Duration::from_secs(30);
                while w.connect().await.is_err() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                let _ = w.wait_daemon(Duration::from_secs(10)).await;
                r = w.serve(&req).await;
            }
            if let Ok(o) = &r {
                let served = o.device + o.host + o.storage;
                if served < could {
                    tracing::info!(
                        request = req.index,
                        worker = w.id,
                        could,
                        served,
                        device = o.device,
                        host = o.host,
                        storage = o.storage,
                        matched_l2 = o.matched.0,
                        matched_l3 = o.matched.1,
                        prefetch = o.prefetch.as_deref().unwrap_or("-"),
                        "served less than finished requests had computed"
                    );
                }
                reachable.lock().done.extend(w.all_keys(&req));
            }
            let r = r.map_err(|e| format!("request {}: {e:#}", req.index));
            if let Err(e) = &r {
                tracing::warn!("{e}");
            }
            outcomes.lock().push(r);
            done.fetch_add(1, Ordering::Relaxed);
        }
    };
    let pace = |req: &Request| {
        let at = Duration::from_secs_f64(req.at_ms as f64 / 1000.0 * opts.time_scale);
        async move {
            let left = at.saturating_sub(started.elapsed());
            if !left.is_zero() {
                tokio::time::sleep(left).await;
            }
        }
    };
    if opts.sequential {
        // One request at a time, and each one's backups (device → L2 → L3) settled before
        // the next, so the result does not depend on how fast this machine copies.
        let mut daemon = kvtier_client::HostClient::connect(&daemon_socket.display().to_string())
            .await
            .ok();
        for (i, req) in requests.iter().enumerate() {
            pace(req).await;
            let w = workers[i % workers.len()].clone();
            serve(w.clone(), req.clone()).await;
            w.lock()
                .await
                .settle(&mut daemon, Duration::from_secs(30))
                .await;
        }
    } else {
        // As an engine's scheduler does: one queue in arrival order, each worker taking the
        // next request when it is free, so at most `workers` requests are in flight.
        let next = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for w in &workers {
            let (w, serve, next, requests) =
                (w.clone(), serve.clone(), next.clone(), requests.clone());
            let time_scale = opts.time_scale;
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(req) = requests.get(i) else { break };
                    let at = Duration::from_secs_f64(req.at_ms as f64 / 1000.0 * time_scale);
                    let left = at.saturating_sub(started.elapsed());
                    if !left.is_zero() {
                        tokio::time::sleep(left).await;
                    }
                    serve(w.clone(), req.clone()).await;
                }
            }));
        }
        for t in tasks {
            t.await.context("worker task")?;
        }
    }
    let wall = started.elapsed().as_secs_f64();
    if let Some(p) = progress {
        let _ = p.await;
    }
    if let Some(c) = chaos {
        c.abort();
    }

    // Let the backups of the last requests finish (device → L2 → L3), so the counts below
    // are complete; this is not part of the wall time.
    let mut daemon = kvtier_client::HostClient::connect(&daemon_socket.display().to_string())
        .await
        .ok();
    for w in &workers {
        w.lock()
            .await
            .settle(&mut daemon, Duration::from_secs(60))
            .await;
    }
    let mut rep = Report {
        page_size,
        ideal_reusable_tokens: ideal,
        wall_seconds: wall,
        ..Report::default()
    };
    let mut load_time = Duration::ZERO;
    let results = std::mem::take(&mut *outcomes.lock());
    let served: Vec<&Request> = results
        .iter()
        .filter_map(|r| r.as_ref().ok())
        .filter_map(|o| requests.get(o.request))
        .collect();
    rep.pages_unreachable = audit(&workers, &served, &mut daemon, &opts.layout).await?;
    for r in results {
        match r {
            Ok(o) => {
                rep.requests += 1;
                rep.input_tokens += o.input_tokens;
                rep.hit_tokens.device += o.device;
                rep.hit_tokens.host += o.host;
                rep.hit_tokens.storage += o.storage;
                rep.computed_tokens += o.computed;
                rep.pages_computed += o.computed_pages;
                rep.pages_verified += o.verified;
                rep.pages_corrupt += o.corrupt.len() as u64;
                for c in o.corrupt {
                    if rep.corrupt_samples.len() < 20 {
                        rep.corrupt_samples.push(c);
                    }
                }
                if let Some(p) = &o.prefetch {
                    let key = p.split(':').next().unwrap_or(p).to_string();
                    *rep.prefetch.entry(key).or_insert(0) += 1;
                }
                rep.bytes.load_back += o.load_back_bytes;
                load_time += o.load_back_time;
                if o.prefetch.is_some() {
                    let w = &mut rep.storage_waits;
                    let secs = o.storage_wait.as_secs_f64();
                    w.requests += 1;
                    w.seconds += secs;
                    w.max_seconds = w.max_seconds.max(secs);
                    // Deadline 0: not planned (revoked at once), nothing to wait for.
                    let bound = o.storage_deadline + Duration::from_millis(500);
                    if !o.storage_deadline.is_zero() && o.storage_wait > bound {
                        w.over_deadline += 1;
                    }
                }
            }
            Err(_) => rep.failed_requests += 1,
        }
    }
    for w in &workers {
        if let Ok(st) = w.lock().await.stats().await {
            rep.bytes.backup += st.backed_up_pages * page_bytes;
            rep.pages_backed_up += st.backed_up_pages;
            rep.backup_waits.count += st.backup_waits;
            rep.backup_waits.seconds += st.backup_wait_seconds;
            for l in st.lost_by_reason.iter().filter(|l| l.pages > 0) {
                *rep.pages_lost
                    .entry(format!("device:{}", l.reason))
                    .or_insert(0) += l.pages;
            }
        }
    }
    let d = daemon_figures(&daemon_socket).await;
    rep.bytes.l3_read = d.l3_read_bytes;
    rep.bytes.l3_write = d.l3_write_bytes;
    rep.pages_written_l3 = d.l3_written_pages;
    for (reason, n) in d.lost {
        *rep.pages_lost.entry(format!("l2:{reason}")).or_insert(0) += n;
    }
    rep.pages_lost_total = rep.pages_lost.values().sum();
    rep.prefetches = Prefetches {
        started: rep.prefetch.values().sum(),
        completed: rep.prefetch.get("completed").copied().unwrap_or(0),
    };
    rep.reachable_reusable_tokens = reachable.lock().tokens;
    if rep.ideal_reusable_tokens > 0 {
        rep.served_fraction = rep.hits() as f64 / rep.ideal_reusable_tokens as f64;
    }
    if rep.reachable_reusable_tokens > 0 {
        rep.served_of_reachable = rep.hits() as f64 / rep.reachable_reusable_tokens as f64;
    }
    if wall > 0.0 {
        rep.requests_per_second = rep.requests as f64 / wall;
    }
    let rate = opts.prefill_tokens_per_second.max(1.0);
    let gbps = if load_time.is_zero() {
        0.0
    } else {
        rep.bytes.load_back as f64 / load_time.as_secs_f64() / 1e9
    };
    let transfer = if gbps > 0.0 {
        rep.bytes.load_back as f64 / (gbps * 1e9)
    } else {
        0.0
    };
    let without = rep.input_tokens as f64 / rate;
    let with = rep.computed_tokens as f64 / rate + transfer;
    rep.ttft = TtftEstimate {
        model: format!("prefill at {rate:.0} tokens/s; loads at the measured {gbps:.2} GB/s"),
        no_cache_seconds: without,
        with_cache_seconds: with,
        saving: if without > 0.0 {
            1.0 - with / without
        } else {
            0.0
        },
        transfer_gbps: gbps,
    };
    drop(workers);
    if let Some(c) = cluster {
        drop(c);
    }
    Ok(rep)
}
