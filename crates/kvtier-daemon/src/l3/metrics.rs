//! The storage tier's metrics: the writer's outcomes, every backend call (through the
//! [`StoreObserver`] the tier's `Metered` wrapper reports to), and gauges of the attached
//! tier (holdings, queue, breaker, read window), refreshed at scrape time.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use kvtier_server::metrics::{GBPS_BUCKETS, IO_BUCKETS, MetricRegistry, Result, catch_up};
use kvtier_storage::TenantBytes;
use kvtier_storage::wrappers::StoreObserver;
use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use super::{L3, L3Slot};

/// Series of the storage tier.
#[derive(Clone, Debug)]
pub struct L3Metrics {
    /// Pages sent to L3 by outcome.
    pub writes: IntCounterVec,
    /// Page bytes written.
    pub write_bytes: IntCounter,
    /// Time to write one page, retries included.
    pub write_seconds: Histogram,
    /// Backup bandwidth of each written page.
    pub write_bandwidth: Histogram,
    ops: IntCounterVec,
    op_bytes: IntCounterVec,
    op_seconds: HistogramVec,
    queue: IntGauge,
    objects: IntGauge,
    bytes: IntGauge,
    capacity: IntGauge,
    evictions: IntGauge,
    breaker_open: IntGauge,
    breaker_transitions: IntCounterVec,
    retries: IntCounterVec,
    read_window: IntGauge,
    tenant_bytes: IntGaugeVec,
    tenant_quota_bytes: IntGaugeVec,
    tenant_quota_evictions: IntCounterVec,
}

impl L3Metrics {
    /// Declares the series in `r`, with known label values at zero.
    pub fn new(r: &MetricRegistry) -> Result<Self> {
        let m = Self {
            writes: r.counter_vec(
                "kvtier_l3_writes_total",
                "Pages sent to L3 by outcome: written, present, failed, deferred",
                &["outcome"],
            )?,
            write_bytes: r.counter("kvtier_l3_write_bytes_total", "Page bytes written to L3")?,
            write_seconds: r.histogram(
                "kvtier_l3_write_duration_seconds",
                "Time to write one page to L3, retries included",
                IO_BUCKETS,
            )?,
            queue: r.gauge(
                "kvtier_l3_queue_pages",
                "Pages queued or being written to L3",
            )?,
            objects: r.gauge("kvtier_l3_objects", "Pages held by L3")?,
            bytes: r.gauge("kvtier_l3_bytes", "Bytes held by L3")?,
            capacity: r.gauge(
                "kvtier_l3_capacity_bytes",
                "Most bytes L3 keeps before it evicts (0: no bound, or not known to kvtierd)",
            )?,
            evictions: r.gauge(
                "kvtier_l3_evicted_objects",
                "Pages L3 evicted to honour its capacity since start",
            )?,
            breaker_open: r.gauge(
                "kvtier_l3_breaker_open",
                "1 while the L3 backend's circuit breaker is open or probing",
            )?,
            breaker_transitions: r.counter_vec(
                "kvtier_l3_breaker_transitions_total",
                "L3 circuit breaker transitions: to=open (sustained failure), half_open (a \
                 probe let through), closed (a probe succeeded)",
                &["to"],
            )?,
            retries: r.counter_vec(
                "kvtier_l3_retries_total",
                "Retries of L3 backend calls after a transient failure: outcome=retried \
                 (attempts), saved (calls a retry turned into success)",
                &["outcome"],
            )?,
            read_window: r.gauge(
                "kvtier_l3_read_window",
                "Reads a prefetch keeps in flight against L3 now, learnt from their latencies \
                 (between prefetch.concurrency and prefetch.max_concurrency)",
            )?,
            ops: r.counter_vec(
                "kvtier_l3_backend_ops_total",
                "Calls to the L3 backend by operation and outcome (hit, miss, ok, or the error \
                 reason)",
                &["backend", "op", "outcome"],
            )?,
            op_bytes: r.counter_vec(
                "kvtier_l3_backend_bytes_total",
                "Bytes moved by L3 backend calls",
                &["backend", "op"],
            )?,
            op_seconds: r.histogram_vec(
                "kvtier_l3_backend_op_duration_seconds",
                "Time of one L3 backend call",
                &["backend", "op"],
                IO_BUCKETS,
            )?,
            write_bandwidth: r.histogram(
                "kvtier_l3_write_bandwidth_gigabytes_per_second",
                "Backup (L2 to L3) bandwidth of each written page, in GB/s",
                GBPS_BUCKETS,
            )?,
            tenant_bytes: r.gauge_vec(
                "kvtier_tenant_l3_bytes",
                "Bytes each tenant holds in L3 (file and rocksdb backends; tenancy on)",
                &["tenant"],
            )?,
            tenant_quota_bytes: r.gauge_vec(
                "kvtier_tenant_l3_quota_bytes",
                "Most bytes each tenant may hold in L3 (0: no quota)",
                &["tenant"],
            )?,
            tenant_quota_evictions: r.counter_vec(
                "kvtier_tenant_l3_quota_evictions_total",
                "A tenant's own L3 objects evicted to keep it within its quota",
                &["tenant"],
            )?,
        };
        for outcome in ["written", "present", "failed", "deferred"] {
            m.writes.with_label_values(&[outcome]);
        }
        for to in ["open", "half_open", "closed"] {
            m.breaker_transitions.with_label_values(&[to]);
        }
        for outcome in ["retried", "saved"] {
            m.retries.with_label_values(&[outcome]);
        }
        Ok(m)
    }

    /// Refreshes the tier gauges from whatever tier `slot` holds at each scrape.
    pub fn watch(&self, r: &MetricRegistry, slot: &Arc<L3Slot>) {
        let (me, slot): (Self, Weak<L3Slot>) = (self.clone(), Arc::downgrade(slot));
        r.on_scrape(move || {
            let Some(slot) = slot.upgrade() else { return };
            if let Some(l3) = slot.current() {
                let held = me.refresh(&l3);
                let names = slot.state.lock().tenant_names();
                me.refresh_tenants(&held, &names);
            }
        });
    }

    /// Per tracked tenant (`names`: tag and name), from the backend's own accounting.
    fn refresh_tenants(&self, held: &[TenantBytes], names: &[(kvtier_core::TenantTag, String)]) {
        for (tag, name) in names {
            let t = held
                .iter()
                .find(|t| t.tag == *tag)
                .cloned()
                .unwrap_or_default();
            let label = [name.as_str()];
            self.tenant_bytes
                .with_label_values(&label)
                .set(t.bytes as i64);
            self.tenant_quota_bytes
                .with_label_values(&label)
                .set(t.quota as i64);
            catch_up(
                &self.tenant_quota_evictions.with_label_values(&label),
                t.evictions,
            );
        }
    }

    /// Refreshes the tier gauges; returns what the backend holds per tenant.
    fn refresh(&self, l3: &L3) -> Vec<TenantBytes> {
        let st = l3.store.store_stats();
        self.objects.set(st.objects as i64);
        self.bytes.set(st.bytes as i64);
        self.capacity.set(st.capacity as i64);
        self.evictions.set(st.evictions as i64);
        self.breaker_open.set(i64::from(l3.breaker_open()));
        let (b, r) = (l3.breaker.counts(), l3.retrying.counts());
        for (to, n) in [
            ("open", b.opened),
            ("half_open", b.probes),
            ("closed", b.closed),
        ] {
            catch_up(&self.breaker_transitions.with_label_values(&[to]), n);
        }
        catch_up(&self.retries.with_label_values(&["retried"]), r.retries);
        catch_up(&self.retries.with_label_values(&["saved"]), r.saved);
        let window = l3.read_window.lock().limit();
        self.read_window.set(window as i64);
        self.queue
            .set(l3.counters.queued.load(Ordering::Relaxed) as i64);
        st.tenants
    }
}

impl StoreObserver for L3Metrics {
    fn observe(
        &self,
        backend: &'static str,
        op: &'static str,
        outcome: &'static str,
        bytes: u64,
        seconds: f64,
    ) {
        self.ops.with_label_values(&[backend, op, outcome]).inc();
        if bytes > 0 {
            self.op_bytes
                .with_label_values(&[backend, op])
                .inc_by(bytes);
        }
        self.op_seconds
            .with_label_values(&[backend, op])
            .observe(seconds);
    }
}
