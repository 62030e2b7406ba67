//! kvtierctl binary: parse flags, run, print.

use clap::Parser;

fn main() -> anyhow::Result<()> {
    let cli = kvtier_ctl::Cli::parse();
    print!("{}", kvtier_ctl::run(cli)?);
    Ok(())
}
