//! kvtier-agent: parse flags, load the configuration, start logging, run until SIGINT/SIGTERM.

use std::io::Write as _;
use std::path::PathBuf;

use clap::Parser;
use kvtier_config::Sources;
use kvtier_config::agent::{AgentConfig, DEFAULT_TOML};

/// kvtier-agent — the per-worker L1 agent of kvtier (the engine's prefix cache).
#[derive(Debug, Parser)]
#[command(name = "kvtier-agent", version)]
struct Flags {
    /// Configuration file (TOML). Without one, built-in defaults apply.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Override one key, e.g. `--set cache.write_policy=write_back` (repeatable).
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Print the complete, commented default configuration and exit.
    #[arg(long)]
    print_default_config: bool,
    /// Validate the configuration, print it resolved, and exit.
    #[arg(long)]
    check_config: bool,
}

fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    if flags.print_default_config {
        print!("{DEFAULT_TOML}");
        return Ok(());
    }
    let cfg = AgentConfig::load(&Sources::from_process(flags.config.as_deref(), flags.set)?)?;
    if flags.check_config {
        println!("{cfg:#?}");
        return Ok(());
    }
    kvtier_client::serving::init_logging(&cfg.log.level).map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier-agent")
        .build()?;
    rt.block_on(async move {
        let shutdown = kvtier_client::serving::shutdown_on_signals();
        kvtier_agent::run(cfg, shutdown, |r| {
            // One line on stdout that scripts and tests wait for.
            let metrics = r
                .metrics
                .map(|a| format!("http://{a}/metrics"))
                .unwrap_or_default();
            println!(
                "kvtier-agent ready socket={} metrics={metrics}",
                r.socket.display()
            );
            let _ = std::io::stdout().flush();
        })
        .await
    })?;
    Ok(())
}
