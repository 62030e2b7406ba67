//! The real kvtierctl binary against a live kvtierd. `watch` draws views of the daemon's
//! metrics stream, stops on Ctrl-C (SIGINT) with success, and fails with a clear message when
//! the daemon goes away; `clear`, `drain` and `flush` run as an operator types them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::DaemonConfig;
use tokio_util::sync::CancellationToken;

/// A kvtierd running in this process (real sockets), stopped by cancelling its token.
struct Daemon {
    socket: PathBuf,
    stop: CancellationToken,
    thread: Option<std::thread::JoinHandle<()>>,
    dir: PathBuf,
}

impl Daemon {
    fn start(name: &str) -> Daemon {
        Self::start_with(name, "memory")
    }

    /// A daemon whose L3 is `l3` (`none`: no L3, so no L3 events either).
    fn start_with(name: &str, l3: &str) -> Daemon {
        let dir =
            std::env::temp_dir().join(format!("kvtierctl-watch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cfg = DaemonConfig::default()
            .with_overrides(&[
                format!("data_dir={}", dir.display()),
                "metrics.listen=".into(),
                format!("l3.backend={l3}"),
                "l2.pool_bytes=8MiB".into(),
            ])
            .unwrap();
        let stop = CancellationToken::new();
        let (tx, rx) = mpsc::channel();
        let token = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(kvtier_daemon::run(cfg, token, move |r| {
                tx.send(r.socket).unwrap();
            }))
            .unwrap();
        });
        let socket = rx.recv_timeout(Duration::from_secs(20)).unwrap();
        Daemon {
            socket,
            stop,
            thread: Some(thread),
            dir,
        }
    }

    fn shut_down(&mut self) {
        self.stop.cancel();
        if let Some(t) = self.thread.take() {
            t.join().unwrap();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.shut_down();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn watch(socket: &std::path::Path) -> (Child, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvtierctl"))
        .args(["watch", "--interval-ms", "150", "--socket"])
        .arg(socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (tx, rx) = mpsc::channel();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    (child, rx)
}

/// Reads views until `n` of them have been drawn; returns the lines of the last one.
fn views(rx: &mpsc::Receiver<String>, n: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut seen = 0;
    let mut current = Vec::new();
    while seen < n {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("kvtierctl watch drew no view");
        if line.starts_with("kvtierd at ") {
            seen += 1;
            current.clear();
        }
        current.push(line);
    }
    // The rest of the last view.
    while let Ok(line) = rx.recv_timeout(Duration::from_millis(100)) {
        if line.starts_with("kvtierd at ") {
            break;
        }
        current.push(line);
    }
    current
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            return st;
        }
        assert!(Instant::now() < deadline, "kvtierctl watch did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn watch_shows_a_live_daemon_and_stops_on_ctrl_c() {
    let d = Daemon::start("live");
    let (mut child, rx) = watch(&d.socket);
    let view = views(&rx, 3).join("\n");
    for part in [
        "L2 ",
        "lookups",
        "prefetch",
        "backup",
        "L3 ",
        "breaker closed",
    ] {
        assert!(view.contains(part), "no {part:?} in:\n{view}");
    }
    // After the first view, figures are rates.
    assert!(view.contains("/s"), "{view}");
    let st = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let st = wait_exit(&mut child, Duration::from_secs(5));
    assert!(st.success(), "Ctrl-C should end watch cleanly: {st:?}");
}

#[test]
fn watch_exits_with_a_message_when_the_daemon_goes_away() {
    let mut d = Daemon::start("gone");
    let (mut child, rx) = watch(&d.socket);
    views(&rx, 2);
    d.shut_down();
    let st = wait_exit(&mut child, Duration::from_secs(10));
    assert_eq!(st.code(), Some(1), "{st:?}");
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("went away"), "{err}");
}

#[test]
fn watch_refuses_a_bad_interval_and_a_missing_daemon() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierctl"))
        .args(["watch", "--socket", "/nonexistent/kvtierd.sock"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/kvtierd.sock"), "{err}");
    let d = Daemon::start("bad");
    let out = Command::new(env!("CARGO_BIN_EXE_kvtierctl"))
        .args(["watch", "--interval-ms", "5", "--socket"])
        .arg(&d.socket)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("interval_ms"), "{err}");
}

/// The real binary: a clear with stdin not a terminal and no `--yes` is refused before
/// anything is removed; with `--yes` it clears; `drain --status` and `--cancel` report.
#[test]
fn clear_needs_a_terminal_or_yes_and_drain_reports() {
    let d = Daemon::start("clear");
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvtierctl"))
            .args(args)
            .arg("--socket")
            .arg(&d.socket)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, _, err) = run(&["clear", "l2"]);
    assert!(!ok);
    assert!(err.contains("pass --yes"), "{err}");
    let (ok, out, _) = run(&["clear", "l2", "--dry-run"]);
    assert!(ok && out.starts_with("This removes 0 pages"), "{out}");
    let (ok, out, err) = run(&["clear", "l2", "--yes"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("cleared l2: 0 pages removed"), "{out}");
    let (ok, out, err) = run(&["clear", "l3", "--yes"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("cleared l3: "), "{out}");
    let (ok, out, _) = run(&["drain", "--status"]);
    assert!(ok && out.starts_with("not draining"), "{out}");
    let (ok, out, err) = run(&["drain", "--wait-secs", "10"]);
    assert!(ok, "{err}");
    assert!(out.starts_with("drained: safe to stop"), "{out}");
    let (ok, out, _) = run(&["drain", "--cancel"]);
    assert!(ok && out.contains("cancelled"), "{out}");
    let (ok, out, err) = run(&["flush", "--wait-secs", "5"]);
    assert!(ok, "{err}");
    assert_eq!(out, "flushed: 0 pages are in L3\n");
    let (ok, _, err) = run(&["flush", "--wait-secs", "0"]);
    assert!(!ok && err.contains("wait-secs"), "{err}");
}

#[test]
fn events_prints_a_snapshot_of_l2_then_what_it_gains() {
    use kvtier_core::{DType, KvKind, LayoutSpec, Namespace, PageHasher};
    // Without L3: its STORED events land whenever the write-through does, possibly after
    // the snapshot below, and would come first on the resumed stream.
    let d = Daemon::start_with("events", "none");
    let socket = d.socket.display().to_string();
    let spec = LayoutSpec {
        model_id: "ctl-events".into(),
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
    };
    let tokens: Vec<u32> = (0..48).collect();
    let keys = PageHasher::new(16, &Namespace::default())
        .unwrap()
        .keys(&tokens);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let store = |keys: Vec<kvtier_core::PageKey>, parent: Option<kvtier_core::PageKey>| {
        let socket = socket.clone();
        let spec = spec.clone();
        rt.block_on(async move {
            let mut c = kvtier_client::HostClient::connect(&socket).await.unwrap();
            let s = c.register("ctl-events", &spec).await.unwrap();
            let page = vec![7u8; s.layout.page_bytes()];
            let pool = &s.pool;
            let r = c
                .store_pages(
                    s.id,
                    parent.as_ref(),
                    &keys,
                    Duration::from_secs(10),
                    |mine| async move {
                        for (_, slot) in mine {
                            pool.write(slot, 0, &page).map_err(|e| e.to_string())?;
                        }
                        Ok::<_, String>(())
                    },
                )
                .await
                .unwrap();
            assert_eq!(r.held, keys.len());
        });
    };
    store(keys[..2].to_vec(), None);
    // The snapshot: the stream's header, a resync, the two pages (the second after the first).
    let args = |count| kvtier_ctl::events::EventsArgs {
        socket: socket.clone(),
        after: None,
        count,
    };
    let mut out = Vec::new();
    kvtier_ctl::events::events(&args(3), &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(
        lines[0].starts_with("node ") && lines[0].contains("--after"),
        "{text}"
    );
    assert!(lines[1].contains("resync"), "{text}");
    let hex = |k: &kvtier_core::PageKey| k.to_hex()[..16].to_string();
    assert!(
        lines[2].contains("stored") && lines[2].contains(&hex(&keys[0])),
        "{text}"
    );
    assert!(
        lines[3].ends_with(&format!("{} after {}", hex(&keys[1]), hex(&keys[0]))),
        "{text}"
    );
    // Resuming after the snapshot's resync shows only what came later.
    let (stream, seq) = {
        let l = lines[0];
        let id: u64 = l.split_whitespace().nth(3).unwrap().parse().unwrap();
        let seq: u64 = lines[1].split_whitespace().next().unwrap().parse().unwrap();
        (id, seq)
    };
    store(keys[2..].to_vec(), Some(keys[1]));
    let mut out = Vec::new();
    let resume = kvtier_ctl::events::EventsArgs {
        after: Some((stream, seq)),
        ..args(1)
    };
    kvtier_ctl::events::events(&resume, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.lines().nth(1).unwrap().contains(&hex(&keys[2])),
        "{text}"
    );
}
