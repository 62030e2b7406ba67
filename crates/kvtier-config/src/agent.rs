//! `kvtier-agent.toml`: the per-worker agent's configuration.

use std::path::PathBuf;
use std::time::Duration;

use kvtier_core::{PolicyKind, WritePolicy};
use serde::{Deserialize, Serialize};

use crate::unix::UnixAccess;
use crate::{ConfigError, Dur, Env, Sources};

/// The complete, commented default configuration. `kvtier-agent --print-default-config`
/// prints it, `deploy/kvtier-agent.toml` is a copy, and a test checks it parses to
/// [`AgentConfig::default`].
pub const DEFAULT_TOML: &str = concat!(
    r#"# kvtier-agent configuration (one agent per inference worker).
#
# Every key is optional: the value shown is the default. Layering, lowest to highest:
# these defaults < this file < KVTIER_AGENT_<SECTION>_<KEY> environment variables
# (KVTIER_AGENT_<KEY> for top-level keys, e.g. KVTIER_AGENT_CACHE_WRITE_POLICY=write_back) <
# `--set section.key=value` flags. Durations take ms, s, m, h.

# Directory for the engine socket. Relative paths are relative to the directory the agent
# starts in.
data_dir = "kvtier-data"

[server]
# Unix domain socket the engine talks to (kvtier.v1.Agent). Empty: <data_dir>/kvtier-agent.sock.
socket = ""
# Unix domain socket where an engine hands the agent its CPU pool's memory, as file
# descriptors (the agent opens no path a client names). Empty: the engine socket's path with
# ".memory" appended. Clients find it in AgentStats.
memory_socket = ""
# Most tokens in one request (1 to 16777216).
max_tokens = 1048576
# On shutdown, how long open engine connections, and then the agent's tasks still running
# (backups under way, calls finishing their copies), get to finish, in all (10ms to 10m).
drain_timeout = "2s"
# The registered pool belongs to the client that registered it; another client's
# registration is refused while the owner's process lives. When the owner's pid is not
# visible (another pid namespace, TCP), it keeps the pool as long as it calls at least this
# often (1s to 1h).
pool_lease = "5m"
"#,
    crate::unix_default_toml!(),
    crate::connections_default_toml!(),
    r#"
[daemon]
# The node's kvtierd (L2 and L3): its socket path, or http://host:port. Empty:
# <data_dir>/kvtierd.sock. While it is unreachable the agent serves from L1 alone.
address = ""
# Name this worker registers with (shown by `kvtierctl status`).
name = "kvtier-agent"
# Reconnection backoff: first wait, doubling up to the maximum (10ms to 10m).
reconnect_min = "100ms"
reconnect_max = "5s"
# Deadline of each call to kvtierd (1ms to 10m). A call that misses it is a miss.
timeout = "5s"

[cache]
# Which unlocked device page to evict first: lru, lfu, fifo, mru, filo, priority, slru.
eviction_policy = "lru"
# When device pages are backed up to the host tier (L2). Under every policy a page is in L2
# before Evict hands its device page back to the engine: Evict backs it up first, or waits
# for the backup in flight. Only when L2 refuses it (kvtierd unreachable, its pool full of
# pinned pages past evict_wait, a failed copy) is a page given up, counted by reason in
# kvtier_agent_lost_pages_total. The policies differ in how early the backup starts:
#   write_through           every inserted page, at once (asynchronously);
#   write_through_selective pages whose hit count reaches write_threshold, the rest on
#                           eviction;
#   write_back              only pages being evicted.
write_policy = "write_through"
# Hits at which write_through_selective backs a page up early (1 to 1000000).
write_threshold = 2
# Early backups in flight at once (1 to 256).
backup_concurrency = 4
# Pages early backups may have queued or running (1 to 1048576). When it is full, the Insert
# (or Match) that starts a backup waits for room: engines slow to what reaches L2 rather than
# run ahead of it. Only after evict_wait without progress is the backup left to the page's
# eviction (counted as deferred); it is never dropped. Pages queued here are on this device
# only: other workers find them once they reach L2, so a longer queue delays sharing. Under
# a concurrent replay at full speed (kvtier-sim, 4 workers) 256 kept 0.99 of the reuse
# that finished requests offered, 1024 about 0.98 and 4096 0.89, at the same throughput.
backup_queue = 256
# How long backups wait for room in L2 (full of pinned pages, or of pages not yet written to
# L3) without any progress before an Evict gives their pages up, counted as lost
# (0s to 10m). As long as L2 makes progress they wait on: slow storage is backpressure.
evict_wait = "5s"
# How long a backup of a page still on the device (an early backup, or an Evict's backup of
# its victims) waits for a kvtierd that went away to come back (a restart: its successor
# takes the pool over) before the page is given up, counted as lost (daemon_unreachable)
# (0s to 10m). Saves of engine-cache mode wait evict_wait: their engine waits for them.
daemon_wait = "60s"

[device]
# Threads that share one batch of cpu-device copies (1 to 64).
copy_threads = 4
# How a cuda device moves pages between the GPU and kvtierd's pool: auto (the fastest
# method that passes its start-up self-check), batch (cuMemcpyBatchAsync, driver 12.8+),
# kernel (a gather/scatter kernel over the mapped host pool) or per_run (one cuMemcpyAsync
# per contiguous run). A named method that fails its self-check gives way to the fastest
# that passed, logged and shown in kvtier_agent_copy_method.
copy_method = "auto"

[metrics]
# Address of the Prometheus text endpoint (GET /metrics). Port 0 picks a free port.
# Empty: off.
listen = "127.0.0.1:9465"

[log]
# Log filter, as RUST_LOG: error, warn, info, debug, trace, or per-module directives.
level = "info"
"#
);

/// The agent's configuration, as read. Use [`AgentConfig::load`]; it validates.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// Directory for the socket.
    pub data_dir: PathBuf,
    /// The engine-facing server.
    pub server: AgentServerConfig,
    /// The link to kvtierd.
    pub daemon: DaemonLinkConfig,
    /// The prefix cache and write policy.
    pub cache: CacheConfig,
    /// Device copies.
    pub device: DeviceConfig,
    /// Prometheus endpoint.
    pub metrics: AgentMetricsConfig,
    /// Logging.
    pub log: AgentLogConfig,
}

/// `[server]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentServerConfig {
    /// UDS path; unset means `<data_dir>/kvtier-agent.sock`.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub socket: Option<PathBuf>,
    /// The memory door's UDS path (engines deposit their pool's descriptors there); unset
    /// means the engine socket's path with `.memory` appended.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub memory_socket: Option<PathBuf>,
    /// Most tokens per request.
    pub max_tokens: u64,
    /// Grace period at shutdown for open connections, then for the tasks still running.
    pub drain_timeout: Dur,
    /// How long an owner whose process is not visible keeps the pool without a call.
    pub pool_lease: Dur,
    /// Who may use the engine socket.
    pub unix: UnixAccess,
    /// How many connections the engine socket holds, and how long one has to start.
    pub connections: crate::connections::ConnectionLimits,
}

/// `[daemon]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonLinkConfig {
    /// kvtierd's socket or URL; unset means `<data_dir>/kvtierd.sock`.
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        skip_serializing_if = "Option::is_none"
    )]
    pub address: Option<String>,
    /// Session name.
    pub name: String,
    /// First reconnection wait.
    pub reconnect_min: Dur,
    /// Longest reconnection wait.
    pub reconnect_max: Dur,
    /// Per-call deadline.
    pub timeout: Dur,
}

/// `[cache]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// Eviction policy name.
    pub eviction_policy: PolicyKind,
    /// When pages are backed up (the threshold is applied by [`AgentConfig::write_policy`]).
    pub write_policy: WritePolicy,
    /// Hits at which `write_through_selective` backs up.
    pub write_threshold: u64,
    /// Early backups in flight.
    pub backup_concurrency: u32,
    /// Pages of early backups queued or running; more wait.
    pub backup_queue: u32,
    /// How long backups wait for room in L2 without progress.
    pub evict_wait: Dur,
    /// How long tree-mode backups wait for kvtierd to come back.
    pub daemon_wait: Dur,
}

/// `[device]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceConfig {
    /// Threads per cpu copy batch.
    pub copy_threads: u32,
    /// How the cuda device moves pages: `auto`, `batch`, `kernel` or `per_run`.
    pub copy_method: kvtier_core::CopyMethod,
}

/// `[metrics]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentMetricsConfig {
    /// Listen address; unset disables the endpoint (written `""`, so a configuration
    /// written out and read again keeps it off: the default is on).
    #[serde(
        deserialize_with = "crate::units::empty_is_none",
        serialize_with = "crate::units::none_as_empty"
    )]
    pub listen: Option<String>,
}

/// `[log]`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct AgentLogConfig {
    /// Filter directives.
    pub level: String,
}

crate::defaults_from_file!(defaults, AgentConfig, DEFAULT_TOML);

impl Default for AgentConfig {
    /// The commented default file ([`DEFAULT_TOML`]), the one place defaults are written.
    fn default() -> Self {
        defaults().clone()
    }
}

crate::default_from_parent!(
    defaults,
    AgentServerConfig => server,
    DaemonLinkConfig => daemon,
    CacheConfig => cache,
    DeviceConfig => device,
    AgentMetricsConfig => metrics,
    AgentLogConfig => log,
);

impl AgentConfig {
    /// Loads from the given sources (`KVTIER_AGENT_*` variables) and validates.
    pub fn load(src: &Sources) -> Result<Self, ConfigError> {
        let cfg: Self = crate::load_env(DEFAULT_TOML, src, Env::Agent)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The engine socket path.
    pub fn socket_path(&self) -> PathBuf {
        (self.server.socket.clone()).unwrap_or_else(|| self.data_dir.join("kvtier-agent.sock"))
    }

    /// The memory door: where an engine deposits its CPU pool's descriptors.
    pub fn memory_socket(&self) -> PathBuf {
        self.server.memory_socket.clone().unwrap_or_else(|| {
            let mut p = self.socket_path().into_os_string();
            p.push(".memory");
            PathBuf::from(p)
        })
    }

    /// kvtierd's address.
    pub fn daemon_address(&self) -> String {
        (self.daemon.address.clone())
            .unwrap_or_else(|| self.data_dir.join("kvtierd.sock").display().to_string())
    }

    /// The device → L2 write policy, with its threshold.
    pub fn write_policy(&self) -> WritePolicy {
        self.cache
            .write_policy
            .with_threshold(self.cache.write_threshold)
    }

    /// Checks every key's bounds; errors name the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let Self {
            data_dir,
            server:
                AgentServerConfig {
                    socket: _,
                    memory_socket: _,
                    max_tokens,
                    drain_timeout,
                    pool_lease,
                    unix,
                    connections,
                },
            daemon:
                DaemonLinkConfig {
                    address: _,
                    name,
                    reconnect_min,
                    reconnect_max,
                    timeout,
                },
            cache:
                CacheConfig {
                    eviction_policy: _,
                    write_policy: _,
                    write_threshold,
                    backup_concurrency,
                    backup_queue,
                    evict_wait,
                    daemon_wait,
                },
            device:
                DeviceConfig {
                    copy_threads,
                    copy_method: _,
                },
            metrics: AgentMetricsConfig { listen },
            log: AgentLogConfig { level },
        } = self;
        if data_dir.as_os_str().is_empty() {
            return Err(ConfigError::invalid("data_dir", "must not be empty"));
        }
        unix.validate("server.unix")?;
        connections.validate("server.connections")?;
        if name.len() > 256 {
            return Err(ConfigError::invalid("daemon.name", "longer than 256 bytes"));
        }
        let ranges: [(&str, u64, u64, u64); 5] = [
            ("server.max_tokens", *max_tokens, 1, 1 << 24),
            ("cache.write_threshold", *write_threshold, 1, 1_000_000),
            (
                "cache.backup_concurrency",
                u64::from(*backup_concurrency),
                1,
                256,
            ),
            ("cache.backup_queue", u64::from(*backup_queue), 1, 1 << 20),
            ("device.copy_threads", u64::from(*copy_threads), 1, 64),
        ];
        crate::check_ranges(&ranges)?;
        for (key, d, lo) in [
            (
                "daemon.reconnect_min",
                reconnect_min,
                Duration::from_millis(10),
            ),
            (
                "daemon.reconnect_max",
                reconnect_max,
                Duration::from_millis(10),
            ),
            ("daemon.timeout", timeout, Duration::from_millis(1)),
            (
                "server.drain_timeout",
                drain_timeout,
                Duration::from_millis(10),
            ),
        ] {
            if d.0 < lo || d.0 > Duration::from_secs(600) {
                return Err(ConfigError::invalid(
                    key,
                    format!("{d} is outside {}ms..=10m", lo.as_millis()),
                ));
            }
        }
        if pool_lease.0 < Duration::from_secs(1) || pool_lease.0 > Duration::from_secs(3600) {
            return Err(ConfigError::invalid(
                "server.pool_lease",
                format!("{pool_lease} is outside 1s..=1h"),
            ));
        }
        if evict_wait.0 > Duration::from_secs(600) {
            return Err(ConfigError::invalid(
                "cache.evict_wait",
                format!("{evict_wait} is above 10m"),
            ));
        }
        if daemon_wait.0 > Duration::from_secs(600) {
            return Err(ConfigError::invalid(
                "cache.daemon_wait",
                format!("{daemon_wait} is above 10m"),
            ));
        }
        if reconnect_max.0 < reconnect_min.0 {
            return Err(ConfigError::invalid(
                "daemon.reconnect_max",
                format!("{reconnect_max} is below daemon.reconnect_min ({reconnect_min})"),
            ));
        }
        if let Some(listen) = listen
            && listen.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(ConfigError::invalid(
                "metrics.listen",
                format!("{listen:?} is not an address such as 127.0.0.1:9465"),
            ));
        }
        if level.trim().is_empty() {
            return Err(ConfigError::invalid("log.level", "must not be empty"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_commented_default_file_is_the_default() {
        assert_eq!(
            AgentConfig::load(&Sources::default()).unwrap(),
            AgentConfig::default()
        );
        assert_eq!(CacheConfig::default(), AgentConfig::default().cache);
        AgentConfig::default().validate().unwrap();
    }

    #[test]
    fn deploy_copy_is_the_default_file() {
        let deploy = include_str!("../../../deploy/kvtier-agent.toml");
        assert_eq!(deploy, DEFAULT_TOML, "regenerate deploy/kvtier-agent.toml");
    }

    #[test]
    fn agent_and_daemon_variables_do_not_mix() {
        let env = vec![
            ("KVTIER_L2_POOL_BYTES".to_string(), "1GiB".to_string()),
            (
                "KVTIER_AGENT_CACHE_WRITE_POLICY".to_string(),
                "write_back".to_string(),
            ),
        ];
        let a = AgentConfig::load(&Sources {
            env: env.clone(),
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(a.write_policy(), WritePolicy::WriteBack);
        let d = crate::daemon::DaemonConfig::load(&Sources {
            env,
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(d.l2.pool_bytes.0, 1 << 30);
    }

    #[test]
    fn errors_name_the_key() {
        for (set, key) in [
            ("cache.write_policy=sometimes", "cache.write_policy"),
            ("cache.evict_wait=1h", "cache.evict_wait"),
            ("cache.daemon_wait=1h", "cache.daemon_wait"),
            ("cache.eviction_policy=random", "cache.eviction_policy"),
            ("device.copy_threads=0", "device.copy_threads"),
            ("device.copy_method=fast", "device.copy_method"),
            ("daemon.reconnect_max=20ms", "daemon.reconnect_max"),
            ("metrics.listen=nowhere", "metrics.listen"),
            ("cache.nope=1", "cache.nope"),
        ] {
            let e = AgentConfig::load(&Sources {
                sets: vec![set.to_string()],
                ..Sources::default()
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(key), "{set}: {e}");
        }
        let e = AgentConfig::load(&Sources {
            env: vec![("KVTIER_AGENT_CACHE_WRITEPOLICY".into(), "x".into())],
            ..Sources::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("KVTIER_AGENT_CACHE_WRITEPOLICY"), "{e}");
        // An unknown copy method lists the allowed ones; a known one is taken as typed.
        let e = AgentConfig::load(&Sources {
            sets: vec!["device.copy_method=fast".into()],
            ..Sources::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("auto") && e.contains("per_run"), "{e}");
        let c = AgentConfig::load(&Sources {
            sets: vec!["device.copy_method=kernel".into()],
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(c.device.copy_method, kvtier_core::CopyMethod::Kernel);
    }

    #[test]
    fn the_write_policy_is_one_typed_value_from_every_source() {
        // A bad word fails at parse, naming the key and the allowed words, whichever source
        // gave it: never a silent fallback to write_through.
        let sources = [
            Sources {
                sets: vec!["cache.write_policy=write_sometimes".into()],
                ..Sources::default()
            },
            Sources {
                env: vec![(
                    "KVTIER_AGENT_CACHE_WRITE_POLICY".into(),
                    "write_sometimes".into(),
                )],
                ..Sources::default()
            },
            Sources {
                file: Some((
                    "agent.toml".into(),
                    "[cache]\nwrite_policy = \"write_sometimes\"\n".into(),
                )),
                ..Sources::default()
            },
        ];
        for src in sources {
            let e = AgentConfig::load(&src).unwrap_err().to_string();
            for want in [
                "cache.write_policy",
                "write_sometimes",
                "write_through_selective",
            ] {
                assert!(e.contains(want), "{e:?} lacks {want:?}");
            }
        }
        let c = AgentConfig::load(&Sources {
            sets: vec![
                "cache.write_policy=write_through_selective".into(),
                "cache.write_threshold=5".into(),
            ],
            ..Sources::default()
        })
        .unwrap();
        assert_eq!(
            c.write_policy(),
            WritePolicy::WriteThroughSelective { threshold: 5 }
        );
    }
}
