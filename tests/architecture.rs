//! docs/ARCHITECTURE.md's crate table against the Cargo manifests: every workspace crate has
//! a row, and the row's "depends on" column names exactly the crate's dependencies among our
//! own crates (and only dependencies the manifest has). The test crate, which has only
//! dev-dependencies, is held to those. And no source takes std's poisoning locks (they are
//! `parking_lot`'s everywhere, so no file recovers from poisoning by hand).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::Path;

/// Our crates' short names as the table writes them (`kvtier-core` → `core`).
fn short(name: &str) -> &str {
    name.strip_prefix("kvtier-").unwrap_or(name)
}

struct Manifest {
    name: String,
    deps: BTreeSet<String>,
}

fn manifests(root: &Path) -> Vec<Manifest> {
    let mut dirs: Vec<_> = std::fs::read_dir(root.join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    dirs.push(root.join("benches"));
    dirs.push(root.join("tests"));
    dirs.sort();
    dirs.into_iter()
        .filter(|d| d.join("Cargo.toml").exists())
        .map(|d| {
            let text = std::fs::read_to_string(d.join("Cargo.toml")).unwrap();
            let t: toml::Table = toml::from_str(&text).unwrap();
            let name = t["package"]["name"].as_str().unwrap().to_string();
            let section = |s: &str| -> BTreeSet<String> {
                t.get(s)
                    .and_then(toml::Value::as_table)
                    .map(|d| d.keys().cloned().collect())
                    .unwrap_or_default()
            };
            let mut deps = section("dependencies");
            if deps.is_empty() {
                deps = section("dev-dependencies");
            }
            Manifest { name, deps }
        })
        .collect()
}

#[test]
fn the_crate_table_matches_the_manifests() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let doc = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let crates = manifests(root);
    let ours: BTreeSet<&str> = crates.iter().map(|m| short(&m.name)).collect();
    let mut wrong = Vec::new();
    for m in &crates {
        let Some(row) = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `{}`", m.name)))
        else {
            wrong.push(format!("{} has no row in the crate table", m.name));
            continue;
        };
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        let listed: BTreeSet<&str> = cells[3]
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .collect();
        let internal: BTreeSet<&str> = m
            .deps
            .iter()
            .map(|d| short(d))
            .filter(|d| ours.contains(d))
            .collect();
        let listed_internal: BTreeSet<&str> = listed
            .iter()
            .copied()
            .filter(|d| ours.contains(d))
            .collect();
        if listed_internal != internal {
            wrong.push(format!(
                "{}: the table says it depends on {listed_internal:?} of our crates; Cargo.toml \
                 says {internal:?}",
                m.name
            ));
        }
        for ext in listed.iter().filter(|d| !ours.contains(*d)) {
            if !m.deps.contains(*ext) {
                wrong.push(format!(
                    "{}: the table names {ext}, which Cargo.toml does not depend on",
                    m.name
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/ARCHITECTURE.md is stale:\n{}",
        wrong.join("\n")
    );
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Locks are `parking_lot`'s, which do not poison: no file takes std's `Mutex` or `RwLock`
/// and recovers from poisoning its own way (there were 13 such helpers).
#[test]
fn no_lock_poisons_and_none_is_recovered_by_hand() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    for d in ["crates", "benches", "tests"] {
        rust_files(&root.join(d), &mut files);
    }
    let this = Path::new(file!()).file_name().unwrap();
    let mut wrong = Vec::new();
    for f in files.iter().filter(|f| f.file_name() != Some(this)) {
        let text = std::fs::read_to_string(f).unwrap();
        for (i, line) in text.lines().enumerate() {
            let named = ["Mutex", "RwLock", "Condvar"]
                .iter()
                .any(|l| line.contains(&format!("std::sync::{l}")));
            let used = line.trim_start().starts_with("use std::sync")
                && ["Mutex", "RwLock", "Condvar"]
                    .iter()
                    .any(|l| line.contains(l));
            let std_lock = named || used;
            if std_lock || line.contains("PoisonError") {
                wrong.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(wrong.is_empty(), "use parking_lot's locks: {wrong:#?}");
}

/// kvtierd's and the agent's tasks run on their tracker (`kvtier_server::tasks`), which the
/// drain waits on: no code of either outside its tests calls `tokio::spawn` itself, but a
/// sub-task its parent holds and aborts (`// scoped:` on the line before says so).
#[test]
fn every_server_task_is_on_the_tracker() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut files = Vec::new();
    // kvtierd's and the agent's: each drains by waiting on its tracker.
    rust_files(&root.join("crates/kvtier-daemon/src"), &mut files);
    rust_files(&root.join("crates/kvtier-agent/src"), &mut files);
    let mut wrong = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        // The tests at the end of a file may spawn as they like.
        let code = text.split("#[cfg(test)]").next().unwrap_or_default();
        let lines: Vec<&str> = code.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let scoped = i > 0 && lines[i - 1].trim_start().starts_with("// scoped:");
            if line.contains("tokio::spawn(") && !line.trim_start().starts_with("//") && !scoped {
                wrong.push(format!("{}:{}: {}", f.display(), i + 1, line.trim()));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "spawn on the part's Tasks (kvtier_server::tasks): {wrong:#?}"
    );
}
