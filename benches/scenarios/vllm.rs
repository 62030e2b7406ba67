//! The vLLM connector at engine speed: `benches/vllm_bench.py` drives vLLM's real Scheduler
//! and the connector's scheduler and worker sides in one process against a kvtierd and a
//! kvtier-agent (the release binaries beside this one), and prints its rows; this records
//! them (each with the baseline it measured in the same run) for the table and `--check`.
//! It needs the Python environment `scripts/setup` builds (`KVTIER_PYENV`, by default
//! /var/tmp/kvtier-pyenv, with vLLM); without one it says so and records nothing.

use std::path::PathBuf;

use crate::python::{python, run_rows, script};
use crate::say;

/// Runs the scenario (`quick`: fewer rounds and steps).
pub fn run(quick: bool) {
    let bins = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from));
    let Some(bins) = bins else {
        say!("vllm: cannot tell where this binary is, nothing measured");
        return;
    };
    let (kvtierd, agent) = (bins.join("kvtierd"), bins.join("kvtier-agent"));
    for (what, path) in [
        ("python", &python()),
        ("kvtierd", &kvtierd),
        ("kvtier-agent", &agent),
    ] {
        if !path.exists() {
            say!(
                "vllm: no {what} at {} (run scripts/setup, and build kvtierd and kvtier-agent \
                 in this profile), nothing measured",
                path.display()
            );
            return;
        }
    }
    let args: &[&str] = if quick { &["--quick"] } else { &[] };
    run_rows(
        "vllm",
        &script("vllm_bench.py"),
        args,
        &[("KVTIERD_BIN", &kvtierd), ("KVTIERAGENT_BIN", &agent)],
    );
}
