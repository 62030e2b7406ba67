//! kvtier-sim: replay a trace or a generated chat workload through kvtier and check every page.
//!
//! `kvtier-sim replay --trace FILE [--limit N] [--json]` starts a kvtierd and one agent per
//! worker (child processes, temp directory) unless `--daemon`/`--agents` name running ones.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use kvtier_core::{DType, KvKind, LayoutSpec, WritePolicy};
use kvtier_proto::v1::PrefetchPolicy;
use kvtier_sim::cluster::{ClusterSpec, Launcher};
use kvtier_sim::{Chaos, Options, Target, workload};

/// kvtier-sim — drive kvtier like inference engines do and verify every page.
#[derive(Debug, Parser)]
#[command(name = "kvtier-sim", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Replay a Mooncake-format trace (JSONL: timestamp, input_length, output_length,
    /// hash_ids of 512-token blocks).
    Replay {
        /// The trace file.
        #[arg(long)]
        trace: PathBuf,
        /// Replay the first N requests (0: all).
        #[arg(long, default_value_t = 0)]
        limit: usize,
        #[command(flatten)]
        common: Common,
    },
    /// Generate multi-turn chat sessions with shared system prompts.
    Chat {
        #[command(flatten)]
        chat: ChatArgs,
        #[command(flatten)]
        common: Common,
    },
    /// Replay a Mooncake-format trace (--trace), or the chat generator's sessions (without
    /// it), through a fleet: N nodes (each a kvtierd with --workers workers) over one shared
    /// L3, behind a router, once per policy.
    Fleet {
        /// The trace file; without it, the chat generator's workload.
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Replay the first N requests (0: all).
        #[arg(long, default_value_t = 0)]
        limit: usize,
        /// Nodes (1 to 64).
        #[arg(long, default_value_t = 4)]
        nodes: usize,
        /// Routing policies, each run on a fresh fleet: round_robin, random, prefix_hash,
        /// kvtier.
        #[arg(long, value_delimiter = ',', default_value = "round_robin,kvtier")]
        policies: Vec<String>,
        /// Seed of the random policy.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// No shared L3: each node finds only what its own L2 holds (a fleet of isolated
        /// pools, the baseline kvtier's shared tiers are measured against).
        #[arg(long)]
        isolated: bool,
        /// Each worker gets its own kvtierd with 1/--workers of --l2-pages (one pool per
        /// engine instance, against one pool the node's workers share).
        #[arg(long)]
        private_l2: bool,
        /// Where the shared L3's directory goes (default: the temp directory). A tmpfs
        /// (/dev/shm) keeps a disk's stalls out of the measurement.
        #[arg(long)]
        l3_dir: Option<PathBuf>,
        /// REQUEST:NODE: before that request, SIGKILL the node's kvtierd and start it again
        /// (repeatable).
        #[arg(long)]
        kill_node_at: Vec<String>,
        /// REQUEST:NODE:MS: before that request, the node's kvtierd stops answering for MS
        /// milliseconds (SIGSTOP, then SIGCONT; repeatable).
        #[arg(long)]
        hang_node_at: Vec<String>,
        /// REQUEST:NODE: before that request, the node leaves the fleet (repeatable).
        #[arg(long)]
        remove_node_at: Vec<String>,
        /// REQUEST:NODE: before that request, a removed node comes back with an empty L2
        /// (repeatable).
        #[arg(long)]
        add_node_at: Vec<String>,
        #[command(flatten)]
        chat: ChatArgs,
        #[command(flatten)]
        common: Common,
    },
}

/// The chat generator's workload.
#[derive(Debug, Args)]
struct ChatArgs {
    /// Conversations.
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Turns per conversation.
    #[arg(long, default_value_t = 4)]
    turns: usize,
    /// Distinct system prompts.
    #[arg(long, default_value_t = 2)]
    system_prompts: usize,
    /// Tokens per system prompt.
    #[arg(long, default_value_t = 2048)]
    system_tokens: usize,
    /// Tokens per user message.
    #[arg(long, default_value_t = 256)]
    user_tokens: usize,
    /// Tokens per answer.
    #[arg(long, default_value_t = 128)]
    output_tokens: usize,
    /// Milliseconds between requests (with --time-scale).
    #[arg(long, default_value_t = 50)]
    interval_ms: u64,
}

impl ChatArgs {
    fn requests(&self) -> Vec<workload::Request> {
        workload::chat(&workload::ChatSpec {
            sessions: self.sessions,
            turns: self.turns,
            system_prompts: self.system_prompts,
            system_tokens: self.system_tokens,
            user_tokens: self.user_tokens,
            output_tokens: self.output_tokens,
            interval_ms: self.interval_ms,
        })
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
enum Device {
    Cpu,
    Cuda,
}

#[derive(Debug, Args)]
struct Common {
    /// Print one JSON object instead of progress and a table.
    #[arg(long)]
    json: bool,
    /// Workers (each with its own agent).
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Device (L1) pages per worker.
    #[arg(long, default_value_t = 4096)]
    device_pages: u64,
    /// Where each worker's KV pool is: cpu (shared memory, the agent's cpu device) or cuda
    /// (GPU 0, opened by the agent by CUDA IPC handle: its copy methods move every page).
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// L2 pages (kvtierd's pool).
    #[arg(long, default_value_t = 8192)]
    l2_pages: u64,
    /// Tokens per page.
    #[arg(long, default_value_t = 64)]
    page_size: u32,
    /// Model layers.
    #[arg(long, default_value_t = 2)]
    layers: u32,
    /// KV heads per worker.
    #[arg(long, default_value_t = 1)]
    kv_heads: u32,
    /// Head dimension.
    #[arg(long, default_value_t = 32)]
    head_dim: u32,
    /// L3 backend: file, memory, rocksdb, none (s3 and remote: attach to a configured kvtierd).
    #[arg(long, default_value = "file")]
    l3: String,
    /// Device → L2 write policy of the agents: write_through, write_through_selective,
    /// write_back.
    #[arg(long, default_value = "write_through")]
    write_policy: WritePolicy,
    /// L2 → L3 write policy of kvtierd.
    #[arg(long, default_value = "write_through")]
    l3_write_policy: WritePolicy,
    /// Prefetch policy for L3 hits: best_effort, wait_complete, timeout, or off.
    #[arg(long, default_value = "wait_complete")]
    prefetch: String,
    /// Serve requests one at a time in order, each one's backups settled before the next
    /// (deterministic, for debugging). By default workers take requests from one queue in
    /// arrival order and serve them concurrently, as an engine does.
    #[arg(long)]
    sequential: bool,
    /// Replay at trace time × this factor, with prefill taking computed tokens /
    /// --prefill-tokens-per-second × this factor of wall time. 0: as fast as possible,
    /// compute instant (the stress case).
    #[arg(long, default_value_t = 0.0)]
    time_scale: f64,
    /// Cost model: prefill tokens per second (prefill time with --time-scale, and the TTFT
    /// estimate).
    #[arg(long, default_value_t = 10000.0)]
    prefill_tokens_per_second: f64,
    /// Chaos: make L3 calls fail with this probability.
    #[arg(long, default_value_t = 0.0)]
    l3_fault_rate: f64,
    /// Chaos: delay every L3 read by this many milliseconds.
    #[arg(long, default_value_t = 0)]
    l3_fault_delay_ms: u64,
    /// Chaos: SIGKILL kvtierd after this many requests and start it again.
    #[arg(long)]
    kill_daemon_at: Option<usize>,
    /// Chaos: SIGKILL worker 0's agent after this many requests and start it again.
    #[arg(long)]
    kill_agent_at: Option<usize>,
    /// Extra kvtierd setting (section.key=value), repeatable.
    #[arg(long = "daemon-set")]
    daemon_set: Vec<String>,
    /// Extra kvtier-agent setting (section.key=value), repeatable.
    #[arg(long = "agent-set")]
    agent_set: Vec<String>,
    /// Attach to this running kvtierd (its socket) instead of starting one.
    #[arg(long, requires = "agents")]
    daemon: Option<PathBuf>,
    /// Attach to these running agents (comma-separated sockets), one per worker.
    #[arg(long, value_delimiter = ',', requires = "daemon")]
    agents: Vec<PathBuf>,
}

fn prefetch_policy(s: &str) -> Result<Option<PrefetchPolicy>> {
    Ok(match s {
        "off" => None,
        "best_effort" => Some(PrefetchPolicy::BestEffort),
        "wait_complete" => Some(PrefetchPolicy::WaitComplete),
        "timeout" => Some(PrefetchPolicy::Timeout),
        other => bail!("--prefetch {other:?}: expected best_effort, wait_complete, timeout or off"),
    })
}

impl Common {
    /// Refuses numbers the run cannot use, before anything starts.
    fn check(&self) -> Result<()> {
        if !(self.time_scale.is_finite() && self.time_scale >= 0.0) {
            bail!(
                "--time-scale {}: a finite factor, 0 or more",
                self.time_scale
            );
        }
        if !(self.prefill_tokens_per_second.is_finite() && self.prefill_tokens_per_second > 0.0) {
            bail!(
                "--prefill-tokens-per-second {}: a finite rate above 0",
                self.prefill_tokens_per_second
            );
        }
        if !(0.0..=1.0).contains(&self.l3_fault_rate) {
            bail!(
                "--l3-fault-rate {}: a share of L3 calls, 0 to 1",
                self.l3_fault_rate
            );
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    // A re-executed child serves kvtierd or an agent for an embedded cluster.
    if kvtier_sim::cluster::serve_child_from_env() {
        return Ok(());
    }
    let cli = Cli::parse();
    let mut fleet = None;
    let (requests, common) = match cli.command {
        Command::Fleet {
            trace,
            limit,
            nodes,
            policies,
            seed,
            isolated,
            private_l2,
            l3_dir,
            kill_node_at,
            hang_node_at,
            remove_node_at,
            add_node_at,
            chat,
            common,
        } => {
            use kvtier_sim::fleet::{FleetChaos, FleetL3};
            let policies = policies
                .iter()
                .map(|p| p.parse::<kvtier_sim::router::Policy>())
                .collect::<Result<Vec<_>>>()?;
            let mut chaos = Vec::new();
            for (given, make) in [
                (
                    &kill_node_at,
                    FleetChaos::kill as fn(usize, usize) -> FleetChaos,
                ),
                (&remove_node_at, FleetChaos::remove),
                (&add_node_at, FleetChaos::add),
            ] {
                for s in given {
                    chaos.push(FleetChaos::parse(s, make)?);
                }
            }
            for s in &hang_node_at {
                chaos.push(FleetChaos::parse_hang(s)?);
            }
            let l3 = if isolated {
                FleetL3::Isolated
            } else {
                FleetL3::Shared
            };
            fleet = Some((nodes, policies, seed, l3, private_l2, chaos, l3_dir));
            let requests = match trace {
                Some(trace) => workload::mooncake(&trace, limit, 256)?,
                None => chat.requests(),
            };
            (requests, common)
        }
        Command::Replay {
            trace,
            limit,
            common,
        } => (workload::mooncake(&trace, limit, 256)?, common),
        Command::Chat { chat, common } => (chat.requests(), common),
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    common.check()?;
    let layout = LayoutSpec {
        model_id: "kvtier-sim".into(),
        model_version: String::new(),
        dtype: DType::Bf16,
        num_layers: common.layers,
        kind: KvKind::Mha {
            kv_heads: common.kv_heads,
            head_dim: common.head_dim,
        },
        page_size: common.page_size,
        tp_rank: 0,
        tp_size: 1,
    };
    let mut chaos = Vec::new();
    if let Some(k) = common.kill_daemon_at {
        chaos.push(Chaos::KillDaemonAt(k));
    }
    if let Some(k) = common.kill_agent_at {
        chaos.push(Chaos::KillAgentAt(k));
    }
    chaos.sort_by_key(|c| match c {
        Chaos::KillDaemonAt(k) | Chaos::KillAgentAt(k) => *k,
    });
    let opts = Options {
        layout,
        device_pages: common.device_pages,
        device: match common.device {
            Device::Cpu => kvtier_sim::kv::SimDevice::Cpu,
            Device::Cuda => kvtier_sim::kv::SimDevice::Cuda,
        },
        prefetch: prefetch_policy(&common.prefetch)?,
        sequential: common.sequential,
        time_scale: common.time_scale,
        prefill_tokens_per_second: common.prefill_tokens_per_second,
        chaos,
        progress: !common.json,
    };
    let target = match common.daemon {
        Some(daemon) => {
            if common.agents.is_empty() {
                bail!("--daemon needs --agents");
            }
            Target::Attach {
                daemon,
                agents: common.agents.clone(),
            }
        }
        None => {
            let mut daemon_sets = vec![
                format!("l2.pool_pages={}", common.l2_pages),
                format!("l3.backend={}", common.l3),
                format!("l3.write_policy={}", common.l3_write_policy.name()),
                // The simulator decides what to fetch; the daemon's guesses would only hide
                // hits from the check.
                "prefetch.recompute_tokens_per_second=0".to_string(),
                "prefetch.threshold_tokens=0".to_string(),
                "prefetch.budget_fraction=1.0".to_string(),
                format!("l3.fault_error_rate={}", common.l3_fault_rate),
                format!("l3.fault_get_delay={}ms", common.l3_fault_delay_ms),
            ];
            daemon_sets.extend(common.daemon_set.iter().cloned());
            Target::Embedded(ClusterSpec {
                workers: common.workers,
                daemon_sets,
                agent_sets: std::iter::once(format!(
                    "cache.write_policy={}",
                    common.write_policy.name()
                ))
                .chain(common.agent_set.iter().cloned())
                .collect(),
            })
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some((nodes, policies, seed, l3, private_l2, chaos, l3_dir)) = fleet {
        let Target::Embedded(node) = target else {
            bail!("fleet starts its own nodes: --daemon and --agents do not apply");
        };
        let mut reports = Vec::new();
        for policy in policies {
            let opts = kvtier_sim::fleet::FleetOptions {
                base: opts.clone(),
                nodes,
                node: node.clone(),
                policy,
                seed,
                l3,
                private_l2,
                chaos: chaos.clone(),
                l3_dir: l3_dir.clone(),
            };
            let r = rt
                .block_on(kvtier_sim::fleet::run_fleet(
                    requests.clone(),
                    opts,
                    Launcher::this_binary()?,
                ))
                .with_context(|| format!("fleet replay, policy {}", policy.name()))?;
            reports.push(r);
        }
        rt.shutdown_timeout(Duration::from_secs(1));
        if common.json {
            println!("{}", serde_json::to_string(&reports)?);
        } else {
            print!("{}", kvtier_sim::fleet::table(&reports));
        }
        let corrupt: u64 = reports.iter().map(|r| r.pages_corrupt).sum();
        if corrupt > 0 {
            bail!("{corrupt} corrupt pages");
        }
        return Ok(());
    }
    let report = rt
        .block_on(kvtier_sim::run(
            requests,
            opts,
            target,
            Launcher::this_binary()?,
        ))
        .context("simulation")?;
    rt.shutdown_timeout(Duration::from_secs(1));
    if common.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print!("{}", report.table());
    }
    if report.pages_corrupt > 0 {
        bail!("{} corrupt pages", report.pages_corrupt);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn common(args: &[&str]) -> Common {
        let argv = ["kvtier-sim", "chat"].iter().chain(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Chat { common, .. } => common,
            other => panic!("parsed as {other:?}"),
        }
    }

    /// NaN, infinities and out-of-range shares are refused by name before anything starts
    /// (a NaN time scale used to panic once the nodes were up; a fault rate of 2 used to
    /// cost a minute waiting for a kvtierd that had refused it).
    #[test]
    fn numbers_the_run_cannot_use_are_refused_by_name() {
        common(&[]).check().unwrap();
        for (args, says) in [
            (["--time-scale", "nan"], "--time-scale"),
            (["--time-scale", "inf"], "--time-scale"),
            (["--time-scale=-1", "--json"], "--time-scale"),
            (
                ["--prefill-tokens-per-second", "0"],
                "--prefill-tokens-per-second",
            ),
            (
                ["--prefill-tokens-per-second", "nan"],
                "--prefill-tokens-per-second",
            ),
            (["--l3-fault-rate", "2"], "--l3-fault-rate"),
            (["--l3-fault-rate", "nan"], "--l3-fault-rate"),
        ] {
            let e = common(&args).check().unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        }
    }
}
