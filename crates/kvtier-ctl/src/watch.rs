//! `kvtierctl watch`: a live view of a running kvtierd, one screen per `WatchMetrics`
//! snapshot, with rates between consecutive snapshots.

use std::fmt::Write as _;

use anyhow::{Context, Result, bail};

use crate::WatchArgs;

/// `kvtierctl watch`: streams snapshots and writes one view per snapshot to `out` (clearing
/// the screen first when `redraw`). Returns on Ctrl-C or after `count` views; fails when the
/// daemon cannot be reached or goes away.
pub fn watch(a: &WatchArgs, redraw: bool, out: &mut dyn std::io::Write) -> Result<()> {
    use kvtier_proto::v1::MetricsSnapshot;
    crate::with_host(&a.socket, |mut c| async move {
        let mut stream = c
            .watch_metrics(std::time::Duration::from_millis(a.interval_ms))
            .await
            .with_context(|| format!("asking kvtierd at {} for metrics", a.socket))?;
        let ctrl_c = tokio::signal::ctrl_c();
        tokio::pin!(ctrl_c);
        let mut prev: Option<MetricsSnapshot> = None;
        let mut shown = 0;
        loop {
            let next = tokio::select! {
                _ = &mut ctrl_c => return Ok(()),
                m = stream.message() => m,
            };
            let snap = match next {
                Ok(Some(s)) => s,
                Ok(None) => bail!("kvtierd at {} went away (it closed the stream)", a.socket),
                Err(e) => bail!("kvtierd at {} went away: {}", a.socket, e.message()),
            };
            let view = render_view(&a.socket, &snap, prev.as_ref());
            if redraw {
                // Home the cursor and clear the screen, then draw.
                write!(out, "\x1b[H\x1b[2J{view}")?;
            } else {
                writeln!(out, "{view}")?;
            }
            out.flush()?;
            prev = Some(snap);
            shown += 1;
            if a.count > 0 && shown >= a.count {
                return Ok(());
            }
        }
    })
}

/// Figures of one snapshot, looked up by metric name and labels.
struct Figures<'a>(&'a kvtier_proto::v1::MetricsSnapshot);

impl Figures<'_> {
    /// Sum of the values of `name`'s series whose labels include every `want` pair.
    fn sum(&self, name: &str, want: &[(&str, &str)]) -> f64 {
        self.0
            .samples
            .iter()
            .filter(|s| s.name == name)
            .filter(|s| {
                want.iter()
                    .all(|(k, v)| s.labels.iter().any(|l| l.name == *k && l.value == *v))
            })
            .map(|s| s.value)
            // An empty f64 sum is -0.0, which would print as "-0".
            .fold(0.0, |a, b| a + b)
    }

    /// Sum of `name`'s histogram observation counts and sums.
    fn hist(&self, name: &str) -> (f64, f64) {
        self.0
            .samples
            .iter()
            .filter(|s| s.name == name)
            .fold((0.0, 0.0), |(c, s), x| (c + x.count as f64, s + x.sum))
    }

    /// The value of label `label` on the first series of `name`.
    fn label(&self, name: &str, label: &str) -> Option<String> {
        self.0
            .samples
            .iter()
            .filter(|s| s.name == name)
            .flat_map(|s| s.labels.iter())
            .find(|l| l.name == label)
            .map(|l| l.value.clone())
    }
}

fn human_bytes(b: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

fn pct(part: f64, total: f64) -> String {
    if total > 0.0 {
        format!("{:.1}%", 100.0 * part / total)
    } else {
        "-".to_string()
    }
}

/// One view of the daemon from a snapshot; rates come from the previous snapshot (shown as
/// totals since start when there is none yet).
pub fn render_view(
    target: &str,
    snap: &kvtier_proto::v1::MetricsSnapshot,
    prev: Option<&kvtier_proto::v1::MetricsSnapshot>,
) -> String {
    let now = Figures(snap);
    let before = prev.map(Figures);
    let dt = prev
        .map(|p| snap.unix_ms.saturating_sub(p.unix_ms) as f64 / 1000.0)
        .filter(|&d| d > 0.0);
    // Per second since the previous snapshot, or the total so far on the first view.
    let rate = |name: &str, want: &[(&str, &str)]| -> f64 {
        let cur = now.sum(name, want);
        match (&before, dt) {
            (Some(b), Some(dt)) => (cur - b.sum(name, want)).max(0.0) / dt,
            _ => cur,
        }
    };
    let per = if dt.is_some() { "/s" } else { " total" };
    let mut o = String::new();
    let up = snap.uptime_ms / 1000;
    let _ = writeln!(
        o,
        "kvtierd at {target}   up {}h{:02}m{:02}s   snapshot #{}",
        up / 3600,
        up / 60 % 60,
        up % 60,
        snap.seq
    );
    let g = |name: &str, want: &[(&str, &str)]| now.sum(name, want);
    let _ = writeln!(
        o,
        "L2        pools {}  sessions {}  pages ready {} writing {} free {}  pinned {}  used {} of {}",
        g("kvtier_l2_pools", &[]),
        g("kvtier_l2_sessions", &[]),
        g("kvtier_l2_pool_pages", &[("state", "ready")]),
        g("kvtier_l2_pool_pages", &[("state", "writing")]),
        g("kvtier_l2_pool_pages", &[("state", "free")]),
        g("kvtier_l2_pinned_pages", &[]),
        human_bytes(g("kvtier_l2_pool_bytes", &[("state", "used")])),
        human_bytes(g("kvtier_l2_pool_bytes", &[("state", "total")])),
    );
    let (l2, l3, miss, unchecked) = (
        rate("kvtier_lookup_pages_total", &[("tier", "l2")]),
        rate("kvtier_lookup_pages_total", &[("tier", "l3")]),
        rate("kvtier_lookup_pages_total", &[("tier", "miss")]),
        rate("kvtier_lookup_pages_total", &[("tier", "unchecked")]),
    );
    let looked = l2 + l3 + miss + unchecked;
    let _ = writeln!(
        o,
        "lookups   {looked:.0} pages{per}   hit L2 {}  L3 {}  miss {}  unchecked {}",
        pct(l2, looked),
        pct(l3, looked),
        pct(miss, looked),
        pct(unchecked, looked),
    );
    let req = |outcome: &str| rate("kvtier_prefetch_requests_total", &[("outcome", outcome)]);
    let landed_bytes = rate("kvtier_prefetch_bytes_total", &[("stage", "landed")]);
    let _ = writeln!(
        o,
        "prefetch  in flight {}  budget {}/{} pages  landed {:.0} pages{per} {}{per}  negative keys {}",
        g("kvtier_prefetch_inflight", &[]),
        g("kvtier_prefetch_budget_pages", &[("state", "used")]),
        g("kvtier_prefetch_budget_pages", &[("state", "limit")]),
        rate("kvtier_prefetch_pages_total", &[("stage", "landed")]),
        human_bytes(landed_bytes),
        g("kvtier_prefetch_negative_keys", &[]),
    );
    let _ = writeln!(
        o,
        "          requests{per}: completed {:.1}  partial {:.1}  timed_out {:.1}  revoked {:.1}  failed {:.1}",
        req("completed"),
        req("partial"),
        req("timed_out"),
        req("revoked"),
        req("failed"),
    );
    let (n, sum) = now.hist("kvtier_prefetch_duration_seconds");
    let (wn, wsum) = now.hist("kvtier_prefetch_wait_seconds");
    let mean_ms = |n: f64, s: f64| {
        if n > 0.0 {
            format!("{:.1} ms", 1000.0 * s / n)
        } else {
            "-".into()
        }
    };
    let _ = writeln!(
        o,
        "          mean duration {}  mean take wait {}",
        mean_ms(n, sum),
        mean_ms(wn, wsum)
    );
    let w = |outcome: &str| rate("kvtier_l3_writes_total", &[("outcome", outcome)]);
    let _ = writeln!(
        o,
        "backup    written {:.0} pages{per} {}{per}  queue {} pages  deferred {:.0}{per}  failed {:.0}{per}  lost {:.0}{per}",
        w("written"),
        human_bytes(rate("kvtier_l3_write_bytes_total", &[])),
        g("kvtier_l3_queue_pages", &[]),
        w("deferred"),
        w("failed"),
        rate("kvtier_l2_lost_pages_total", &[]),
    );
    match now.label("kvtier_l3_backend_ops_total", "backend") {
        Some(backend) => {
            let breaker = if g("kvtier_l3_breaker_open", &[]) > 0.0 {
                "OPEN"
            } else {
                "closed"
            };
            let ops = |op: &str| rate("kvtier_l3_backend_ops_total", &[("op", op)]);
            let _ = writeln!(
                o,
                "L3        {backend}  objects {}  {}  breaker {breaker}  gets {:.0}{per}  sets {:.0}{per}  exists {:.0}{per}",
                g("kvtier_l3_objects", &[]),
                human_bytes(g("kvtier_l3_bytes", &[])),
                ops("get"),
                ops("set"),
                ops("exists") + ops("exists_prefix"),
            );
        }
        None => {
            let _ = writeln!(
                o,
                "L3        no backend calls yet  objects {}  breaker {}",
                g("kvtier_l3_objects", &[]),
                if g("kvtier_l3_breaker_open", &[]) > 0.0 {
                    "OPEN"
                } else {
                    "closed"
                }
            );
        }
    }
    // SGLang's HiCache RPC clients, once there are any.
    let sglang_ops = now.sum("kvtier_sglang_transfers_total", &[]);
    if g("kvtier_sglang_pools", &[]) > 0.0 || sglang_ops > 0.0 {
        let t = |op: &str| rate("kvtier_sglang_transfers_total", &[("op", op)]);
        let ok = |op: &str| {
            rate(
                "kvtier_sglang_transfers_total",
                &[("op", op), ("outcome", "ok")],
            )
        };
        let hit = |tier: &str| rate("kvtier_sglang_hits_total", &[("op", "get"), ("tier", tier)]);
        let (mem, l3) = (hit("memory"), hit("l3"));
        let errors = t("put") - ok("put") + t("get")
            - ok("get")
            - rate(
                "kvtier_sglang_transfers_total",
                &[("op", "get"), ("outcome", "not_found")],
            );
        let _ = writeln!(
            o,
            "sglang    pools {}  puts {:.0}{per} {}{per}  gets {:.0}{per} {}{per} (memory {}  L3 {})  not found {:.0}{per}  errors {:.0}{per}  memory {} in {} objects",
            g("kvtier_sglang_pools", &[]),
            ok("put"),
            human_bytes(rate("kvtier_sglang_bytes_total", &[("op", "put")])),
            ok("get"),
            human_bytes(rate("kvtier_sglang_bytes_total", &[("op", "get")])),
            pct(mem, mem + l3),
            pct(l3, mem + l3),
            rate(
                "kvtier_sglang_transfers_total",
                &[("op", "get"), ("outcome", "not_found")],
            ),
            errors.max(0.0),
            human_bytes(g("kvtier_sglang_memory_bytes", &[])),
            g("kvtier_sglang_memory_objects", &[]),
        );
    }
    let rpc = |op: &str| rate("kvtier_l2_requests_total", &[("op", op)]);
    let _ = writeln!(
        o,
        "RPCs{per}   lookup {:.0}  reserve {:.0}  commit {:.0}  acquire {:.0}  release {:.0}  prefetch {:.0}  take {:.0}",
        rpc("lookup"),
        rpc("reserve"),
        rpc("commit"),
        rpc("acquire"),
        rpc("release"),
        rpc("prefetch"),
        rpc("take_prefetch"),
    );
    o
}
