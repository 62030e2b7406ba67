//! The command line and `main` flow of kvtierd and kvtier-agent.

use std::fmt;
use std::future::Future;
use std::io::Write as _;
use std::path::PathBuf;

use clap::{Arg, ArgAction, Command};
use kvtier_config::agent::AgentConfig;
use kvtier_config::daemon::DaemonConfig;
use kvtier_config::{ConfigError, Sources};
use tokio_util::sync::CancellationToken;

/// A server's configuration, as its `main` needs it.
pub trait ProcessConfig: fmt::Debug + Sized {
    /// The complete, commented default configuration (`--print-default-config`).
    const DEFAULT_TOML: &'static str;
    /// Loads from file, environment and `--set` overrides, and validates.
    fn load(sources: &Sources) -> Result<Self, ConfigError>;
    /// The `log.level` filter.
    fn log_level(&self) -> &str;
}

impl ProcessConfig for DaemonConfig {
    const DEFAULT_TOML: &'static str = kvtier_config::daemon::DEFAULT_TOML;
    fn load(sources: &Sources) -> Result<Self, ConfigError> {
        DaemonConfig::load(sources)
    }
    fn log_level(&self) -> &str {
        &self.log.level
    }
}

impl ProcessConfig for AgentConfig {
    const DEFAULT_TOML: &'static str = kvtier_config::agent::DEFAULT_TOML;
    fn load(sources: &Sources) -> Result<Self, ConfigError> {
        AgentConfig::load(sources)
    }
    fn log_level(&self) -> &str {
        &self.log.level
    }
}

/// What the command line asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Flags {
    /// `--config FILE`.
    pub config: Option<PathBuf>,
    /// `--set SECTION.KEY=VALUE`, in order.
    pub set: Vec<String>,
    /// `--print-default-config`.
    pub print_default_config: bool,
    /// `--check-config`.
    pub check_config: bool,
}

/// The command line of a server binary called `name`.
pub fn command(name: &'static str, about: &'static str) -> Command {
    Command::new(name)
        .version(env!("CARGO_PKG_VERSION"))
        .about(about)
        .arg(
            Arg::new("config")
                .long("config")
                .short('c')
                .value_name("CONFIG")
                .value_parser(clap::value_parser!(PathBuf))
                .help("Configuration file (TOML). Without one, built-in defaults apply."),
        )
        .arg(
            Arg::new("set")
                .long("set")
                .value_name("SECTION.KEY=VALUE")
                .action(ArgAction::Append)
                .help(
                    "Override one key, e.g. `--set log.level=debug` (repeatable; beats file \
                     and environment).",
                ),
        )
        .arg(
            Arg::new("print_default_config")
                .long("print-default-config")
                .action(ArgAction::SetTrue)
                .help("Print the complete, commented default configuration and exit."),
        )
        .arg(
            Arg::new("check_config")
                .long("check-config")
                .action(ArgAction::SetTrue)
                .help("Validate the configuration, print it resolved, and exit."),
        )
}

impl Flags {
    /// Parses `args` (the first is the program name) with [`command`]; exits with clap's
    /// message on a bad command line, as clap does.
    pub fn parse_from<I, T>(name: &'static str, about: &'static str, args: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let m = command(name, about).get_matches_from(args);
        Self {
            config: m.get_one::<PathBuf>("config").cloned(),
            set: m
                .get_many::<String>("set")
                .map(|v| v.cloned().collect())
                .unwrap_or_default(),
            print_default_config: m.get_flag("print_default_config"),
            check_config: m.get_flag("check_config"),
        }
    }
}

/// The whole `main` of a server: parse the process's command line, load the configuration
/// (or print the default, or check it), start logging, raise the descriptor limit and a multi-threaded runtime, and
/// `run` the server with a token cancelled by SIGTERM or SIGINT.
pub fn main<C, F, Fut, E>(name: &'static str, about: &'static str, run: F) -> anyhow::Result<()>
where
    C: ProcessConfig,
    F: FnOnce(C, CancellationToken) -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: Into<anyhow::Error>,
{
    let flags = Flags::parse_from(name, about, std::env::args_os());
    if flags.print_default_config {
        print!("{}", C::DEFAULT_TOML);
        return Ok(());
    }
    let cfg = C::load(&Sources::from_process(flags.config.as_deref(), flags.set)?)?;
    if flags.check_config {
        println!("{cfg:#?}");
        return Ok(());
    }
    crate::serving::init_logging(cfg.log_level()).map_err(anyhow::Error::msg)?;
    raise_descriptor_limit();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name(name)
        .build()?;
    rt.block_on(async move {
        let shutdown = crate::serving::shutdown_on_signals();
        run(cfg, shutdown).await.map_err(Into::into)
    })
}

/// Prints the one line on stdout that scripts and tests wait for:
/// `<name> ready key=value ...`, and flushes it.
pub fn print_ready(name: &str, fields: &[(&str, String)]) {
    let mut line = format!("{name} ready");
    for (k, v) in fields {
        line.push_str(&format!(" {k}={v}"));
    }
    println!("{line}");
    let _ = std::io::stdout().flush();
}

/// Raises this process's soft limit on open files to its hard limit: a server holds one
/// descriptor per connection (and per mapped pool), and the common soft default of 1024 is
/// far below what `[server.connections]` allows. Logged; a failure leaves the limit as it was.
pub fn raise_descriptor_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        let before = l.current;
        l.current = l.maximum;
        match setrlimit(Resource::Nofile, l) {
            Ok(()) => tracing::debug!(?before, now = ?l.maximum, "raised the open-file limit"),
            Err(e) => tracing::warn!("cannot raise the open-file limit: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_parse_every_option() {
        let f = Flags::parse_from(
            "kvtierd",
            "test",
            [
                "kvtierd",
                "-c",
                "a.toml",
                "--set",
                "x.y=1",
                "--set",
                "z=2",
                "--check-config",
            ],
        );
        assert_eq!(
            f,
            Flags {
                config: Some(PathBuf::from("a.toml")),
                set: vec!["x.y=1".into(), "z=2".into()],
                print_default_config: false,
                check_config: true,
            }
        );
        let f = Flags::parse_from("kvtier-agent", "test", ["kvtier-agent"]);
        assert!(f.config.is_none() && f.set.is_empty() && !f.check_config);
    }

    #[test]
    fn bad_command_lines_are_refused() {
        let r = command("kvtierd", "test").try_get_matches_from(["kvtierd", "--bogus"]);
        assert!(r.is_err());
        let r = command("kvtierd", "test").try_get_matches_from(["kvtierd", "--config"]);
        assert!(r.is_err());
    }
}
