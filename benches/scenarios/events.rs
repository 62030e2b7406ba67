//! kvtierd's event stream under load (issue 43, docs/routing.md): commits at a steady 10k
//! pages a second with 4 `WatchEvents` subscribers, and the time from each page's
//! publication (at its commit) to its arrival at a subscriber; then commit throughput at full
//! speed with those 4 subscribers against none, in the same run; then the router's fleet
//! index (`benches/fleet_index_bench.py`): its bytes per page, and a prefix lookup; then one
//! router over simulated fleets (`benches/router_scale_bench.py`, docs/routing.md).
//!
//! The daemon runs in-process on its own runtime (one worker per core, as kvtierd's); the
//! writer and the subscribers are clients on runtimes of their own, so every event crosses
//! the socket.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use kvtier_client::HostClient;
use kvtier_core::events::EventKind;
use kvtier_core::{DType, KvKind, LayoutSpec, PageKey};

const SUBSCRIBERS: usize = 4;
/// Pages a commit carries (an engine step's worth for a few requests).
const BATCH: usize = 10;

fn spec() -> LayoutSpec {
    LayoutSpec {
        model_id: "bench-events".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 2,
        kind: KvKind::Mha {
            kv_heads: 1,
            head_dim: 8,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    }
}

fn now_nanos() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// Distinct keys, the next `n`.
fn keys(next: &mut u64, n: usize) -> Vec<PageKey> {
    (0..n)
        .map(|_| {
            *next += 1;
            let mut k = [0x5au8; 32];
            k[..8].copy_from_slice(&next.to_le_bytes());
            PageKey(k)
        })
        .collect()
}

/// Commits `pages` in batches of [`BATCH`], one batch every `every` (none: as fast as it
/// can); returns the time taken.
async fn commit(
    c: &mut HostClient,
    s: &kvtier_client::Session,
    next: &mut u64,
    pages: usize,
    every: Option<Duration>,
) -> Duration {
    let t = Instant::now();
    let mut due = Instant::now();
    for _ in 0..pages / BATCH {
        if let Some(every) = every {
            tokio::time::sleep_until(due.into()).await;
            due += every;
        }
        let ks = keys(next, BATCH);
        let r = c.reserve(s.id, None, &ks).await.unwrap();
        assert_eq!(r.len(), BATCH);
        c.commit(s.id, &ks).await.unwrap();
    }
    t.elapsed()
}

/// CPU each kind of thread spent between two [`crate::thread_cpu::by_name`] readings, ns:
/// the daemon's runtime and sealer (`kvtierd`, `kvtierd-sealer`), the writer (the main
/// thread) and the subscribers (`events-sub`).
#[derive(Default, Clone, Copy)]
struct Cpu {
    daemon: u64,
    writer: u64,
    subscribers: u64,
}

impl Cpu {
    fn between(
        a: &std::collections::HashMap<String, u64>,
        b: &std::collections::HashMap<String, u64>,
    ) -> Self {
        let d = |name: &str| {
            b.get(name)
                .copied()
                .unwrap_or(0)
                .saturating_sub(a.get(name).copied().unwrap_or(0))
        };
        Self {
            daemon: d("kvtierd") + d("kvtierd-sealer"),
            writer: d(crate::thread_cpu::MAIN),
            subscribers: d("events-sub"),
        }
    }

    fn add(&mut self, o: Self) {
        self.daemon += o.daemon;
        self.writer += o.writer;
        self.subscribers += o.subscribers;
    }
}

/// Starts the subscribers on a runtime of their own; each counts the live (not snapshot)
/// stored events it receives, and records their lag (ns) while `measuring` is set. Each says
/// so on `ready` when its first live event arrived (its snapshot is behind it).
fn subscribe(
    target: &str,
    rt: &tokio::runtime::Runtime,
    measuring: &Arc<AtomicBool>,
    lags: &Arc<parking_lot::Mutex<Vec<u64>>>,
    received: &Arc<AtomicU64>,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    std::sync::mpsc::Receiver<()>,
) {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let tasks = (0..SUBSCRIBERS)
        .map(|_| {
            let (target, measuring, lags, received, ready) = (
                target.to_string(),
                measuring.clone(),
                lags.clone(),
                received.clone(),
                ready_tx.clone(),
            );
            rt.spawn(async move {
                let mut c = HostClient::connect(&target).await.unwrap();
                let mut w = c.watch_events(0, 0).await.unwrap();
                let mut mine = Vec::new();
                let mut live = false;
                while let Ok(Some(b)) = w.next().await {
                    let at = now_nanos();
                    for e in &b.events {
                        if e.seq == 0 || !matches!(e.kind, EventKind::Stored { .. }) {
                            continue;
                        }
                        if !live {
                            live = true;
                            ready.send(()).unwrap();
                        }
                        received.fetch_add(1, Ordering::Relaxed);
                        if measuring.load(Ordering::Relaxed) {
                            mine.push(at.saturating_sub(e.unix_nanos));
                        }
                    }
                    if !mine.is_empty() {
                        lags.lock().append(&mut mine);
                    }
                }
            })
        })
        .collect();
    (tasks, ready_rx)
}

/// What the subscribers share with the scenario.
struct Subs<'a> {
    target: &'a str,
    rt: &'a tokio::runtime::Runtime,
    measuring: &'a Arc<AtomicBool>,
    lags: &'a Arc<parking_lot::Mutex<Vec<u64>>>,
    received: &'a Arc<AtomicU64>,
}

impl Subs<'_> {
    /// Subscribes, and commits marker batches until every subscriber is past its snapshot.
    async fn start(
        &self,
        c: &mut HostClient,
        s: &kvtier_client::Session,
        next: &mut u64,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        let (tasks, ready) = subscribe(
            self.target,
            self.rt,
            self.measuring,
            self.lags,
            self.received,
        );
        let mut live = 0;
        while live < SUBSCRIBERS {
            commit(c, s, next, BATCH, None).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
            while ready.try_recv().is_ok() {
                live += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        tasks
    }
}

/// Runs the scenario (`quick`: a shorter run).
pub fn run(quick: bool) {
    let daemon = crate::InProcessDaemon::start_with(
        "events",
        &["l2.pool_pages=262144", "l3.backend=none"],
        0,
    );
    let target = daemon.ready.socket.display().to_string();
    let writer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let readers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("events-sub")
        .enable_all()
        .build()
        .unwrap();
    let (paced, burst) = if quick {
        (10_000, 20_000)
    } else {
        (30_000, 60_000)
    };
    let mut next = 0u64;
    writer.block_on(async {
        let mut c = HostClient::connect(&target).await.unwrap();
        let s = c.register("bench", &spec()).await.unwrap();
        commit(&mut c, &s, &mut next, burst / 4, None).await;
        let measuring = Arc::new(AtomicBool::new(false));
        let lags = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let received = Arc::new(AtomicU64::new(0));
        let stop = |tasks: Vec<tokio::task::JoinHandle<()>>| async move {
            for t in &tasks {
                t.abort();
            }
            for t in tasks {
                let _ = t.await;
            }
            // kvtierd's side of each stream ends when it sees the connection go.
            tokio::time::sleep(Duration::from_millis(100)).await;
        };

        // Delivery lag at a steady 10k pages a second: a batch of 10 every millisecond.
        let subs = Subs {
            target: &target,
            rt: &readers,
            measuring: &measuring,
            lags: &lags,
            received: &received,
        };
        let tasks = subs.start(&mut c, &s, &mut next).await;
        measuring.store(true, Ordering::Relaxed);
        let before = received.load(Ordering::Relaxed);
        commit(&mut c, &s, &mut next, paced, Some(Duration::from_millis(1))).await;
        let want = before + (paced * SUBSCRIBERS) as u64;
        let deadline = Instant::now() + Duration::from_secs(10);
        while received.load(Ordering::Relaxed) < want && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        measuring.store(false, Ordering::Relaxed);
        let delivered = received.load(Ordering::Relaxed) - before;
        stop(tasks).await;

        // Commit throughput at full speed, alone and with the subscribers, alternating
        // (this host's speed drifts between minutes): the medians.
        // The CPU each side spends is summed over the rounds, from the first commit until
        // every event has arrived.
        let (mut alone, mut with) = (Vec::new(), Vec::new());
        let (mut cpu_alone, mut cpu_with) = (Cpu::default(), Cpu::default());
        for _ in 0..3 {
            let t0 = crate::thread_cpu::by_name();
            alone.push(commit(&mut c, &s, &mut next, burst, None).await);
            cpu_alone.add(Cpu::between(&t0, &crate::thread_cpu::by_name()));
            let tasks = subs.start(&mut c, &s, &mut next).await;
            let before = received.load(Ordering::Relaxed);
            let t0 = crate::thread_cpu::by_name();
            with.push(commit(&mut c, &s, &mut next, burst, None).await);
            let want = before + (burst * SUBSCRIBERS) as u64;
            let deadline = Instant::now() + Duration::from_secs(10);
            while received.load(Ordering::Relaxed) < want && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            cpu_with.add(Cpu::between(&t0, &crate::thread_cpu::by_name()));
            stop(tasks).await;
        }
        c.close(s.id).await.unwrap();
        alone.sort_unstable();
        with.sort_unstable();
        let (alone, with) = (alone[1], with[1]);

        let mut v = std::mem::take(&mut *lags.lock());
        v.sort_unstable();
        let pct = |p: f64| v.get(((v.len().max(1) - 1) as f64 * p) as usize).copied().unwrap_or(0) as f64 / 1e6;
        crate::say!(
            "events: {paced} pages committed at 10k pages/s, {SUBSCRIBERS} subscribers; {delivered} of {} deliveries measured",
            paced * SUBSCRIBERS
        );
        crate::say!("delivery lag p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms", pct(0.5), pct(0.99), pct(1.0));
        crate::record(
            &format!("delivery lag p99, 10k pages/s, {SUBSCRIBERS} subscribers"),
            pct(0.99),
            "ms",
            "p50",
            pct(0.5),
            None,
        );
        assert_eq!(delivered, (paced * SUBSCRIBERS) as u64, "events were lost");
        let rate = |d: Duration| burst as f64 / d.as_secs_f64();
        crate::say!(
            "commit throughput (median of 3 alternating rounds): {:.0} pages/s alone, {:.0} with {SUBSCRIBERS} subscribers",
            rate(alone),
            rate(with)
        );
        crate::record(
            &format!("commit throughput with {SUBSCRIBERS} subscribers"),
            rate(with),
            "pages/s",
            "no subscriber",
            rate(alone),
            Some(rate(with) / rate(alone)),
        );
        // Where the CPU goes (this host's cores are shared by all of it): per 1k pages
        // committed alone, per 1k events streamed (each page is SUBSCRIBERS events).
        let pages = (3 * burst) as f64 / 1e3;
        let events = pages * SUBSCRIBERS as f64;
        let us = |ns: u64| ns as f64 / 1e3;
        let commit_cpu = us(cpu_alone.daemon + cpu_alone.writer) / pages;
        let streams = us(cpu_with.daemon.saturating_sub(cpu_alone.daemon)) / events;
        let subscribers = us(cpu_with.subscribers) / events;
        crate::say!(
            "CPU per 1k pages committed alone: kvtierd {:.0} µs, writer {:.0} µs; per 1k events \
             streamed: kvtierd {streams:.0} µs more, subscribers {subscribers:.0} µs",
            us(cpu_alone.daemon) / pages,
            us(cpu_alone.writer) / pages,
        );
        // Were the commits bound by CPU alone, the streams' and the subscribers' CPU would
        // cost them this much (they are not quite: alone, the cores idle now and then).
        let extra = (streams + subscribers) * SUBSCRIBERS as f64;
        crate::say!(
            "were commits bound by CPU alone, these subscribers would leave them {:.2} of \
             their rate ({:.2} with the subscribers on other cores)",
            commit_cpu / (commit_cpu + extra),
            commit_cpu / (commit_cpu + streams * SUBSCRIBERS as f64),
        );
        crate::record(
            "kvtierd CPU per 1k events streamed",
            streams,
            "µs",
            "per 1k pages committed",
            us(cpu_alone.daemon) / pages,
            None,
        );
        crate::record(
            "subscribers' CPU per 1k events received",
            subscribers,
            "µs",
            "kvtierd's per 1k streamed",
            streams,
            None,
        );
    });
    drop(readers);
    // Stopped, not dropped: a dropped daemon keeps running until the process exits, and its
    // pool files then stay behind in its directory in shm_dir as a crashed daemon's would.
    daemon.stop();
    // The router's side: the fleet index's bytes per page (kvtier.events, in Python).
    let args: &[&str] = if quick { &["--quick"] } else { &[] };
    crate::python::run_rows(
        "events",
        &crate::python::script("fleet_index_bench.py"),
        args,
        &[],
    );
    // One router process (kvtier.routing) over simulated fleets of 64, 256 and 1,024 nodes:
    // index memory, decision time, event apply, lag, and where it stops keeping up.
    crate::python::run_rows(
        "events",
        &crate::python::script("router_scale_bench.py"),
        args,
        &[],
    );
}
