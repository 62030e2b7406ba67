//! The goal of every figure that has one, in one place: what `kvtier-bench` prints beside
//! each row and what `--check` holds the run to. A goal is either a ratio against the row's
//! same-run baseline (speed as a fraction of the baseline's, higher is better) or a bound on
//! the value itself (bytes per page).

use crate::Row;

/// What a figure must reach.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub enum Goal {
    /// Its ratio (speed as a fraction of the baseline's) at least this.
    RatioAtLeast(f64),
    /// Its value (in the row's unit) at most this.
    ValueAtMost(f64),
}

impl std::fmt::Display for Goal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Goal::RatioAtLeast(r) => write!(f, "≥ {r:.2}"),
            Goal::ValueAtMost(v) => write!(f, "≤ {v}"),
        }
    }
}

/// (scenario, figure pattern, goal). A row takes the goal of the first entry whose scenario
/// matches and whose pattern begins its figure; a `*` in the pattern stands for any text (the
/// figure then begins with what is before it and ends with what is after it).
const GOALS: &[(&str, &str, Goal)] = &[
    // Issue 43: events reach 4 subscribers within 50 ms at 10k commits a second, and
    // subscribers cost commits at most 5%.
    ("events", "delivery lag p99, ", Goal::ValueAtMost(50.0)),
    (
        "events",
        "commit throughput with ",
        Goal::RatioAtLeast(0.95),
    ),
    // ... and a router's fleet index keeps at most 64 bytes a page per node.
    (
        "events",
        "fleet index bytes per page",
        Goal::ValueAtMost(64.0),
    ),
    // Issue 64: one router process decides within 1 ms at 1,024 simulated nodes.
    (
        "events",
        "router decision p99, 1024 nodes",
        Goal::ValueAtMost(1.0),
    ),
    // P1: the cpu device's copy plan (one memcpy per run) near one memcpy of the same bytes.
    ("agent", "cpu device plan, ", Goal::RatioAtLeast(0.9)),
    // Issue 42: the cuda device's `auto` method near a pinned cuMemcpyAsync of the same bytes
    // (measured only where there is a GPU: `scripts/gpu-check`).
    (
        "gpu",
        "backup D→H, 2 MiB pages, 32 KiB runs, auto",
        Goal::RatioAtLeast(0.8),
    ),
    (
        "gpu",
        "load H→D, 2 MiB pages, 32 KiB runs, auto",
        Goal::RatioAtLeast(0.8),
    ),
    (
        "gpu",
        "backup D→H, 2 MiB pages, 256 KiB runs, auto",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "gpu",
        "load H→D, 2 MiB pages, 256 KiB runs, auto",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "gpu",
        "backup D→H, 8 MiB pages, 128 KiB runs, auto",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "gpu",
        "load H→D, 8 MiB pages, 128 KiB runs, auto",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "gpu",
        "first 2 MiB backup after attach",
        Goal::ValueAtMost(10.0),
    ),
    // P5: match + release of a 1,000-page prefix within 3× an empty call on the same socket.
    (
        "agent",
        "match+release of a 1000-page prefix p50",
        Goal::RatioAtLeast(1.0 / 3.0),
    ),
    // Issue 44's bar, as for host_rpc below: within 0.9 of the floor (the same bytes through a
    // no-op server, the page keys, and the radix tree's own work).
    (
        "agent",
        "match+release of * pages vs its floor",
        Goal::RatioAtLeast(0.9),
    ),
    // P5b: the batched host-tier calls within 3× an empty call.
    (
        "host_rpc",
        "reserve+commit 1000 page(s) p50",
        Goal::RatioAtLeast(1.0 / 3.0),
    ),
    (
        "host_rpc",
        "acquire+release 1000 page(s) p50",
        Goal::RatioAtLeast(1.0 / 3.0),
    ),
    // Issue 44's bar where 3 empty calls are below physics: within 0.9 of the floor (the same
    // bytes through a no-op server, plus the index's own work on the keys).
    (
        "host_rpc",
        "* pages vs their floor",
        Goal::RatioAtLeast(0.9),
    ),
    // P7: the L2 index's memory per page, and eviction that stays flat as it grows.
    (
        "index",
        "L2 HostIndex, * pages: bytes/page",
        Goal::ValueAtMost(128.0),
    ),
    ("index", "L2 HostIndex evict p50, ", Goal::RatioAtLeast(0.5)),
    // ... and, where that is out of reach, near its floor: the small index's evict plus the
    // one random memory load removing a key from a hash index of the large one costs.
    (
        "index",
        "L2 HostIndex evict p50 at * vs its floor",
        Goal::RatioAtLeast(0.8),
    ),
    // P2: the file backend near raw file I/O.
    (
        "l3_file",
        "get 2 MiB pages vs std::fs::read",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "l3_file",
        "set 2 MiB pages vs std::fs::write",
        Goal::RatioAtLeast(0.9),
    ),
    // Issue 44: where the raw goal is out of reach for a read that checks its bytes, within
    // 0.9 of what such a read costs an async caller (docs/BENCHMARKS.md).
    (
        "l3_file",
        "get vs the verified-read floor behind one blocking hop",
        Goal::RatioAtLeast(0.9),
    ),
    // Issue 65: L3 hits from the disk, near raw O_DIRECT transfers of the same bytes.
    (
        "l3_file",
        "cold get 2 MiB pages, io = direct, vs raw O_DIRECT read",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "l3_file",
        "cold get, 8 pages in flight, io = direct, vs raw O_DIRECT reads",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "l3_file",
        "set 2 MiB pages, io = direct, vs raw O_DIRECT write",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "prefetch",
        "prefetch * x 2 MiB from the disk (file, io = direct)",
        Goal::RatioAtLeast(0.85),
    ),
    (
        "l3_rocksdb",
        "rocksdb get vs file get",
        Goal::RatioAtLeast(0.7),
    ),
    // P9: remote near raw loopback TCP.
    ("l3_remote", "set 2 MiB vs raw TCP", Goal::RatioAtLeast(0.7)),
    ("l3_remote", "get 2 MiB vs raw TCP", Goal::RatioAtLeast(0.7)),
    // Issue 64: a fleet routed by kvtier's events against round-robin, in the same run.
    (
        "fleet",
        "fleet of 4 nodes, * requests: reuse, kvtier router against round-robin",
        Goal::RatioAtLeast(2.0),
    ),
    (
        "fleet",
        "fleet of 4 nodes, * requests: reuse against the unbounded ideal, kvtier router",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "fleet",
        "fleet of 4 nodes, * requests: TTFT p99, round-robin over the kvtier router",
        Goal::RatioAtLeast(2.0),
    ),
    (
        "fleet",
        "fleet of 4 nodes, * requests: busiest node's prefill over the mean, kvtier router",
        Goal::ValueAtMost(1.5),
    ),
    (
        "fleet",
        "one node of 8 workers, * requests: throughput, one shared L2 against 8 private L2s",
        Goal::RatioAtLeast(1.56),
    ),
    (
        "fleet",
        "fleet: corrupt pages, every run",
        Goal::ValueAtMost(0.0),
    ),
    // Issue 65: an admission filter keeps the reuse and writes less.
    (
        "sim",
        "replay, l3.admission tinylfu against all: reuse kept",
        Goal::RatioAtLeast(0.98),
    ),
    (
        "sim",
        "replay, l3.admission tinylfu against all: bytes written",
        Goal::ValueAtMost(0.6),
    ),
    // Issue 41: the vLLM connector at engine speed.
    (
        "vllm",
        "scheduler time per waiting request p99, ",
        Goal::ValueAtMost(0.2),
    ),
    (
        "vllm",
        "Save of a decode step's one page, ",
        Goal::ValueAtMost(0.5),
    ),
    (
        "vllm",
        "SaveBatch of a decode step, ",
        Goal::ValueAtMost(0.5),
    ),
    (
        "vllm",
        "connector time per decode step, ",
        Goal::RatioAtLeast(1.0 / 1.5),
    ),
    // The saves' copies run after the step, on the save thread: they keep up at memcpy's
    // pace, within the same factor.
    (
        "vllm",
        "save thread's gather per page, ",
        Goal::RatioAtLeast(1.0 / 1.5),
    ),
    (
        "vllm",
        "decode step while one request loads from a 2 s L3",
        Goal::RatioAtLeast(1.0 / 1.1),
    ),
    // P3: s3 near the raw object_store client.
    (
        "l3_s3",
        "get 2 MiB pages vs object_store get",
        Goal::RatioAtLeast(0.95),
    ),
    // Before the row above it: its figure begins the same way.
    (
        "prefetch",
        "prefetch from file vs its floor",
        Goal::RatioAtLeast(0.9),
    ),
    (
        "prefetch",
        "prefetch 64 x 2 MiB from file",
        Goal::RatioAtLeast(0.85),
    ),
    (
        "sglang",
        "BatchGet 128x1MiB, cold file L3 (io = direct) vs raw O_DIRECT reads",
        Goal::RatioAtLeast(0.85),
    ),
    (
        "sglang",
        "BatchGet 128x1MiB, file L3 vs fs::read",
        Goal::RatioAtLeast(0.85),
    ),
    (
        "sglang",
        "BatchGet 128x1MiB, file L3 vs its floor",
        Goal::RatioAtLeast(0.9),
    ),
    // P8: a put into the shared pool near a one-thread memcpy of the same bytes.
    (
        "peers",
        "put, kvtierd shared memory vs memcpy",
        Goal::RatioAtLeast(0.8),
    ),
];

/// The goal of `row`, if it has one.
pub fn goal(row: &Row) -> Option<Goal> {
    GOALS
        .iter()
        .find(|(s, pattern, _)| *s == row.scenario && matches(&row.figure, pattern))
        .map(|&(_, _, g)| g)
}

fn matches(figure: &str, pattern: &str) -> bool {
    match pattern.split_once('*') {
        Some((pre, post)) => {
            figure.len() >= pre.len() + post.len()
                && figure.starts_with(pre)
                && figure.ends_with(post)
        }
        None => figure.starts_with(pattern),
    }
}

/// Whether `row` meets `goal`, allowing `noise` (a relative spread) in its favour.
pub fn met(row: &Row, goal: Goal, noise: f64) -> bool {
    match goal {
        Goal::RatioAtLeast(min) => row.ratio.is_some_and(|r| r >= min * (1.0 - noise)),
        Goal::ValueAtMost(max) => row.value <= max * (1.0 + noise),
    }
}

/// The run's noise: the median relative spread of the baselines measured more than once
/// (0 when none was).
pub fn run_noise(rows: &[Row]) -> f64 {
    let mut v: Vec<f64> = rows.iter().filter_map(|r| r.noise).collect();
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The rows that miss their goal by more than the run's noise, one line each.
pub fn misses(rows: &[Row]) -> Vec<String> {
    let noise = run_noise(rows);
    rows.iter()
        .filter_map(|r| {
            let g = goal(r)?;
            (!met(r, g, noise)).then(|| {
                let got = match g {
                    Goal::RatioAtLeast(_) => r
                        .ratio
                        .map_or_else(|| "no ratio".into(), |x| format!("ratio {x:.3}")),
                    Goal::ValueAtMost(_) => format!("{:.1} {}", r.value, r.unit),
                };
                format!(
                    "{} / {}: {got}, goal {g} (run noise {:.0}%)",
                    r.scenario,
                    r.figure,
                    noise * 100.0
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(scenario: &str, figure: &str, value: f64, ratio: Option<f64>) -> Row {
        Row {
            scenario: scenario.into(),
            figure: figure.into(),
            value,
            unit: "B".into(),
            baseline: String::new(),
            baseline_value: 0.0,
            ratio,
            noise: None,
        }
    }

    #[test]
    fn rows_meet_or_miss_their_goals_within_the_noise() {
        let fast = row(
            "l3_file",
            "get 2 MiB pages vs std::fs::read",
            1.0,
            Some(0.95),
        );
        let slow = row(
            "l3_file",
            "get 2 MiB pages vs std::fs::read",
            1.0,
            Some(0.5),
        );
        let near = row(
            "l3_file",
            "get 2 MiB pages vs std::fs::read",
            1.0,
            Some(0.88),
        );
        let fat = row(
            "index",
            "L2 HostIndex, 10000 pages: bytes/page",
            282.0,
            None,
        );
        let free = row("keys", "keys P=16 vs sha2 stream", 1.0, Some(0.1));
        assert_eq!(goal(&free), None);
        let evict = row("index", "L2 HostIndex, 10000 pages: evict p50", 220.0, None);
        assert_eq!(
            goal(&evict),
            None,
            "the bytes/page goal is not an eviction's"
        );
        assert!(met(&fast, goal(&fast).unwrap(), 0.0));
        assert!(!met(&slow, goal(&slow).unwrap(), 0.1));
        assert!(!met(&near, goal(&near).unwrap(), 0.0));
        assert!(met(&near, goal(&near).unwrap(), 0.05), "within the noise");
        assert!(!met(&fat, goal(&fat).unwrap(), 0.1));
        let mut noisy = fast.clone();
        noisy.noise = Some(0.05);
        let m = misses(&[fast, slow, near, fat, free, noisy]);
        assert_eq!(m.len(), 2, "{m:#?}");
        assert!(
            m[0].contains("ratio 0.500") && m[0].contains("goal ≥ 0.90"),
            "{}",
            m[0]
        );
        assert!(m[1].contains("282.0 B"), "{}", m[1]);
    }
}
