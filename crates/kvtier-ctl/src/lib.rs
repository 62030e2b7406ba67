//! kvtierctl: the operator's tool. Each subcommand is a function here returning its output,
//! so tests call it in-process; `main.rs` only parses flags and prints.
//!
//! - `keys`: the page keys of a token sequence, one hex key per full page — the tool to use
//!   when two processes disagree about keys.
//! - `layout`: the geometry and fingerprint a layout descriptor validates to.
//! - `status`: pools, sessions, usage and counters of a running kvtierd.
//! - `backend`: show, attach, swap or detach a running kvtierd's storage tier.
//! - `clear`, `flush`, `drain` ([`tiers`]): clear a tier (after confirmation), write
//!   everything L3 lacks, or drain the daemon before a stop.
//! - `watch`: a live, refreshing view of a running kvtierd built on its `WatchMetrics`
//!   stream (tiers, hit rates, prefetch and backup rates and bandwidth, queues, breaker).
//! - `events` ([`events`]): a running kvtierd's `WatchEvents` stream, one line per event.
//!
//! The live view (`watch`, [`render_view`]) and the tier operations ([`tiers`]) have modules of
//! their own; a new family of subcommands with its own types goes in a module of its own.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use kvtier_core::{DType, KvKind, Layout, LayoutSpec, Namespace, PageHasher};

pub mod events;
pub mod tiers;
mod watch;
pub use tiers::{ClearArgs, DrainArgs, FlushArgs, TierArg};
pub use watch::{render_view, watch};

/// Command line of kvtierctl.
#[derive(Debug, Parser)]
#[command(name = "kvtierctl", version, about = "Operate and inspect kvtier")]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print one hex page key per full page of a token sequence.
    Keys(KeysArgs),
    /// Validate a layout and print its geometry and fingerprint.
    Layout(LayoutArgs),
    /// Show a running kvtierd's pools, sessions, usage and counters.
    Status(StatusArgs),
    /// Ask a kvtierd or kvtier-agent's grpc.health.v1 service; exit 0 only when it is
    /// SERVING (a container health check or Kubernetes exec probe).
    Health(StatusArgs),
    /// Show, attach, swap or detach a running kvtierd's storage tier (L3).
    Backend(BackendArgs),
    /// Print the configuration a running kvtierd uses now, as kvtierd.toml (secrets
    /// redacted): its file, environment and flags, plus any backend attached since.
    Config(StatusArgs),
    /// Remove what a tier (l2 or l3) holds, after showing what would go and asking.
    Clear(ClearArgs),
    /// Write every page L2 holds that L3 lacks, and wait until they landed.
    Flush(FlushArgs),
    /// Drain kvtierd before a stop: refuse new sessions, writes and prefetches, write
    /// everything L3 lacks, and wait until stopping loses nothing.
    Drain(DrainArgs),
    /// A live view of a running kvtierd: tiers, hit rates, prefetch and backup throughput,
    /// queues and breaker state, refreshed every interval until Ctrl-C.
    Watch(WatchArgs),
    /// What a running kvtierd's L2 gains and loses, one line per event, live (its
    /// WatchEvents stream: a snapshot first, or a resume with --after).
    Events(events::EventsArgs),
}

/// Flags of `kvtierctl watch`.
#[derive(Debug, Args)]
pub struct WatchArgs {
    /// The daemon's control socket (or http://host:port for its TCP listener).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// Time between refreshes, in milliseconds (100 to 60000).
    #[arg(long, default_value_t = 1000)]
    pub interval_ms: u64,
    /// Stop after this many refreshes (0: until Ctrl-C or the daemon goes away).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
    /// Print each view after the previous one instead of redrawing the screen (the default
    /// when stdout is not a terminal).
    #[arg(long)]
    pub plain: bool,
}

/// Flags of `kvtierctl backend`.
#[derive(Debug, Args)]
pub struct BackendArgs {
    /// The daemon's control socket (admin calls are served there).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
    /// What to do.
    #[command(subcommand)]
    pub action: BackendAction,
}

/// `kvtierctl backend` actions.
#[derive(Debug, Subcommand)]
pub enum BackendAction {
    /// Print the attached backend and its counters.
    Status,
    /// Attach a backend (replacing the attached one after draining it), e.g.
    /// `kvtierctl backend attach backend=file file.path=/data/l3`.
    Attach {
        /// l3 settings as KEY=VALUE, keys as in the [l3] section of kvtierd.toml.
        #[arg(required = true)]
        settings: Vec<String>,
    },
    /// Drain and detach the backend; L2 keeps serving.
    Detach,
}

/// Flags of `kvtierctl status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The daemon's control socket (or http://host:port for its TCP listener).
    #[arg(long, default_value = "kvtier-data/kvtierd.sock")]
    pub socket: String,
}

/// Flags of `kvtierctl keys`.
#[derive(Debug, Args)]
pub struct KeysArgs {
    /// Tokens per page.
    #[arg(long)]
    pub page_size: usize,
    /// Token ids, comma separated (e.g. 1,2,3).
    #[arg(long, value_delimiter = ',', required_unless_present = "tokens_file")]
    pub tokens: Vec<u32>,
    /// Read token ids from a file (`-` for stdin), separated by commas or whitespace.
    #[arg(long, conflicts_with = "tokens")]
    pub tokens_file: Option<String>,
    /// Namespace field as FIELD=VALUE, repeatable; FIELD is tenant, cache_salt, lora_id or
    /// extra_key. None given: the default namespace (SGLang-compatible keys).
    #[arg(long = "namespace", value_name = "FIELD=VALUE")]
    pub namespace: Vec<String>,
}

/// Flags of `kvtierctl layout`.
#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// Model identity.
    #[arg(long)]
    pub model_id: String,
    /// Weight version.
    #[arg(long, default_value = "")]
    pub model_version: String,
    /// Element type: fp32, fp16, bf16, fp8_e4m3, fp8_e5m2.
    #[arg(long)]
    pub dtype: String,
    /// Attention layers.
    #[arg(long)]
    pub num_layers: u32,
    /// KV heads on this rank (MHA).
    #[arg(
        long,
        conflicts_with = "kv_lora_rank",
        required_unless_present = "kv_lora_rank"
    )]
    pub kv_heads: Option<u32>,
    /// Head dimension (MHA).
    #[arg(long, requires = "kv_heads")]
    pub head_dim: Option<u32>,
    /// Latent width (MLA).
    #[arg(long)]
    pub kv_lora_rank: Option<u32>,
    /// Rotary width (MLA).
    #[arg(long, default_value_t = 0)]
    pub rope_dim: u32,
    /// Tokens per page.
    #[arg(long)]
    pub page_size: u32,
    /// Tensor-parallel rank.
    #[arg(long, default_value_t = 0)]
    pub tp_rank: u32,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1)]
    pub tp_size: u32,
}

/// Runs a parsed command line and returns what to print.
pub fn run(cli: Cli) -> Result<String> {
    match cli.command {
        Command::Keys(a) => keys(a),
        Command::Layout(a) => layout(a),
        Command::Status(a) => status(a),
        Command::Health(a) => health(&a),
        Command::Backend(a) => backend(a),
        Command::Config(a) => config(&a),
        Command::Clear(a) => tiers::clear(&a, &mut tiers::ask_terminal),
        Command::Flush(a) => tiers::flush(&a),
        Command::Drain(a) => tiers::drain(&a, &mut std::io::stderr()),
        Command::Watch(a) => {
            let stdout = std::io::stdout();
            let redraw = !a.plain && std::io::IsTerminal::is_terminal(&stdout);
            watch(&a, redraw, &mut stdout.lock())?;
            Ok(String::new())
        }
        Command::Events(a) => {
            events::events(&a, &mut std::io::stdout().lock())?;
            Ok(String::new())
        }
    }
}

/// Parses `FIELD=VALUE` pairs into a namespace.
pub fn parse_namespace(pairs: &[String]) -> Result<Namespace> {
    let mut ns = Namespace::default();
    for pair in pairs {
        let Some((field, value)) = pair.split_once('=') else {
            bail!("--namespace {pair:?}: expected FIELD=VALUE");
        };
        let slot = match field {
            "tenant" => &mut ns.tenant,
            "cache_salt" => &mut ns.cache_salt,
            "lora_id" => &mut ns.lora_id,
            "extra_key" => &mut ns.extra_key,
            other => bail!(
                "--namespace: unknown field {other:?}; expected tenant, cache_salt, lora_id or extra_key"
            ),
        };
        *slot = value.to_string();
    }
    Ok(ns)
}

fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .enumerate()
        .map(|(i, s)| {
            s.parse::<u32>()
                .with_context(|| format!("token {i}: {s:?} is not a u32 token id"))
        })
        .collect()
}

/// `kvtierctl keys`.
pub fn keys(a: KeysArgs) -> Result<String> {
    let tokens = match &a.tokens_file {
        Some(path) if path == "-" => parse_tokens(&std::io::read_to_string(std::io::stdin())?)?,
        Some(path) => parse_tokens(
            &std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?,
        )?,
        None => a.tokens,
    };
    let ns = parse_namespace(&a.namespace)?;
    let hasher = PageHasher::new(a.page_size, &ns).context("--page-size")?;
    let mut out = String::new();
    for k in hasher.keys(&tokens) {
        writeln!(out, "{k}")?;
    }
    Ok(out)
}

/// `kvtierctl layout`.
pub fn layout(a: LayoutArgs) -> Result<String> {
    let dtype: DType = a.dtype.parse()?;
    let kind = match (a.kv_heads, a.kv_lora_rank) {
        (Some(kv_heads), None) => KvKind::Mha {
            kv_heads,
            head_dim: a
                .head_dim
                .context("--head-dim is required with --kv-heads")?,
        },
        (None, Some(kv_lora_rank)) => KvKind::Mla {
            kv_lora_rank,
            rope_dim: a.rope_dim,
        },
        _ => bail!("give either --kv-heads/--head-dim (MHA) or --kv-lora-rank (MLA)"),
    };
    let l = Layout::new(LayoutSpec {
        model_id: a.model_id,
        model_version: a.model_version,
        dtype,
        num_layers: a.num_layers,
        kind,
        page_size: a.page_size,
        tp_rank: a.tp_rank,
        tp_size: a.tp_size,
    })?;
    let mut out = String::new();
    writeln!(out, "fingerprint    {}", l.fingerprint())?;
    writeln!(out, "page_bytes     {}", l.page_bytes())?;
    writeln!(out, "slot_stride    {}", l.slot_stride())?;
    writeln!(out, "run_bytes      {}", l.run_bytes())?;
    writeln!(out, "runs_per_page  {}", l.runs_per_page())?;
    Ok(out)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

/// `kvtierctl health`: the overall status of the server's grpc.health.v1 service; an
/// error (so a non-zero exit) unless it is SERVING. TCP targets use `KVTIER_TOKEN` and the TLS
/// variables like every command.
pub fn health(a: &StatusArgs) -> Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let sec = kvtier_client::TcpSecurity::from_env()?;
    let status = rt
        .block_on(kvtier_client::health_with(&a.socket, &sec))
        .with_context(|| format!("asking {} for its health", a.socket))?;
    if status != "SERVING" {
        bail!("{} is {status}", a.socket);
    }
    Ok(format!("{status}\n"))
}

/// `kvtierctl status`.
pub fn status(a: StatusArgs) -> Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (health, s) = rt
        .block_on(async {
            let health = kvtier_client::health(&a.socket).await;
            let mut c = kvtier_client::HostClient::connect_with(
                &a.socket,
                &kvtier_client::TcpSecurity::from_env()?,
            )
            .await?;
            anyhow::Ok((health, c.stats().await?))
        })
        .with_context(|| format!("asking kvtierd at {}", a.socket))?;
    let health = health.unwrap_or_else(|e| format!("unknown ({e})"));
    let mut out = String::new();
    let metrics = if s.metrics_address.is_empty() {
        "off".to_string()
    } else {
        format!("http://{}/metrics", s.metrics_address)
    };
    writeln!(
        out,
        "kvtierd {}  up {}s  health {health}  metrics {metrics}",
        s.version,
        s.uptime_ms / 1000
    )?;
    writeln!(out, "pools: {}", s.pools.len())?;
    for p in &s.pools {
        let used = u64::from(p.ready_pages + p.writing_pages) * p.slot_stride;
        let total = u64::from(p.slots) * p.slot_stride;
        writeln!(
            out,
            "  {} {}  slots {}  ready {}  writing {}  pinned {} ({} pins)  evictions {}  used {} of {}{}{}",
            hex(&p.fingerprint),
            p.model_id,
            p.slots,
            p.ready_pages,
            p.writing_pages,
            p.pinned_pages,
            p.pins,
            p.evictions,
            mib(used),
            mib(total),
            if p.mlocked { "  mlocked" } else { "" },
            if p.huge_pages { "  hugepages" } else { "" },
        )?;
        writeln!(out, "    {}", p.pool_path)?;
    }
    match s.sessions_omitted {
        0 => writeln!(out, "sessions: {}", s.sessions.len())?,
        n => writeln!(
            out,
            "sessions: {} (the {} most recently seen listed)",
            s.sessions.len() + n as usize,
            s.sessions.len()
        )?,
    }
    for c in &s.sessions {
        writeln!(
            out,
            "  {:<21} {:<24} pool {}  pins {}  writing {}  idle {} ms{}",
            c.session_label,
            c.name,
            &hex(&c.fingerprint)[..8],
            c.pins,
            c.writing_pages,
            c.idle_ms,
            if c.tenant.is_empty() {
                String::new()
            } else {
                format!("  tenant {}", c.tenant)
            }
        )?;
        if let Some(r) = &c.report {
            writeln!(
                out,
                "         agent: matches {}  pages device {} l2 {} l3 {} miss {}  loaded back {}  \
                 backed up {} (lost {})  evicted {}  on device {} (locked {})",
                r.matches,
                r.device_hit_pages,
                r.l2_hit_pages,
                r.l3_hit_pages,
                r.miss_pages,
                r.load_back_pages,
                r.backup_pages,
                r.lost_pages,
                r.evicted_pages,
                r.device_pages,
                r.locked_pages
            )?;
        }
    }
    if !s.tenants.is_empty() {
        writeln!(out, "tenants: {}", s.tenants.len())?;
    }
    for t in &s.tenants {
        let quota = |q: u64, unit: &dyn Fn(u64) -> String| {
            if q == 0 {
                "no quota".to_string()
            } else {
                format!("quota {}", unit(q))
            }
        };
        writeln!(
            out,
            "  {:<24} l2 {} pages ({} per pool, evicted {}, refused {})  l3 {} in {} objects ({}, evicted {})",
            if t.tenant.is_empty() {
                "(default)"
            } else {
                &t.tenant
            },
            t.l2_pages,
            quota(u64::from(t.l2_quota_pages), &|q| q.to_string()),
            t.l2_quota_evictions,
            t.l2_quota_refusals,
            mib(t.l3_bytes),
            t.l3_objects,
            quota(t.l3_quota_bytes, &mib),
            t.l3_quota_evictions,
        )?;
    }
    writeln!(
        out,
        "counters: reserve {}  commit {}  acquire {}  dedup pages {}  expired sessions {}",
        s.reserve_calls, s.commit_calls, s.acquire_calls, s.dedup_pages, s.expired_sessions
    )?;
    Ok(out)
}

/// `kvtierctl backend`.
pub fn backend(a: BackendArgs) -> Result<String> {
    use kvtier_proto::v1;
    let r = admin(&a.socket, |mut c| async move {
        match a.action {
            BackendAction::Status => c.backend_status(v1::BackendStatusRequest {}).await,
            BackendAction::Attach { settings } => {
                c.attach_backend(v1::AttachBackendRequest { settings })
                    .await
            }
            BackendAction::Detach => c.detach_backend(v1::DetachBackendRequest {}).await,
        }
    })?;
    let mut out = String::new();
    match (r.attached, r.stats) {
        (true, Some(s)) => {
            writeln!(
                out,
                "l3 backend {}  policy {}  breaker {}",
                s.backend,
                s.write_policy,
                if r.breaker_open { "OPEN" } else { "closed" }
            )?;
            writeln!(
                out,
                "  objects {}  bytes {}  capacity {}  evictions {}",
                s.objects,
                mib(s.bytes),
                if s.capacity_bytes == 0 {
                    "unbounded".to_string()
                } else {
                    mib(s.capacity_bytes)
                },
                s.evictions
            )?;
            writeln!(
                out,
                "  pages written {}  already there {}  failed {}  deferred {}  queued {}",
                s.written_pages, s.skipped_pages, s.failed_pages, s.deferred_pages, s.queued_pages
            )?;
        }
        _ => writeln!(out, "no l3 backend attached")?,
    }
    Ok(out)
}

/// `kvtierctl config`: the running configuration, as kvtierd.toml text.
pub fn config(a: &StatusArgs) -> Result<String> {
    let r = admin(&a.socket, |mut c| async move {
        c.running_config(kvtier_proto::v1::RunningConfigRequest {})
            .await
    })?;
    Ok(r.toml)
}

/// Runs `work` with a HostTier client of kvtierd at `socket` (TCP security from the
/// environment), on a runtime of its own; a failure to connect names `socket`.
pub(crate) fn with_host<T, F, Fut>(socket: &str, work: F) -> Result<T>
where
    F: FnOnce(kvtier_client::HostClient) -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let c = kvtier_client::HostClient::connect_with(
            socket,
            &kvtier_client::TcpSecurity::from_env()?,
        )
        .await
        .with_context(|| format!("connecting to kvtierd at {socket}"))?;
        work(c).await
    })
}

/// Makes one `Admin` call on kvtierd at `socket`, on a runtime of its own.
pub(crate) fn admin<T, F, Fut>(socket: &str, call: F) -> Result<T>
where
    F: FnOnce(kvtier_proto::v1::admin_client::AdminClient<kvtier_client::AuthChannel>) -> Fut,
    Fut: std::future::Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let sec = kvtier_client::TcpSecurity::from_env()?;
        let c = kvtier_proto::v1::admin_client::AdminClient::new(
            kvtier_client::connect_with(socket, &sec).await?,
        );
        let r = call(c).await.map_err(kvtier_client::ClientError::from)?;
        anyhow::Ok(r.into_inner())
    })
    .with_context(|| format!("asking kvtierd at {socket}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvtier_proto::v1::{MetricKind, MetricLabel, MetricSample, MetricsSnapshot};

    fn counter(name: &str, label: (&str, &str), value: f64) -> MetricSample {
        MetricSample {
            name: name.into(),
            labels: vec![MetricLabel {
                name: label.0.into(),
                value: label.1.into(),
            }],
            kind: MetricKind::Counter as i32,
            value,
            ..MetricSample::default()
        }
    }

    fn snap(seq: u64, unix_ms: u64, l2: f64, l3: f64, miss: f64, landed: f64) -> MetricsSnapshot {
        MetricsSnapshot {
            seq,
            unix_ms,
            uptime_ms: 3_723_000,
            samples: vec![
                counter("kvtier_lookup_pages_total", ("tier", "l2"), l2),
                counter("kvtier_lookup_pages_total", ("tier", "l3"), l3),
                counter("kvtier_lookup_pages_total", ("tier", "miss"), miss),
                counter("kvtier_prefetch_bytes_total", ("stage", "landed"), landed),
                counter("kvtier_l3_backend_ops_total", ("backend", "s3"), 1.0),
            ],
        }
    }

    #[test]
    fn views_show_rates_between_snapshots() {
        let a = snap(1, 10_000, 100.0, 0.0, 100.0, 0.0);
        let first = render_view("sock", &a, None);
        assert!(first.contains("up 1h02m03s"), "{first}");
        assert!(first.contains("200 pages total"), "{first}");
        // Two seconds later: 300 more L2 hits, 100 L3 hits, no misses; 4 MiB landed.
        let b = snap(2, 12_000, 400.0, 100.0, 100.0, 4.0 * 1048576.0);
        let view = render_view("sock", &b, Some(&a));
        assert!(view.contains("200 pages/s"), "{view}");
        assert!(view.contains("hit L2 75.0%  L3 25.0%  miss 0.0%"), "{view}");
        assert!(view.contains("2.0 MiB/s"), "{view}");
        assert!(view.contains("L3        s3"), "{view}");
    }

    #[test]
    fn sglang_clients_get_a_line_once_there_are_any() {
        let quiet = snap(1, 10_000, 0.0, 0.0, 0.0, 0.0);
        assert!(!render_view("sock", &quiet, None).contains("sglang"));
        let two = |name: &str, a: (&str, &str), b: (&str, &str), v: f64| {
            let mut s = counter(name, a, v);
            s.labels.push(MetricLabel {
                name: b.0.into(),
                value: b.1.into(),
            });
            s
        };
        let mut busy = snap(2, 12_000, 0.0, 0.0, 0.0, 0.0);
        busy.samples.extend([
            two(
                "kvtier_sglang_transfers_total",
                ("op", "put"),
                ("outcome", "ok"),
                128.0,
            ),
            two(
                "kvtier_sglang_transfers_total",
                ("op", "get"),
                ("outcome", "ok"),
                96.0,
            ),
            two(
                "kvtier_sglang_transfers_total",
                ("op", "get"),
                ("outcome", "not_found"),
                4.0,
            ),
            two(
                "kvtier_sglang_transfers_total",
                ("op", "get"),
                ("outcome", "out_of_range"),
                2.0,
            ),
            two(
                "kvtier_sglang_hits_total",
                ("op", "get"),
                ("tier", "memory"),
                72.0,
            ),
            two(
                "kvtier_sglang_hits_total",
                ("op", "get"),
                ("tier", "l3"),
                24.0,
            ),
        ]);
        let view = render_view("sock", &busy, None);
        assert!(view.contains("sglang    pools 0  puts 128 total"), "{view}");
        assert!(view.contains("gets 96 total"), "{view}");
        assert!(view.contains("(memory 75.0%  L3 25.0%)"), "{view}");
        assert!(view.contains("not found 4 total  errors 2 total"), "{view}");
    }
}
