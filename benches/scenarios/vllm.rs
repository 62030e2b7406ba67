//! The vLLM connector at engine speed: `benches/vllm_bench.py` drives vLLM's real Scheduler
//! and the connector's scheduler and worker sides in one process against a kvtierd and a
//! kvtier-agent (the release binaries beside this one), and prints its rows; this records
//! them (each with the baseline it measured in the same run) for the table and `--check`.
//! It needs the Python environment `scripts/setup` builds (`KVTIER_PYENV`, by default
//! /var/tmp/kvtier-pyenv, with vLLM); without one it says so and records nothing.

use std::path::PathBuf;

use crate::{record, say};

#[derive(serde::Deserialize)]
struct PyRow {
    figure: String,
    value: f64,
    unit: String,
    baseline: String,
    baseline_value: f64,
    ratio: Option<f64>,
}

/// Runs the scenario (`quick`: fewer rounds and steps).
pub fn run(quick: bool) {
    let env = std::env::var("KVTIER_PYENV").unwrap_or_else(|_| "/var/tmp/kvtier-pyenv".into());
    let python = PathBuf::from(env).join("bin/python");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let script = root.join("benches/vllm_bench.py");
    let bins = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(PathBuf::from));
    let Some(bins) = bins else {
        say!("vllm: cannot tell where this binary is, nothing measured");
        return;
    };
    let (kvtierd, agent) = (bins.join("kvtierd"), bins.join("kvtier-agent"));
    for (what, path) in [
        ("python", &python),
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
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(&script)
        .arg("--json")
        .env("KVTIERD_BIN", &kvtierd)
        .env("KVTIER_AGENT_BIN", &agent)
        .stderr(std::process::Stdio::inherit());
    if quick {
        cmd.arg("--quick");
    }
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => {
            say!("vllm: could not run {}: {e}", script.display());
            return;
        }
    };
    if !out.status.success() {
        say!(
            "vllm: {} failed ({}), nothing recorded",
            script.display(),
            out.status
        );
        return;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text.lines().rev().find(|l| l.starts_with('[')) else {
        say!("vllm: {} printed no rows", script.display());
        return;
    };
    match serde_json::from_str::<Vec<PyRow>>(line) {
        Ok(rows) => {
            for r in rows {
                record(
                    &r.figure,
                    r.value,
                    &r.unit,
                    &r.baseline,
                    r.baseline_value,
                    r.ratio,
                );
            }
        }
        Err(e) => say!("vllm: the rows do not parse: {e}"),
    }
}
