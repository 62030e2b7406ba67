//! The daemon's metrics, declared in one place, and the Prometheus text endpoint.
//!
//! Names follow `kvtier_<subsystem>_<noun>_<unit>`; counters end in `_total`; durations are
//! `_seconds` histograms; labels are bounded (`op`, `outcome`, `state`). Gauges that mirror the
//! index are refreshed from the state at scrape time, so they can never drift.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::state::HostState;

/// Every metric of kvtierd.
#[derive(Clone)]
pub struct Metrics {
    registry: Registry,
    /// `kvtier_l2_requests_total{op, outcome}`.
    pub requests: IntCounterVec,
    /// `kvtier_l2_request_duration_seconds{op}`.
    pub request_seconds: HistogramVec,
    /// `kvtier_l2_pages_total{op}`: pages reserved, committed, acquired, released, deduplicated, no_space.
    pub pages: IntCounterVec,
    /// `kvtier_l2_evictions_total`.
    pub evictions: IntCounter,
    /// `kvtier_l2_expired_sessions_total`.
    pub expired_sessions: IntCounter,
    /// `kvtier_l2_dropped_pins_total`: pins dropped because a session ended holding them.
    pub dropped_pins: IntCounter,
    /// `kvtier_l2_dropped_reservations_total`.
    pub dropped_reservations: IntCounter,
    /// `kvtier_l3_writes_total{outcome}`: written, present (already in L3), failed, dropped.
    pub l3_writes: IntCounterVec,
    /// `kvtier_l3_write_bytes_total`.
    pub l3_write_bytes: IntCounter,
    /// `kvtier_l3_write_duration_seconds`.
    pub l3_write_seconds: prometheus::Histogram,
    l3_queue: IntGauge,
    l3_objects: IntGauge,
    l3_bytes: IntGauge,
    l3_evictions: IntGauge,
    l3_breaker_open: IntGauge,
    /// `kvtier_l3_backend_ops_total{backend, op, outcome}`.
    pub l3_ops: IntCounterVec,
    /// `kvtier_l3_backend_bytes_total{backend, op}`.
    pub l3_op_bytes: IntCounterVec,
    /// `kvtier_l3_backend_op_duration_seconds{backend, op}`.
    pub l3_op_seconds: HistogramVec,
    pool_bytes: IntGaugeVec,
    pool_pages: IntGaugeVec,
    pinned_pages: IntGauge,
    pins: IntGauge,
    sessions: IntGauge,
    pools: IntGauge,
}

/// Names and help of every metric, for the README and a test that keeps both in step.
pub const METRIC_NAMES: &[&str] = &[
    "kvtier_l2_requests_total",
    "kvtier_l2_request_duration_seconds",
    "kvtier_l2_pages_total",
    "kvtier_l2_evictions_total",
    "kvtier_l2_expired_sessions_total",
    "kvtier_l2_dropped_pins_total",
    "kvtier_l2_dropped_reservations_total",
    "kvtier_l2_pool_bytes",
    "kvtier_l2_pool_pages",
    "kvtier_l2_pinned_pages",
    "kvtier_l2_pins",
    "kvtier_l2_sessions",
    "kvtier_l2_pools",
    "kvtier_l3_writes_total",
    "kvtier_l3_write_bytes_total",
    "kvtier_l3_write_duration_seconds",
    "kvtier_l3_queue_pages",
    "kvtier_l3_objects",
    "kvtier_l3_bytes",
    "kvtier_l3_evicted_objects",
    "kvtier_l3_breaker_open",
    "kvtier_l3_backend_ops_total",
    "kvtier_l3_backend_bytes_total",
    "kvtier_l3_backend_op_duration_seconds",
];

fn reg<T: prometheus::core::Collector + Clone + 'static>(r: &Registry, m: T) -> T {
    // Names are unique constants, so registration cannot collide.
    if let Err(e) = r.register(Box::new(m.clone())) {
        unreachable!("duplicate metric: {e}");
    }
    m
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Result<Self, prometheus::Error> {
        let r = Registry::new();
        let buckets = vec![
            25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
            0.25, 1.0,
        ];
        Ok(Self {
            requests: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_requests_total",
                        "Host-tier RPCs by operation and outcome",
                    ),
                    &["op", "outcome"],
                )?,
            ),
            request_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_l2_request_duration_seconds",
                        "Time to serve a host-tier RPC, by operation",
                    )
                    .buckets(buckets),
                    &["op"],
                )?,
            ),
            pages: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l2_pages_total",
                        "Pages by operation: reserved, deduplicated, no_space, committed, acquired, released",
                    ),
                    &["op"],
                )?,
            ),
            evictions: reg(
                &r,
                IntCounter::new("kvtier_l2_evictions_total", "Pages evicted from L2")?,
            ),
            expired_sessions: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_expired_sessions_total",
                    "Sessions ended because their lease expired",
                )?,
            ),
            dropped_pins: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_dropped_pins_total",
                    "Pins dropped because their session ended holding them",
                )?,
            ),
            dropped_reservations: reg(
                &r,
                IntCounter::new(
                    "kvtier_l2_dropped_reservations_total",
                    "Reserved pages freed because their session ended before committing",
                )?,
            ),
            pool_bytes: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "kvtier_l2_pool_bytes",
                        "Shared-memory pool bytes: total, used",
                    ),
                    &["state"],
                )?,
            ),
            pool_pages: reg(
                &r,
                IntGaugeVec::new(
                    Opts::new(
                        "kvtier_l2_pool_pages",
                        "Pool pages by state: ready, writing, free",
                    ),
                    &["state"],
                )?,
            ),
            pinned_pages: reg(
                &r,
                IntGauge::new("kvtier_l2_pinned_pages", "Pages with at least one pin")?,
            ),
            pins: reg(
                &r,
                IntGauge::new("kvtier_l2_pins", "Pins held, with multiplicity")?,
            ),
            sessions: reg(
                &r,
                IntGauge::new("kvtier_l2_sessions", "Live client sessions")?,
            ),
            pools: reg(
                &r,
                IntGauge::new("kvtier_l2_pools", "Pool classes (layouts) served")?,
            ),
            l3_writes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_writes_total",
                        "Pages sent to L3 by outcome: written, present, failed, dropped",
                    ),
                    &["outcome"],
                )?,
            ),
            l3_write_bytes: reg(
                &r,
                IntCounter::new("kvtier_l3_write_bytes_total", "Page bytes written to L3")?,
            ),
            l3_write_seconds: reg(
                &r,
                prometheus::Histogram::with_opts(
                    HistogramOpts::new(
                        "kvtier_l3_write_duration_seconds",
                        "Time to write one page to L3, retries included",
                    )
                    .buckets(vec![1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
                )?,
            ),
            l3_queue: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_queue_pages",
                    "Pages queued or being written to L3",
                )?,
            ),
            l3_objects: reg(&r, IntGauge::new("kvtier_l3_objects", "Pages held by L3")?),
            l3_bytes: reg(&r, IntGauge::new("kvtier_l3_bytes", "Bytes held by L3")?),
            l3_evictions: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_evicted_objects",
                    "Pages L3 evicted to honour its capacity since start",
                )?,
            ),
            l3_breaker_open: reg(
                &r,
                IntGauge::new(
                    "kvtier_l3_breaker_open",
                    "1 while the L3 backend's circuit breaker is open or probing",
                )?,
            ),
            l3_ops: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_backend_ops_total",
                        "Calls to the L3 backend by operation and outcome (hit, miss, ok, or the error reason)",
                    ),
                    &["backend", "op", "outcome"],
                )?,
            ),
            l3_op_bytes: reg(
                &r,
                IntCounterVec::new(
                    Opts::new(
                        "kvtier_l3_backend_bytes_total",
                        "Bytes moved by L3 backend calls",
                    ),
                    &["backend", "op"],
                )?,
            ),
            l3_op_seconds: reg(
                &r,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvtier_l3_backend_op_duration_seconds",
                        "Time of one L3 backend call",
                    )
                    .buckets(vec![1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0]),
                    &["backend", "op"],
                )?,
            ),
            registry: r,
        })
    }

    /// Refreshes the gauges from the state and renders the text format.
    pub fn render(&self, state: &Mutex<HostState>, l3: Option<&crate::l3::L3>) -> String {
        if let Some(l3) = l3 {
            let st = l3.store.store_stats();
            self.l3_objects.set(st.objects as i64);
            self.l3_bytes.set(st.bytes as i64);
            self.l3_evictions.set(st.evictions as i64);
            self.l3_breaker_open.set(i64::from(l3.breaker_open()));
            self.l3_queue.set(
                l3.counters
                    .queued
                    .load(std::sync::atomic::Ordering::Relaxed) as i64,
            );
        }
        {
            let st = crate::lock(state);
            let t = st.totals();
            let (total, used) = st.pool_bytes();
            self.pool_bytes
                .with_label_values(&["total"])
                .set(total as i64);
            self.pool_bytes
                .with_label_values(&["used"])
                .set(used as i64);
            self.pool_pages
                .with_label_values(&["ready"])
                .set(i64::from(t.ready));
            self.pool_pages
                .with_label_values(&["writing"])
                .set(i64::from(t.writing));
            self.pool_pages
                .with_label_values(&["free"])
                .set(i64::from(t.capacity - t.ready - t.writing));
            self.pinned_pages.set(i64::from(t.pinned));
            self.pins.set(t.pins as i64);
            self.sessions.set(st.sessions().count() as i64);
            self.pools.set(st.pools().count() as i64);
            // Session-end counters live in the state (the sweeper has no metrics handle); bring
            // the exported counters up to them.
            let c = st.counters;
            for (counter, total) in [
                (&self.expired_sessions, c.expired_sessions),
                (&self.dropped_pins, c.dropped_pins),
                (&self.dropped_reservations, c.dropped_reservations),
            ] {
                counter.inc_by(total.saturating_sub(counter.get()));
            }
        }
        let mut buf = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!("encoding metrics failed: {e}");
        }
        String::from_utf8(buf).unwrap_or_default()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl kvtier_storage::wrappers::StoreObserver for Metrics {
    fn observe(
        &self,
        backend: &'static str,
        op: &'static str,
        outcome: &'static str,
        bytes: u64,
        seconds: f64,
    ) {
        self.l3_ops.with_label_values(&[backend, op, outcome]).inc();
        if bytes > 0 {
            self.l3_op_bytes
                .with_label_values(&[backend, op])
                .inc_by(bytes);
        }
        self.l3_op_seconds
            .with_label_values(&[backend, op])
            .observe(seconds);
    }
}

/// Serves `GET /metrics` on `listener` until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    metrics: Metrics,
    state: Arc<Mutex<HostState>>,
    l3: Arc<crate::l3::L3Slot>,
    shutdown: CancellationToken,
) {
    loop {
        let (stream, _) = tokio::select! {
            () = shutdown.cancelled() => return,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("metrics accept failed: {e}");
                    continue;
                }
            },
        };
        let metrics = metrics.clone();
        let state = state.clone();
        let l3 = l3.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let body = if req.uri().path() == "/metrics" {
                    Some(metrics.render(&state, l3.current().as_deref()))
                } else {
                    None
                };
                async move {
                    match body {
                        Some(text) => Response::builder()
                            .header("content-type", "text/plain; version=0.0.4")
                            .body(Full::new(Bytes::from(text))),
                        None => Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"try /metrics\n"))),
                    }
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc);
            if let Err(e) = conn.await {
                tracing::debug!("metrics connection: {e}");
            }
        });
    }
}

/// The address a listener is bound to, for logs and the ready line.
pub fn local(listener: &TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_registered_and_listed_in_the_readme() {
        let m = Metrics::new().unwrap();
        // Touch the labelled families so they appear in the output.
        m.requests.with_label_values(&["x", "ok"]).inc();
        m.request_seconds.with_label_values(&["x"]).observe(0.0);
        m.pages.with_label_values(&["x"]).inc();
        m.l3_writes.with_label_values(&["x"]).inc();
        m.l3_ops.with_label_values(&["x", "y", "z"]).inc();
        m.l3_op_bytes.with_label_values(&["x", "y"]).inc();
        m.l3_op_seconds.with_label_values(&["x", "y"]).observe(0.0);
        let cfg = kvtier_config::daemon::DaemonConfig::default();
        let state = Mutex::new(HostState::new(&cfg));
        let store: Arc<dyn kvtier_storage::Store> =
            Arc::new(kvtier_storage::memory::MemoryStore::new());
        let (l3, _writer) = crate::l3::L3::new(store, &cfg, Arc::new(m.clone()));
        let text = m.render(&state, Some(&l3));
        let readme = include_str!("../../../README.md");
        for name in METRIC_NAMES {
            assert!(
                text.contains(&format!("# TYPE {name} ")),
                "{name} not exported"
            );
            assert!(
                readme.contains(&format!("`{name}`")),
                "{name} not listed in README.md"
            );
        }
        let exported = text.lines().filter(|l| l.starts_with("# TYPE ")).count();
        assert_eq!(
            exported,
            METRIC_NAMES.len(),
            "METRIC_NAMES is missing a metric"
        );
    }
}
