//! kvtierctl: the operator's tool. Each subcommand is a function here returning its output,
//! so tests call it in-process; `main.rs` only parses flags and prints.
//!
//! - `keys`: the page keys of a token sequence, one hex key per full page — the tool to use
//!   when two processes disagree about keys.
//! - `layout`: the geometry and fingerprint a layout descriptor validates to.
//! - `status`: pools, sessions, usage and counters of a running kvtierd.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use kvtier_core::{DType, KvKind, Layout, LayoutSpec, Namespace, PageHasher};

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
    /// Show, attach, swap or detach a running kvtierd's storage tier (L3).
    Backend(BackendArgs),
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
    /// `kvtierctl backend attach backend=file file_path=/data/l3`.
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
        Command::Backend(a) => backend(a),
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

/// `kvtierctl status`.
pub fn status(a: StatusArgs) -> Result<String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (health, s) = rt
        .block_on(async {
            let health = kvtier_client::health(&a.socket).await;
            let mut c = kvtier_client::HostClient::connect(&a.socket).await?;
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
    writeln!(out, "sessions: {}", s.sessions.len())?;
    for c in &s.sessions {
        writeln!(
            out,
            "  {:>6} {:<24} pool {}  pins {}  writing {}  idle {} ms",
            c.session_id,
            c.name,
            &hex(&c.fingerprint)[..8],
            c.pins,
            c.writing_pages,
            c.idle_ms
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
    use kvtier_proto::v1::admin_client::AdminClient;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let r = rt
        .block_on(async {
            let mut c = AdminClient::new(kvtier_client::connect(&a.socket).await?);
            let r = match a.action {
                BackendAction::Status => c.backend_status(v1::BackendStatusRequest {}).await,
                BackendAction::Attach { settings } => {
                    c.attach_backend(v1::AttachBackendRequest { settings })
                        .await
                }
                BackendAction::Detach => c.detach_backend(v1::DetachBackendRequest {}).await,
            };
            anyhow::Ok(r.map_err(kvtier_client::ClientError::from)?.into_inner())
        })
        .with_context(|| format!("asking kvtierd at {}", a.socket))?;
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
                "  pages written {}  already there {}  failed {}  dropped {}  queued {}",
                s.written_pages, s.skipped_pages, s.failed_pages, s.dropped_pages, s.queued_pages
            )?;
        }
        _ => writeln!(out, "no l3 backend attached")?,
    }
    Ok(out)
}
