//! One metrics registry per process, shared by its components.
//!
//! Each component (the host service, L3, prefetch, the SGLang protocol, the agent) declares
//! its own series through a [`MetricRegistry`] when it is built, keeps the handles, and
//! registers a scrape hook when some of its gauges mirror state that only it can read. The
//! registry remembers every declaration (name, type, labels), so the names exist in exactly
//! one place in the code, and [`MetricRegistry::check_documented`] holds docs/metrics.md to
//! them.
//!
//! Names follow `kvtier_<subsystem>_<noun>_<unit>`; counters end in `_total`; durations are
//! `_seconds` histograms; labels are bounded.

use parking_lot::Mutex;
use std::sync::Arc;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Buckets of bandwidth histograms, in GB/s (10^9 bytes per second).
pub const GBPS_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0,
];

/// Buckets of RPC latency histograms, in seconds.
pub const RPC_BUCKETS: &[f64] = &[
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.25, 1.0,
];

/// Buckets of storage-call latency histograms, in seconds.
pub const IO_BUCKETS: &[f64] = &[1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0];

/// One declared metric: what docs/metrics.md must list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    /// Its name.
    pub name: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: &'static str,
    /// Its label names, in order.
    pub labels: Vec<String>,
}

type Hook = Box<dyn Fn() + Send + Sync>;

/// The process's registry: declares series, runs scrape hooks, renders.
#[derive(Clone, Default)]
pub struct MetricRegistry {
    registry: Registry,
    declared: Arc<Mutex<Vec<Declared>>>,
    hooks: Arc<Mutex<Vec<Hook>>>,
}

impl std::fmt::Debug for MetricRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricRegistry")
            .field("declared", &self.declared.lock().len())
            .finish_non_exhaustive()
    }
}

/// The result of declaring a metric: a name used twice, or an invalid name or label.
pub type Result<T> = std::result::Result<T, prometheus::Error>;

impl MetricRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn add<T: prometheus::core::Collector + Clone + 'static>(
        &self,
        m: T,
        kind: &'static str,
        labels: &[&str],
    ) -> Result<T> {
        let name = m
            .desc()
            .first()
            .map(|d| d.fq_name.clone())
            .unwrap_or_default();
        self.registry.register(Box::new(m.clone()))?;
        self.declared.lock().push(Declared {
            name,
            kind,
            labels: labels.iter().map(|l| l.to_string()).collect(),
        });
        Ok(m)
    }

    /// A counter.
    pub fn counter(&self, name: &str, help: &str) -> Result<IntCounter> {
        self.add(IntCounter::new(name, help)?, "counter", &[])
    }

    /// A counter with labels.
    pub fn counter_vec(&self, name: &str, help: &str, labels: &[&str]) -> Result<IntCounterVec> {
        self.add(
            IntCounterVec::new(Opts::new(name, help), labels)?,
            "counter",
            labels,
        )
    }

    /// A gauge.
    pub fn gauge(&self, name: &str, help: &str) -> Result<IntGauge> {
        self.add(IntGauge::new(name, help)?, "gauge", &[])
    }

    /// A gauge of a fractional value (a ratio).
    pub fn ratio_gauge(&self, name: &str, help: &str) -> Result<prometheus::Gauge> {
        self.add(prometheus::Gauge::new(name, help)?, "gauge", &[])
    }

    /// A gauge with labels.
    pub fn gauge_vec(&self, name: &str, help: &str, labels: &[&str]) -> Result<IntGaugeVec> {
        self.add(
            IntGaugeVec::new(Opts::new(name, help), labels)?,
            "gauge",
            labels,
        )
    }

    /// A histogram with the given bucket bounds.
    pub fn histogram(&self, name: &str, help: &str, buckets: &[f64]) -> Result<Histogram> {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(Histogram::with_opts(opts)?, "histogram", &[])
    }

    /// A histogram with labels.
    pub fn histogram_vec(
        &self,
        name: &str,
        help: &str,
        labels: &[&str],
        buckets: &[f64],
    ) -> Result<HistogramVec> {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        self.add(HistogramVec::new(opts, labels)?, "histogram", labels)
    }

    /// Runs `hook` before every scrape: for gauges (or counters kept elsewhere) that mirror
    /// state, refreshed when read so they never drift. The hook must not block for long.
    pub fn on_scrape(&self, hook: impl Fn() + Send + Sync + 'static) {
        self.hooks.lock().push(Box::new(hook));
    }

    /// Runs the scrape hooks and returns every metric family: what both the Prometheus
    /// endpoint and kvtierd's `WatchMetrics` send.
    pub fn gather(&self) -> Vec<prometheus::proto::MetricFamily> {
        for hook in self.hooks.lock().iter() {
            hook();
        }
        self.registry.gather()
    }

    /// The Prometheus text format of [`Self::gather`].
    pub fn render(&self) -> String {
        self.render_where(|_| true)
    }

    /// [`Self::render`] of the families whose name `keep` keeps.
    pub fn render_where(&self, keep: impl Fn(&str) -> bool) -> String {
        let mut families = self.gather();
        families.retain(|f| keep(f.name()));
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&families, &mut buf) {
            tracing::error!("encoding metrics failed: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }

    /// Every metric declared so far.
    pub fn declared(&self) -> Vec<Declared> {
        self.declared.lock().clone()
    }

    /// Checks `doc` (docs/metrics.md) against the declarations: each declared metric has a
    /// row `` | `name` | type | labels | `` with its type, whose labels cell names each label
    /// (in backticks, in order; it may list their values too) and is empty for a metric
    /// without labels; and each row for a name that `owns` accepts is declared. Returns
    /// every disagreement.
    pub fn check_documented(&self, doc: &str, owns: impl Fn(&str) -> bool) -> Vec<String> {
        let rows: Vec<(String, String, String)> = doc
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                Some((
                    name.to_string(),
                    cells.get(2)?.to_string(),
                    cells.get(3)?.to_string(),
                ))
            })
            .collect();
        let declared = self.declared();
        let mut wrong = Vec::new();
        for d in &declared {
            let Some((_, kind, cell)) = rows.iter().find(|(n, _, _)| *n == d.name) else {
                wrong.push(format!("{} is not listed in docs/metrics.md", d.name));
                continue;
            };
            if kind != d.kind {
                wrong.push(format!(
                    "{} is a {}, documented as {kind:?}",
                    d.name, d.kind
                ));
            }
            if !labels_named(cell, &d.labels) {
                wrong.push(format!(
                    "{} has labels {:?}; docs/metrics.md says {cell:?}",
                    d.name, d.labels
                ));
            }
        }
        for (name, _, _) in rows.iter().filter(|(n, _, _)| owns(n)) {
            if !declared.iter().any(|d| d.name == *name) {
                wrong.push(format!(
                    "docs/metrics.md lists {name}, which is not declared"
                ));
            }
        }
        wrong
    }
}

/// Whether a docs labels cell names `labels` in order (empty for none).
fn labels_named(cell: &str, labels: &[String]) -> bool {
    if labels.is_empty() {
        return cell.is_empty();
    }
    let mut rest = cell;
    labels.iter().all(|l| {
        let tick = format!("`{l}`");
        match rest.find(&tick) {
            Some(i) => {
                rest = &rest[i + tick.len()..];
                true
            }
            None => false,
        }
    })
}

/// Brings an exported counter up to a total kept elsewhere (counters never go down).
pub fn catch_up(counter: &IntCounter, total: u64) {
    counter.inc_by(total.saturating_sub(counter.get()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declarations_are_recorded_hooks_run_and_duplicates_fail() {
        let r = MetricRegistry::new();
        let g = r.gauge("kvtier_test_things", "Things").unwrap();
        let c = r
            .counter_vec("kvtier_test_events_total", "Events", &["kind"])
            .unwrap();
        c.with_label_values(&["a"]).inc();
        let g2 = g.clone();
        r.on_scrape(move || g2.set(7));
        let text = r.render();
        assert!(text.contains("kvtier_test_things 7"), "{text}");
        assert!(
            text.contains("kvtier_test_events_total{kind=\"a\"} 1"),
            "{text}"
        );
        assert!(r.gauge("kvtier_test_things", "again").is_err());
        let doc = "| `kvtier_test_things` | gauge | | things |\n\
                   | `kvtier_test_events_total` | counter | `kind` | events |\n";
        assert!(r.check_documented(doc, |_| true).is_empty());
        let with_values = "| `kvtier_test_things` | gauge | | things |\n\
                   | `kvtier_test_events_total` | counter | `kind` = `a`, `b` | events |\n";
        assert!(r.check_documented(with_values, |_| true).is_empty());
        let bad = "| `kvtier_test_things` | counter | | things |\n\
                   | `kvtier_test_events_total` | counter | `other` | events |\n\
                   | `kvtier_test_gone` | gauge | | gone |\n";
        let wrong = r.check_documented(bad, |n| n.starts_with("kvtier_test_"));
        assert_eq!(wrong.len(), 3, "{wrong:?}");
        let c2 = IntCounter::new("x", "x").unwrap();
        catch_up(&c2, 5);
        catch_up(&c2, 3);
        assert_eq!(c2.get(), 5);
    }
}
