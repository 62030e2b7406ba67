//! kvtierd: parse flags, load the configuration, start logging, run until SIGINT/SIGTERM.

use std::io::Write as _;
use std::path::PathBuf;

use clap::Parser;
use kvtier_config::Sources;
use kvtier_config::daemon::{DEFAULT_TOML, DaemonConfig};

/// kvtierd — the kvtier node daemon (shared host tier and storage tiers).
#[derive(Debug, Parser)]
#[command(name = "kvtierd", version)]
struct Flags {
    /// Configuration file (TOML). Without one, built-in defaults apply.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Override one key, e.g. `--set l2.pool_bytes=1GiB` (repeatable; beats file and env).
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
    let cfg = DaemonConfig::load(&Sources::from_process(flags.config.as_deref(), flags.set)?)?;
    if flags.check_config {
        println!("{cfg:#?}");
        return Ok(());
    }
    kvtier_client::serving::init_logging(&cfg.log.level).map_err(anyhow::Error::msg)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kvtierd")
        .build()?;
    rt.block_on(async move {
        let shutdown = kvtier_client::serving::shutdown_on_signals();
        kvtier_daemon::run(cfg, shutdown, |r| {
            // One line on stdout that scripts and tests wait for.
            let metrics = r
                .metrics
                .map(|a| format!("http://{a}/metrics"))
                .unwrap_or_default();
            let tcp = r.tcp.map(|a| a.to_string()).unwrap_or_default();
            println!(
                "kvtierd ready socket={} tcp={tcp} metrics={metrics}",
                r.socket.display()
            );
            let _ = std::io::stdout().flush();
        })
        .await
    })?;
    Ok(())
}
