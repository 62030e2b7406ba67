//! Test helpers: a real kvtierd process, child client processes, deterministic pages.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_core::{DType, KvKind, LayoutSpec, Namespace, PageHasher, PageKey};

/// A kvtierd process on a private socket and data directory, stopped (SIGTERM) on drop.
pub struct Daemon {
    pub child: Child,
    pub dir: PathBuf,
    pub socket: PathBuf,
    pub metrics_url: String,
    /// `host:port` of the TCP listener, empty when off.
    pub tcp: String,
    stdout_lines: mpsc::Receiver<String>,
}

fn reader(stdout: ChildStdout) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a stdout line containing `prefix` and returns it from there (a child test
/// process prints after the harness's "test child_entry ... " on the same line).
pub fn wait_line(rx: &mpsc::Receiver<String>, prefix: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(l) => {
                if let Some(i) = l.find(prefix) {
                    return l[i..].to_string();
                }
            }
            Err(e) => panic!("no line starting with {prefix:?} within {timeout:?}: {e}"),
        }
    }
}

impl Daemon {
    pub fn start(name: &str, sets: &[&str]) -> Daemon {
        let dir = std::env::temp_dir().join(format!("kvtierd-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self::start_in(dir, sets)
    }

    /// Starts a daemon on an existing data directory (to test restarts).
    pub fn start_in(dir: PathBuf, sets: &[&str]) -> Daemon {
        Self::start_under(dir, &[], sets)
    }

    /// [`Daemon::start_in`], run by `wrapper` (a command and its arguments, e.g. `prlimit`
    /// with limits, ending in `--`) when it is not empty.
    pub fn start_under(dir: PathBuf, wrapper: &[&str], sets: &[&str]) -> Daemon {
        std::fs::create_dir_all(&dir).unwrap();
        let mut cmd = match wrapper {
            [] => Command::new(env!("CARGO_BIN_EXE_kvtierd")),
            [w, args @ ..] => {
                let mut c = Command::new(w);
                c.args(args).arg(env!("CARGO_BIN_EXE_kvtierd"));
                c
            }
        };
        // A config file a test put in the directory (for what only files set: [tenants]).
        let file = dir.join("kvtierd.toml");
        if file.exists() {
            cmd.arg("--config").arg(&file);
        }
        cmd.arg("--set")
            .arg(format!("data_dir={}", dir.display()))
            .args(["--set", "metrics.listen=127.0.0.1:0"])
            .args(["--set", "log.level=warn"]);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("kvtierd starts");
        let rx = reader(child.stdout.take().unwrap());
        let ready = wait_line(&rx, "kvtierd ready", Duration::from_secs(20));
        let field = |k: &str| {
            ready
                .split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .unwrap()
                .to_string()
        };
        Daemon {
            socket: PathBuf::from(field("socket=")),
            metrics_url: field("metrics="),
            tcp: field("tcp="),
            dir,
            child,
            stdout_lines: rx,
        }
    }

    pub fn target(&self) -> String {
        self.socket.display().to_string()
    }

    /// The metrics page.
    /// The daemon's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn metrics(&self) -> String {
        http_get(&self.metrics_url)
    }

    /// Stops the daemon with SIGTERM and waits; returns whether it exited cleanly.
    pub fn stop(&mut self) -> bool {
        signal(self.child.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.success();
            }
            assert!(Instant::now() < deadline, "kvtierd did not stop on SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Daemon {
    /// Stops the daemon with SIGTERM, asserts it exited cleanly, and keeps its data
    /// directory.
    pub fn stop_keeping_dir(mut self) -> PathBuf {
        assert!(self.stop(), "kvtierd did not exit cleanly");
        let dir = std::mem::take(&mut self.dir);
        std::mem::forget(self);
        dir
    }

    /// Kills the daemon with SIGKILL (no cleanup) and keeps its data directory.
    pub fn kill(mut self) -> PathBuf {
        signal(self.child.id(), libc::SIGKILL);
        self.child.wait().unwrap();
        let dir = std::mem::take(&mut self.dir);
        std::mem::forget(self);
        dir
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            self.stop();
        }
        if !self.dir.as_os_str().is_empty() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Object files under the file backend's directory (temp files of writes in flight left
/// out).
pub fn l3_files(dir: &Path) -> usize {
    fn walk(p: &Path) -> usize {
        std::fs::read_dir(p)
            .map(|rd| {
                rd.flatten()
                    .map(|e| {
                        if e.path().is_dir() {
                            walk(&e.path())
                        } else {
                            usize::from(!e.file_name().to_string_lossy().starts_with('.'))
                        }
                    })
                    .sum()
            })
            .unwrap_or(0)
    }
    walk(&dir.join("l3/objects"))
}

/// A single-threaded runtime for a test's client side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

pub fn signal(pid: u32, sig: i32) {
    let status = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
}

/// A minimal HTTP/1.0 GET for the metrics endpoint.
pub fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap();
    let (host, path) = rest.split_once('/').unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The value of one metric line (`name{labels} value`), 0 when absent.
pub fn metric(page: &str, series: &str) -> f64 {
    page.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0.0)
}

/// Polls `f` until it returns true, failing after `timeout`.
pub fn eventually(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A small MHA layout: 2 layers, 2 KV heads of 64, bf16, 16-token pages (16 KiB pages).
pub fn layout(model: &str) -> LayoutSpec {
    LayoutSpec {
        model_id: model.to_string(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: 2,
        kind: KvKind::Mha {
            kv_heads: 2,
            head_dim: 64,
        },
        page_size: 16,
        tp_rank: 0,
        tp_size: 1,
    }
}

/// Keys of `pages` pages of a sequence identified by `seed`.
pub fn chain(seed: u32, pages: usize) -> Vec<PageKey> {
    let tokens: Vec<u32> = (0..pages as u32 * 16)
        .map(|i| seed * 1_000_003 + i)
        .collect();
    PageHasher::new(16, &Namespace::default())
        .unwrap()
        .keys(&tokens)
}

/// The bytes of the page with key `k`: a pure function of the key.
pub fn page_bytes(k: &PageKey, len: usize) -> Vec<u8> {
    seeded_bytes(u64::from_le_bytes(k.0[..8].try_into().unwrap()), len)
}

/// `len` pseudo-random bytes, a pure function of `seed` (xorshift64).
pub fn seeded_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Runs this test binary again as a child process in role `role` (see `child_entry`).
pub fn spawn_child(
    role: &str,
    socket: &Path,
    extra: &[(&str, String)],
) -> (Child, mpsc::Receiver<String>) {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "child_entry",
        "--exact",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("KVT_CHILD_ROLE", role)
    .env("KVT_CHILD_SOCKET", socket)
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let rx = reader(child.stdout.take().unwrap());
    (child, rx)
}

/// The keys `reserve` handed slots to.
pub fn reserved(keys: &[PageKey], r: &[kvtier_client::Reserved]) -> Vec<PageKey> {
    keys.iter()
        .zip(r)
        .filter(|(_, r)| matches!(r, kvtier_client::Reserved::Slot(_)))
        .map(|(k, _)| *k)
        .collect()
}

/// Writes `keys` as a client does, through the client's page protocol (reserve, copy each
/// page into its slot, commit), and when the pool has no room for all of them (pages not yet
/// in L3 leave only once written; past the dirty limit writers wait), goes on from where it
/// got once room comes back, up to 20 s. Returns every page's bytes, written or present.
pub async fn store(
    c: &mut kvtier_client::HostClient,
    s: &kvtier_client::Session,
    keys: &[PageKey],
) -> Vec<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let page = s.layout.page_bytes();
    let mut done = 0;
    while done < keys.len() {
        let rest = &keys[done..];
        let parent = done.checked_sub(1).map(|i| &keys[i]);
        let r = c
            .store_pages(
                s.id,
                parent,
                rest,
                Duration::from_secs(10),
                |mine| async move {
                    for (i, slot) in mine {
                        s.pool.write(slot, 0, &page_bytes(&rest[i], page))?;
                    }
                    Ok::<_, kvtier_shm::ShmError>(())
                },
            )
            .await
            .unwrap();
        done += r.held;
        if r.held == 0 {
            assert!(Instant::now() < deadline, "the pool never made room");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    keys.iter().map(|k| page_bytes(k, page)).collect()
}

/// The uid (and gid) of `nobody`, the other local user of the attack tests.
pub const NOBODY: u32 = 65534;

/// Whether this process may start others under another uid (CI runs as root).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// Runs this test binary's `child_entry` as `nobody` (uid and gid 65534, no other groups,
/// through util-linux's `setpriv`) with `env`, and returns what it printed after `RESULT `.
pub fn as_nobody(env: &[(&str, &str)]) -> String {
    as_user(NOBODY, &[], env)
}

/// [`as_nobody`] as `uid` (its gid the same number) with supplementary `groups`.
pub fn as_user(uid: u32, groups: &[u32], env: &[(&str, &str)]) -> String {
    let id = uid.to_string();
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid", &id, "--regid", &id]);
    match groups {
        [] => cmd.arg("--clear-groups"),
        g => cmd.args([
            "--groups",
            &g.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
        ]),
    };
    let out = cmd
        .arg(std::env::current_exe().unwrap())
        .args([
            "child_entry",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .output()
        .expect("setpriv (util-linux) runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .find_map(|l| l.split_once("RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("the child printed no result: {stdout}"))
        .to_string()
}

/// Client settings that present bearer token `t` (over TCP or the Unix socket).
pub fn token(t: &str) -> kvtier_client::TcpSecurity {
    kvtier_client::TcpSecurity {
        token: Some(t.to_string()),
        ..kvtier_client::TcpSecurity::default()
    }
}
