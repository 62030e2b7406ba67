//! kvtier-agent: parse flags, load the configuration, start logging, run until SIGINT/SIGTERM.

use std::io::{IsTerminal as _, Write as _};
use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use kvtier_config::Sources;
use kvtier_config::agent::{AgentConfig, DEFAULT_TOML};
use tokio_util::sync::CancellationToken;

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
    let filter = tracing_subscriber::EnvFilter::try_new(&cfg.log.level).with_context(|| {
        format!(
            "config key `log.level`: {:?} is not a filter",
            cfg.log.level
        )
    })?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtier-agent")
        .build()?;
    rt.block_on(async move {
        let shutdown = CancellationToken::new();
        let signals = shutdown.clone();
        tokio::spawn(async move {
            let mut term =
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(s) => s,
                    Err(e) => {
                        tracing::error!("cannot listen for SIGTERM: {e}");
                        return;
                    }
                };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            signals.cancel();
        });
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
