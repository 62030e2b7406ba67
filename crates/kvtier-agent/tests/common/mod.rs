//! Test helpers: real kvtierd and kvtier-agent processes, and an "engine" (this test process)
//! with a cpu KV pool in shared memory whose pages are a pure function of their keys.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_client::{AgentClient, Inserted, Match, PoolMemory};
use kvtier_core::{DType, DevicePool, KvKind, Layout, LayoutSpec, Namespace, PageHasher, PageKey};
use kvtier_proto::v1;
use kvtier_shm::ShmRegion;

/// Runs kvtierd in this process when the test binary was re-executed as a daemon (see
/// [`daemon`]): the same `kvtier_daemon::run` the kvtierd binary calls, so these tests need no
/// binary of another package. Returns whether it did.
pub fn daemon_child() -> bool {
    let Ok(sets) = std::env::var("KVT_DAEMON_SETS") else {
        return false;
    };
    let cfg = kvtier_config::daemon::DaemonConfig::load(&kvtier_config::Sources {
        sets: sets.lines().map(str::to_string).collect(),
        ..kvtier_config::Sources::default()
    })
    .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let stop = tokio_util::sync::CancellationToken::new();
        let on_term = stop.clone();
        tokio::spawn(async move {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).unwrap();
            term.recv().await;
            on_term.cancel();
        });
        kvtier_daemon::run(cfg, stop, |r| {
            let metrics = r
                .metrics
                .map(|a| format!("http://{a}/metrics"))
                .unwrap_or_default();
            println!(
                "kvtierd ready socket={} metrics={metrics}",
                r.socket.display()
            );
        })
        .await
        .unwrap();
    });
    true
}

fn reader(out: std::process::ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

fn wait_line(rx: &mpsc::Receiver<String>, prefix: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = rx
            .recv_timeout(left)
            .unwrap_or_else(|e| panic!("no {prefix:?} line: {e}"));
        if let Some(i) = l.find(prefix) {
            return l[i..].to_string();
        }
    }
}

fn field(line: &str, key: &str) -> String {
    line.split_whitespace()
        .find_map(|f| f.strip_prefix(key))
        .unwrap()
        .to_string()
}

/// A real process, stopped with SIGTERM (or killed) on drop.
pub struct Proc {
    pub child: Child,
    pub socket: PathBuf,
    pub metrics: String,
    _lines: mpsc::Receiver<String>,
    /// Killed with SIGKILL (`kill`): its leftovers are removed on drop.
    killed: bool,
}

impl Proc {
    /// SIGKILL. A kvtierd leaves its L2 pool in its own directory in /dev/shm, as a crashed
    /// one does, for a restart to take over; what is still there when this is dropped is
    /// removed.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.killed = true;
    }

    pub fn metrics_page(&self) -> String {
        http_get(&self.metrics)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if self.killed {
            let pid = self.child.id().to_string();
            use std::os::unix::fs::MetadataExt as _;
            let uid = std::fs::metadata("/proc/self").map_or(0, |m| m.uid());
            let own = format!("/dev/shm/kvtierd-{uid}");
            for e in std::fs::read_dir(own).into_iter().flatten().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                // kvtier-<instance>-<pid>-<layout>[.slots]
                if name.starts_with("kvtier-") && name.split('-').nth(2) == Some(pid.as_str()) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while self.child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = self.child.kill();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A test's directory: one per test, removed at the start.
pub fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kvtier-agent-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Starts a kvtierd process (this test binary re-executed into [`daemon_child`]) with its
/// socket in `dir`.
pub fn daemon(dir: &Path, sets: &[&str]) -> Proc {
    let mut all = vec![
        format!("data_dir={}", dir.join("daemon").display()),
        format!("server.socket={}", dir.join("kvtierd.sock").display()),
        "metrics.listen=127.0.0.1:0".to_string(),
        "log.level=warn".to_string(),
        "server.drain_timeout=500ms".to_string(),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "daemon_entry",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("KVT_DAEMON_SETS", all.join("\n"));
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let rx = reader(child.stdout.take().unwrap());
    let ready = wait_line(&rx, "kvtierd ready");
    Proc {
        socket: PathBuf::from(field(&ready, "socket=")),
        metrics: field(&ready, "metrics="),
        child,
        _lines: rx,
        killed: false,
    }
}

/// Starts an agent named `name` pointed at the daemon socket in `dir`.
pub fn agent(dir: &Path, name: &str, sets: &[&str]) -> Proc {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kvtier-agent"));
    cmd.args(["--set", &format!("data_dir={}", dir.display())])
        .args([
            "--set",
            &format!(
                "server.socket={}",
                dir.join(format!("{name}.sock")).display()
            ),
        ])
        .args([
            "--set",
            &format!("daemon.address={}", dir.join("kvtierd.sock").display()),
        ])
        .args(["--set", &format!("daemon.name={name}")])
        .args([
            "--set",
            "daemon.reconnect_min=20ms",
            "--set",
            "daemon.reconnect_max=200ms",
        ])
        .args([
            "--set",
            "metrics.listen=127.0.0.1:0",
            "--set",
            "log.level=warn",
        ]);
    for s in sets {
        cmd.args(["--set", s]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let rx = reader(child.stdout.take().unwrap());
    let ready = wait_line(&rx, "kvtier-agent ready");
    Proc {
        socket: PathBuf::from(field(&ready, "socket=")),
        metrics: field(&ready, "metrics="),
        child,
        _lines: rx,
        killed: false,
    }
}

pub fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let hostport = url.trim_start_matches("http://");
    let (host, path) = hostport.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The value of one metric line, 0 when absent.
pub fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

pub fn mha(tp_rank: u32, tp_size: u32) -> LayoutSpec {
    LayoutSpec {
        model_id: "agent-test".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 2,
        kind: KvKind::Mha {
            kv_heads: 2,
            head_dim: 64,
        },
        page_size: 16,
        tp_rank,
        tp_size,
    }
}

pub fn mla(tp_rank: u32, tp_size: u32) -> LayoutSpec {
    LayoutSpec {
        kind: KvKind::Mla {
            kv_lora_rank: 128,
            rope_dim: 64,
        },
        ..mha(tp_rank, tp_size)
    }
}

/// Tokens of a request: `pages` full pages, a pure function of `seed`.
pub fn tokens(seed: u32, pages: usize) -> Vec<u32> {
    (0..pages as u32 * 16).map(|i| seed * 100_003 + i).collect()
}

pub fn keys(layout: &LayoutSpec, toks: &[u32]) -> Vec<PageKey> {
    PageHasher::new(layout.page_size as usize, &Namespace::default())
        .unwrap()
        .keys(toks)
}

/// The page-first bytes of the page with key `k` (what computing it would give).
pub fn page_bytes(k: &PageKey, len: usize) -> Vec<u8> {
    let mut x = u64::from_le_bytes(k.0[..8].try_into().unwrap()) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// An engine: a cpu KV pool of `pages` pages in shared memory, and an agent client.
pub struct Engine {
    pub layout: Layout,
    pub pool: DevicePool,
    pub region: ShmRegion,
    pub client: AgentClient,
}

impl Engine {
    pub async fn start(agent: &Proc, spec: LayoutSpec, pages: u64, name: &str) -> Engine {
        Self::open(agent, spec, pages, name, false).await
    }

    /// An engine that keeps its own prefix cache (the agent in engine-cache mode).
    pub async fn start_cache(agent: &Proc, spec: LayoutSpec, pages: u64, name: &str) -> Engine {
        Self::open(agent, spec, pages, name, true).await
    }

    async fn open(
        agent: &Proc,
        spec: LayoutSpec,
        pages: u64,
        name: &str,
        engine_cache: bool,
    ) -> Engine {
        let layout = Layout::new(spec.clone()).unwrap();
        let pool = DevicePool::new(layout.clone(), pages * 16).unwrap();
        let region =
            ShmRegion::memfd(&format!("kvtier-agent-test-{name}"), pool.total_bytes()).unwrap();
        let mut client = AgentClient::connect(&agent.socket.display().to_string())
            .await
            .unwrap();
        let mem = PoolMemory::Cpu {
            fd: std::sync::Arc::new(region.fd().try_clone_to_owned().unwrap()),
        };
        let info = if engine_cache {
            client.register_engine_cache(&spec, pages * 16, mem).await
        } else {
            client.register_pool(&spec, pages * 16, mem).await
        }
        .unwrap();
        assert_eq!(u64::from(info.pages), pages);
        Engine {
            layout,
            pool,
            region,
            client,
        }
    }

    /// "Computes" page `k` into device page `p`: its page-first bytes, run by run.
    pub fn compute(&self, p: u32, k: &PageKey) {
        let bytes = page_bytes(k, self.layout.page_bytes());
        for (layer, part) in self.layout.runs() {
            let run = self.pool.run(p as usize, layer, part).unwrap();
            let off = self.layout.host_run_offset(layer, part);
            self.region
                .write(
                    run.buffer * self.pool.buffer_bytes() + run.offset,
                    &bytes[off..off + run.len],
                )
                .unwrap();
        }
    }

    /// Whether device page `p` holds exactly page `k`'s bytes.
    pub fn holds(&self, p: u32, k: &PageKey) -> bool {
        let want = page_bytes(k, self.layout.page_bytes());
        self.layout.runs().all(|(layer, part)| {
            let run = self.pool.run(p as usize, layer, part).unwrap();
            let off = self.layout.host_run_offset(layer, part);
            let mut got = vec![0u8; run.len];
            self.region
                .read(run.buffer * self.pool.buffer_bytes() + run.offset, &mut got)
                .unwrap();
            got == want[off..off + run.len]
        })
    }

    /// Zeroes device page `p` (the engine reusing it).
    pub fn wipe(&self, p: u32) {
        for (layer, part) in self.layout.runs() {
            let run = self.pool.run(p as usize, layer, part).unwrap();
            self.region
                .write(
                    run.buffer * self.pool.buffer_bytes() + run.offset,
                    &vec![0u8; run.len],
                )
                .unwrap();
        }
    }

    /// Computes a request's pages into `pages` and inserts them; returns the reply.
    pub async fn prefill_and_insert(&mut self, toks: &[u32], pages: &[u32]) -> Inserted {
        let ks = keys(self.layout.spec(), toks);
        for (k, &p) in ks.iter().zip(pages) {
            self.compute(p, k);
        }
        self.client
            .insert(toks.to_vec(), None, pages.to_vec())
            .await
            .unwrap()
    }

    pub async fn do_match(&mut self, toks: &[u32]) -> Match {
        self.client.match_prefix(toks, None).await.unwrap()
    }

    pub async fn stats(&mut self) -> v1::AgentStatsResponse {
        self.client.stats().await.unwrap()
    }

    pub async fn wait_connected(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !self.stats().await.daemon_connected {
            assert!(Instant::now() < deadline, "the agent never reached kvtierd");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// How many leading `keys` are ready in L2, asked through a session of our own.
pub async fn l2_pages(socket: &Path, spec: &LayoutSpec, ks: &[PageKey]) -> usize {
    let mut c = kvtier_client::HostClient::connect(&socket.display().to_string())
        .await
        .unwrap();
    let s = c.register("observer", spec).await.unwrap();
    let n = c.lookup(s.id, ks).await.unwrap();
    c.close(s.id).await.unwrap();
    n
}

/// Polls until L2 holds `n` leading pages of `ks` (or fails after 20 s).
pub async fn wait_l2(socket: &Path, spec: &LayoutSpec, ks: &[PageKey], n: usize) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = l2_pages(socket, spec, ks).await;
        if got == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "L2 holds {got} pages, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}
