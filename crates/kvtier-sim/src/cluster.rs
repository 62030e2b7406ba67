//! The kvtier processes a simulation drives: a kvtierd and one kvtier-agent per worker, either
//! started here (child processes of this very binary, re-executed into a server role, in a
//! temp directory) or already running (attach by socket).
//!
//! Children are real processes, so the chaos options can SIGKILL them and start them again on
//! the same sockets and data directory.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Environment variable naming the role of a re-executed child (`daemon` or `agent`).
pub const ROLE_ENV: &str = "KVTIER_SIM_ROLE";
/// Environment variable with the child's `section.key=value` settings, one per line.
pub const SETS_ENV: &str = "KVTIER_SIM_SETS";

/// How to start this program again as a child server: the executable and the arguments that
/// lead to [`serve_child_from_env`] (none for the kvtier-sim binary; a test binary passes the
/// name of its entry test).
#[derive(Clone, Debug)]
pub struct Launcher {
    /// The executable.
    pub program: PathBuf,
    /// Arguments before nothing else: the child reads its role from the environment.
    pub args: Vec<String>,
}

impl Launcher {
    /// This executable, with no arguments.
    pub fn this_binary() -> Result<Self> {
        Ok(Self {
            program: std::env::current_exe().context("locating this executable")?,
            args: Vec::new(),
        })
    }
}

/// If this process was started as a child server ([`ROLE_ENV`] set), runs it until SIGTERM and
/// returns `true`; otherwise returns `false` at once.
pub fn serve_child_from_env() -> bool {
    let Ok(role) = std::env::var(ROLE_ENV) else {
        return false;
    };
    let sets: Vec<String> = std::env::var(SETS_ENV)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvtier-sim child: runtime: {e}");
            std::process::exit(2);
        }
    };
    let who = role.clone();
    let result: Result<()> = rt.block_on(async move {
        let stop = tokio_util::sync::CancellationToken::new();
        let on_term = stop.clone();
        tokio::spawn(async move {
            if let Ok(mut term) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            {
                term.recv().await;
            }
            on_term.cancel();
        });
        let src = kvtier_config::Sources {
            sets,
            ..kvtier_config::Sources::default()
        };
        match role.as_str() {
            "daemon" => {
                let cfg = kvtier_config::daemon::DaemonConfig::load(&src)?;
                // Warnings and errors of the children reach the simulation's stderr.
                let _ = kvtier_server::serving::init_logging(&cfg.log.level);
                kvtier_daemon::run(cfg, stop, |r| {
                    let m = r.metrics.map(|a| a.to_string()).unwrap_or_default();
                    println!("ready socket={} metrics={m}", r.socket.display());
                })
                .await?;
            }
            "agent" => {
                let cfg = kvtier_config::agent::AgentConfig::load(&src)?;
                let _ = kvtier_server::serving::init_logging(&cfg.log.level);
                kvtier_agent::run(cfg, stop, |r| {
                    let m = r.metrics.map(|a| a.to_string()).unwrap_or_default();
                    println!("ready socket={} metrics={m}", r.socket.display());
                })
                .await?;
            }
            other => bail!("unknown role {other:?}"),
        }
        Ok(())
    });
    if let Err(e) = result {
        eprintln!("kvtier-sim {who}: {e:#}");
        std::process::exit(1);
    }
    true
}

/// A child server.
#[derive(Debug)]
pub struct Server {
    child: Child,
    role: &'static str,
    sets: Vec<String>,
    /// Its socket.
    pub socket: PathBuf,
    /// Its metrics address (`host:port`), empty when off.
    pub metrics: String,
}

impl Server {
    fn start(launcher: &Launcher, role: &'static str, sets: &[String]) -> Result<Self> {
        let mut child = Command::new(&launcher.program)
            .args(&launcher.args)
            .env(ROLE_ENV, role)
            .env(SETS_ENV, sets.join("\n"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting the {role}"))?;
        let out = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if let Some(i) = line.find("ready socket=") {
                    let _ = tx.send(line[i..].to_string());
                }
            }
        });
        // Ready, exited (its error is on stderr, above), or still neither after 60 s.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let line = loop {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(l) => break l,
                Err(mpsc::RecvTimeoutError::Disconnected)
                | Err(mpsc::RecvTimeoutError::Timeout)
                    if child.try_wait().ok().flatten().is_some() =>
                {
                    let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                    bail!("the {role} exited before it was ready ({status}); its error is above");
                }
                Err(_) if std::time::Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    bail!("the {role} did not start within 60 s");
                }
                Err(_) => {}
            }
        };
        let field = |k: &str| {
            line.split_whitespace()
                .find_map(|f| f.strip_prefix(k))
                .unwrap_or_default()
                .to_string()
        };
        Ok(Self {
            socket: PathBuf::from(field("socket=")),
            metrics: field("metrics="),
            child,
            role,
            sets: sets.to_vec(),
        })
    }

    /// Sends it `signal` (as `kill` takes it: `-STOP`, `-CONT`).
    pub fn signal(&self, signal: &str) {
        let _ = Command::new("kill")
            .args([signal, &self.child.id().to_string()])
            .status();
    }

    /// SIGKILLs it (no cleanup, as a crash would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again with the same settings (same socket and data directory).
    pub fn restart(&mut self, launcher: &Launcher) -> Result<()> {
        self.kill();
        *self = Self::start(launcher, self.role, &self.sets)?;
        Ok(())
    }

    /// Stops it as an operator would (SIGTERM, SIGKILL after 10 s): kvtierd releases its
    /// pool, so a later start begins empty.
    pub fn stop(&mut self) {
        if self.child.try_wait().ok().flatten().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        for _ in 0..500 {
            if self.child.try_wait().ok().flatten().is_some() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What an embedded cluster looks like.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    /// Agents (one per worker).
    pub workers: usize,
    /// kvtierd settings on top of the directory ones.
    pub daemon_sets: Vec<String>,
    /// kvtier-agent settings on top of the directory ones.
    pub agent_sets: Vec<String>,
}

/// A kvtierd and its agents, started here, in a temp directory removed at drop.
#[derive(Debug)]
pub struct Cluster {
    launcher: Launcher,
    dir: PathBuf,
    /// The daemon.
    pub daemon: Server,
    /// The agents, one per worker.
    pub agents: Vec<Server>,
}

impl Cluster {
    /// Starts the daemon, then the agents.
    pub fn start(launcher: Launcher, spec: &ClusterSpec, id: &str) -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("kvtier-sim-{id}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let daemon_sock = dir.join("kvtierd.sock");
        let mut daemon_sets = vec![
            format!("data_dir={}", dir.join("kvtierd").display()),
            format!("server.socket={}", daemon_sock.display()),
            "metrics.listen=127.0.0.1:0".to_string(),
            "log.level=warn".to_string(),
            "server.drain_timeout=500ms".to_string(),
        ];
        daemon_sets.extend(spec.daemon_sets.iter().cloned());
        let started = Self::start_in(&launcher, spec, &dir, &daemon_sock, &daemon_sets);
        match started {
            Ok((daemon, agents)) => Ok(Self {
                launcher,
                dir,
                daemon,
                agents,
            }),
            Err(e) => {
                // (What did start stopped when dropped above.)
                let _ = std::fs::remove_dir_all(&dir);
                Err(e)
            }
        }
    }

    /// The daemon, then the agents, in `dir`.
    fn start_in(
        launcher: &Launcher,
        spec: &ClusterSpec,
        dir: &Path,
        daemon_sock: &Path,
        daemon_sets: &[String],
    ) -> Result<(Server, Vec<Server>)> {
        let daemon = Server::start(launcher, "daemon", daemon_sets)?;
        let mut agents = Vec::new();
        for i in 0..spec.workers {
            let mut sets = vec![
                format!("data_dir={}", dir.display()),
                format!(
                    "server.socket={}",
                    dir.join(format!("agent-{i}.sock")).display()
                ),
                format!("daemon.address={}", daemon_sock.display()),
                format!("daemon.name=sim-worker-{i}"),
                "daemon.reconnect_min=20ms".to_string(),
                "daemon.reconnect_max=500ms".to_string(),
                "metrics.listen=127.0.0.1:0".to_string(),
                "log.level=warn".to_string(),
                "server.drain_timeout=200ms".to_string(),
            ];
            sets.extend(spec.agent_sets.iter().cloned());
            agents.push(Server::start(launcher, "agent", &sets)?);
        }
        Ok((daemon, agents))
    }

    /// The launcher children are started with.
    pub fn launcher(&self) -> &Launcher {
        &self.launcher
    }

    /// Where the cluster keeps its files (engine pools go in /dev/shm, not here).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for a in &mut self.agents {
            a.stop();
        }
        self.daemon.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
