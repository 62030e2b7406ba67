//! Shared helpers for kvtier's benchmarks.
//!
//! Every figure kvtier reports is a ratio against a baseline measured in the same run, on the
//! same bytes, interleaved with the subject, because absolute times on a shared machine drift.
//! [`compare`] does that: it alternates baseline and subject runs and takes medians.

use parking_lot::Mutex;
use std::hint::black_box;
use std::time::{Duration, Instant};

pub mod diag;
pub mod goals;
pub mod host;
pub mod placement;
pub mod python;
pub mod sink;
pub mod thread_cpu;

/// The scenarios: each `run(quick)` measures and records [`Row`]s (and prints as it goes).
pub mod scenarios {
    pub mod agent;
    pub mod events;
    pub mod fleet;
    pub mod gpu;
    pub mod host_rpc;
    pub mod index;
    pub mod keys;
    pub mod l3_file;
    pub mod l3_file_cold;
    pub mod l3_remote;
    pub mod l3_rocksdb;
    pub mod l3_s3;
    pub mod peers;
    pub mod prefetch;
    pub mod sglang;
    pub mod sim;
    pub mod vllm;
}

/// The single-node Ceph cluster helper shared with kvtier-storage's S3 tests.
#[path = "../crates/kvtier-storage/tests/ceph/mod.rs"]
#[allow(missing_docs)]
pub mod ceph;

static CEPH: Mutex<Option<std::sync::Arc<ceph::Ceph>>> = Mutex::new(None);

static LIVE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The system allocator, counting live heap bytes. A binary that needs byte figures
/// installs it: `#[global_allocator] static A: kvtier_bench::CountingAlloc =
/// kvtier_bench::CountingAlloc;`.
pub struct CountingAlloc;

// SAFETY: forwards to the system allocator unchanged and only counts bytes.
#[allow(unsafe_code)]
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, l: std::alloc::Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), std::sync::atomic::Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe { std::alloc::System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: std::alloc::Layout) {
        LIVE.fetch_sub(l.size(), std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` above with this layout.
        unsafe { std::alloc::System.dealloc(p, l) }
    }
}

/// Live heap bytes, if the binary installed [`CountingAlloc`] (0 otherwise).
pub fn live_bytes() -> usize {
    LIVE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The local Ceph cluster the s3 scenarios share (started on first use: ~20 s here).
pub fn shared_ceph() -> std::sync::Arc<ceph::Ceph> {
    let mut g = CEPH.lock();
    g.get_or_insert_with(|| std::sync::Arc::new(ceph::Ceph::start()))
        .clone()
}

/// Stops the shared Ceph cluster, if one was started (call before exiting).
pub fn stop_shared_ceph() {
    let c = CEPH.lock().take();
    drop(c);
}

/// One measured figure against its same-run baseline.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Row {
    /// Which scenario.
    pub scenario: String,
    /// What was measured.
    pub figure: String,
    /// The measured value.
    pub value: f64,
    /// Its unit (higher is better for throughputs, lower for latencies).
    pub unit: String,
    /// What it is compared with.
    pub baseline: String,
    /// The baseline's value, in the same unit.
    pub baseline_value: f64,
    /// kvtier's speed as a fraction of the baseline's (1.0 = as fast); none for reports.
    pub ratio: Option<f64>,
    /// The baseline's relative spread over its repeats ((max − min) / median), when it was
    /// measured more than once.
    pub noise: Option<f64>,
}

static ROWS: Mutex<Vec<Row>> = Mutex::new(Vec::new());
static TO_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sends the scenarios' running commentary to stderr (when stdout carries `--json`).
pub fn commentary_to_stderr(on: bool) {
    TO_STDERR.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether commentary goes to stderr.
pub fn commentary_on_stderr() -> bool {
    TO_STDERR.load(std::sync::atomic::Ordering::Relaxed)
}

/// A scenario's running commentary: stdout normally, stderr under `--json`.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {
        if $crate::commentary_on_stderr() {
            eprintln!($($t)*);
        } else {
            println!($($t)*);
        }
    };
}
static SCENARIO: Mutex<String> = Mutex::new(String::new());

fn rows() -> parking_lot::MutexGuard<'static, Vec<Row>> {
    ROWS.lock()
}

/// Sets the scenario that following rows belong to.
pub fn begin(scenario: &str) {
    *SCENARIO.lock() = scenario.to_string();
}

/// Records one row of the current scenario.
pub fn record(
    figure: &str,
    value: f64,
    unit: &str,
    baseline: &str,
    baseline_value: f64,
    ratio: Option<f64>,
) {
    let scenario = SCENARIO.lock().clone();
    rows().push(Row {
        scenario,
        figure: figure.to_string(),
        value,
        unit: unit.to_string(),
        baseline: baseline.to_string(),
        baseline_value,
        ratio,
        noise: None,
    });
}

/// Sets the noise of the row recorded last (its baseline's spread over repeats).
fn set_noise(noise: f64) {
    if let Some(r) = rows().last_mut() {
        r.noise = Some(noise);
    }
}

/// Every row recorded so far.
pub fn recorded() -> Vec<Row> {
    rows().clone()
}

/// The rows as a table, each with its goal and, where it misses it by more than the run's
/// noise, `MISS`.
pub fn table(rows: &[Row]) -> String {
    let noise = goals::run_noise(rows);
    let mut s = format!(
        "{:<11} {:<44} {:>11} {:<8} {:>11}  {:<22} {:>6}  {:<8}\n",
        "scenario", "figure", "value", "unit", "baseline", "baseline is", "ratio", "goal"
    );
    for r in rows {
        let what: String = r.baseline.chars().take(22).collect();
        let (goal, mark) = match goals::goal(r) {
            Some(g) => (
                g.to_string(),
                if goals::met(r, g, noise) {
                    ""
                } else {
                    "  MISS"
                },
            ),
            None => ("-".to_string(), ""),
        };
        s.push_str(&format!(
            "{:<11} {:<44} {:>11.3} {:<8} {:>11.3}  {:<22} {:>6}  {:<8}{mark}\n",
            r.scenario,
            r.figure,
            r.value,
            r.unit,
            r.baseline_value,
            what,
            r.ratio
                .map_or_else(|| "-".to_string(), |x| format!("{x:.3}")),
            goal,
        ));
    }
    s.push_str(&format!(
        "run noise (median spread of repeated baselines): {:.1}%\n",
        noise * 100.0
    ));
    s
}

/// The `main` of a `cargo bench --bench NAME` target: runs one scenario (`--quick` honoured).
pub fn bench_main(name: &str, run: fn(bool)) {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    begin(name);
    run(std::env::args().any(|a| a == "--quick"));
    stop_shared_ceph();
}

/// One subject-versus-baseline measurement.
#[derive(Clone, Debug)]
pub struct Comparison {
    /// What was measured.
    pub name: String,
    /// Median seconds of one subject run.
    pub subject_s: f64,
    /// Median seconds of one baseline run.
    pub baseline_s: f64,
    /// Bytes (or items) one run processes, for throughput figures.
    pub units: u64,
    /// The baseline's relative spread over its rounds ((max − min) / median).
    pub baseline_noise: f64,
}

impl Comparison {
    /// Subject speed as a fraction of baseline speed (1.0 = as fast as the baseline).
    pub fn ratio(&self) -> f64 {
        self.baseline_s / self.subject_s
    }

    /// One line for a table: name, subject and baseline throughput, ratio. Also records the
    /// comparison as a [`Row`].
    pub fn line(&self, unit: &str, scale: f64) -> String {
        let per = |s: f64| self.units as f64 / s / scale;
        record(
            &self.name,
            per(self.subject_s),
            unit,
            "same-run baseline",
            per(self.baseline_s),
            Some(self.ratio()),
        );
        set_noise(self.baseline_noise);
        format!(
            "{:<44} {:>10.3} {unit}  baseline {:>10.3} {unit}  ratio {:>5.3}",
            self.name,
            per(self.subject_s),
            per(self.baseline_s),
            self.ratio()
        )
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The relative spread of repeated measurements: (max − min) / median.
fn spread(v: &[f64]) -> f64 {
    let (lo, hi) = v
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    (hi - lo) / median(v.to_vec())
}

/// Times `subject` and `baseline` alternately, `rounds` times each after one warm-up, and
/// returns their medians.
pub fn compare<A, B, RA, RB>(
    name: &str,
    units: u64,
    rounds: usize,
    mut baseline: A,
    mut subject: B,
) -> Comparison
where
    A: FnMut() -> RA,
    B: FnMut() -> RB,
{
    black_box(baseline());
    black_box(subject());
    let (mut b, mut s) = (Vec::with_capacity(rounds), Vec::with_capacity(rounds));
    for _ in 0..rounds.max(1) {
        let t = Instant::now();
        black_box(baseline());
        b.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        black_box(subject());
        s.push(t.elapsed().as_secs_f64());
    }
    Comparison {
        name: name.to_string(),
        subject_s: median(s),
        baseline_noise: spread(&b),
        baseline_s: median(b),
        units,
    }
}

/// Deterministic pseudo-random token ids (SplitMix64), so every run hashes the same input.
pub fn tokens(n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) % 152_000) as u32
        })
        .collect()
}

/// A short criterion-friendly measurement time for this 2-core machine.
pub const MEASURE: Duration = Duration::from_secs(2);

/// Runs a server future (built by `serve` from a stop token and a ready sender) on a new
/// thread with a runtime of `workers` threads; returns what it reported ready, the token that
/// stops it, and the thread.
fn on_own_runtime<R, E, F>(
    what: &'static str,
    workers: usize,
    serve: impl FnOnce(tokio_util::sync::CancellationToken, std::sync::mpsc::Sender<R>) -> F
    + Send
    + 'static,
) -> (
    R,
    tokio_util::sync::CancellationToken,
    std::thread::JoinHandle<()>,
)
where
    R: Send + 'static,
    E: std::fmt::Display,
    F: std::future::Future<Output = Result<(), E>>,
{
    let stop = tokio_util::sync::CancellationToken::new();
    let (tx, rx) = std::sync::mpsc::channel();
    let token = stop.clone();
    let thread = std::thread::spawn(move || {
        // Named after the server, so a profile tells kvtierd's threads from the bench's.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .thread_name(what)
            .enable_all()
            .build()
            .expect("benchmark runtime");
        if let Err(e) = rt.block_on(serve(token, tx)) {
            eprintln!("benchmark {what} failed: {e}");
        }
    });
    let ready = rx
        .recv()
        .unwrap_or_else(|_| panic!("benchmark {what} did not start"));
    (ready, stop, thread)
}

/// A remote L3 store over a loopback TCP listener that takes `token` (call inside a runtime).
pub fn remote_store(target: &str, token: &str) -> kvtier_storage::remote::RemoteStore {
    let sec = kvtier_client::TcpSecurity {
        token: Some(token.to_string()),
        ..Default::default()
    };
    kvtier_storage::remote::RemoteStore::connect_with(target, &sec)
        .unwrap_or_else(|e| panic!("connecting to {target}: {e}"))
}

/// A kvtierd running in this process on its own runtime thread (the same `run` the binary
/// calls), on a private data directory; stopped and cleaned up by [`InProcessDaemon::stop`].
pub struct InProcessDaemon {
    /// Where it can be reached.
    pub ready: kvtier_daemon::Ready,
    stop: tokio_util::sync::CancellationToken,
    thread: std::thread::JoinHandle<()>,
    dir: std::path::PathBuf,
}

impl InProcessDaemon {
    /// Starts kvtierd with `sets` (`section.key=value`) on top of a private `data_dir`, no
    /// metrics endpoint and error-only logs, and waits until it serves.
    pub fn start(name: &str, sets: &[&str]) -> Self {
        Self::start_with(name, sets, 1)
    }

    /// Like [`Self::start`] with `workers` runtime threads (0: one per core, as kvtierd's
    /// own runtime has).
    pub fn start_with(name: &str, sets: &[&str], workers: usize) -> Self {
        let workers = match workers {
            0 => std::thread::available_parallelism().map_or(1, usize::from),
            n => n,
        };
        let dir = std::env::temp_dir().join(format!("kvtier-bench-{name}-{}", std::process::id()));
        let mut all = vec![
            format!("data_dir={}", dir.display()),
            "metrics.listen=".to_string(),
            "log.level=error".to_string(),
        ];
        all.extend(sets.iter().map(|s| s.to_string()));
        let cfg = kvtier_config::daemon::DaemonConfig::load(&kvtier_config::Sources {
            sets: all,
            ..kvtier_config::Sources::default()
        })
        .expect("benchmark daemon config");
        let (ready, stop, thread) = on_own_runtime("kvtierd", workers, move |stop, tx| {
            kvtier_daemon::run(cfg, stop, move |r| {
                let _ = tx.send(r);
            })
        });
        Self {
            ready,
            stop,
            thread,
            dir,
        }
    }

    /// Stops the daemon, waits for it and removes its directory.
    pub fn stop(self) {
        self.stop.cancel();
        let _ = self.thread.join();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A kvtier-agent running in this process on its own runtime thread (the same `run` the
/// binary calls); stopped by [`InProcessAgent::stop`].
pub struct InProcessAgent {
    /// Where it can be reached.
    pub ready: kvtier_agent::Ready,
    stop: tokio_util::sync::CancellationToken,
    thread: std::thread::JoinHandle<()>,
}

impl InProcessAgent {
    /// Starts an agent with `sets` on top of defaults (metrics off, error-only logs).
    pub fn start(sets: &[String]) -> Self {
        let mut all = vec!["metrics.listen=".to_string(), "log.level=error".to_string()];
        all.extend(sets.iter().cloned());
        let cfg = kvtier_config::agent::AgentConfig::load(&kvtier_config::Sources {
            sets: all,
            ..kvtier_config::Sources::default()
        })
        .expect("benchmark agent config");
        let (ready, stop, thread) = on_own_runtime("kvtier-agent", 2, move |stop, tx| {
            kvtier_agent::run(cfg, stop, move |r| {
                let _ = tx.send(r);
            })
        });
        Self {
            ready,
            stop,
            thread,
        }
    }

    /// Stops the agent and waits for it.
    pub fn stop(self) {
        self.stop.cancel();
        let _ = self.thread.join();
    }
}
