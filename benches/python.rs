//! Scenarios measured by a Python script in the test venv (`KVTIER_PYENV`, by default
//! /var/tmp/kvtier-pyenv, which `scripts/setup` builds): the script prints its rows as one
//! JSON line (`--json`), each with the baseline it measured in the same run, and these are
//! recorded for the table and `--check`. Without the venv a scenario says so and records
//! nothing.

use std::path::{Path, PathBuf};

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

/// The venv's python.
pub fn python() -> PathBuf {
    let env = std::env::var("KVTIER_PYENV").unwrap_or_else(|_| "/var/tmp/kvtier-pyenv".into());
    PathBuf::from(env).join("bin/python")
}

/// `benches/<name>` in this checkout.
pub fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(name)
}

/// Runs `script --json [args]` with `env` set and records the rows it prints; `scenario`
/// names it in what is said when it cannot.
pub fn run_rows(scenario: &str, script: &Path, args: &[&str], env: &[(&str, &Path)]) {
    let python = python();
    if !python.exists() {
        say!(
            "{scenario}: no python at {} (run scripts/setup), nothing measured",
            python.display()
        );
        return;
    }
    let mut cmd = std::process::Command::new(&python);
    cmd.arg(script)
        .arg("--json")
        .args(args)
        .stderr(std::process::Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = match cmd.output() {
        Ok(o) => o,
        Err(e) => {
            say!("{scenario}: could not run {}: {e}", script.display());
            return;
        }
    };
    if !out.status.success() {
        say!(
            "{scenario}: {} failed ({}), nothing recorded",
            script.display(),
            out.status
        );
        return;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(line) = text.lines().rev().find(|l| l.starts_with('[')) else {
        say!("{scenario}: {} printed no rows", script.display());
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
        Err(e) => say!("{scenario}: the rows do not parse: {e}"),
    }
}
