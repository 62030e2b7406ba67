//! The host tier's (L2's) metrics: its RPCs and pages, and gauges that mirror the pools and
//! sessions, refreshed from [`HostState`] at scrape time so they never drift. Counters the
//! state keeps itself (session ends, losses, takeover, seals: the sweeper and sealer have no
//! metrics handle) are brought up to its totals at scrape time too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::PageKey;
use kvtier_core::hit_ceiling::HitCeiling;
use kvtier_server::metrics::{MetricRegistry, RPC_BUCKETS, Result, catch_up};
use parking_lot::Mutex;
use prometheus::{Gauge, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};

use super::HostState;
use crate::state::Shared;

/// Series of the host tier.
#[derive(Clone, Debug)]
pub struct L2Metrics {
    /// Host-tier RPCs by operation and outcome.
    pub requests: IntCounterVec,
    /// Time to serve a host-tier RPC, by operation.
    pub request_seconds: HistogramVec,
    /// Pages by operation.
    pub pages: IntCounterVec,
    /// Pages evicted from L2.
    pub evictions: IntCounter,
    /// Looked-up pages by where they were found.
    pub lookup_pages: IntCounterVec,
    /// What share of the looked-up pages a cache without bound could have hit (none until
    /// [`Self::set_hit_ceiling_window`]).
    hit_ceiling: Arc<Mutex<Option<HitCeiling>>>,
    hit_ceiling_ratio: Gauge,
    expired_sessions: IntCounter,
    dropped_pins: IntCounter,
    dropped_reservations: IntCounter,
    lost_pages: IntCounterVec,
    admission_pages: IntCounterVec,
    declined_pages: IntCounter,
    declined_bytes: IntCounter,
    takeover_pages: IntCounterVec,
    takeover_pools: IntCounterVec,
    sealed_pages: IntCounter,
    sealed_from_reads: IntCounter,
    pools_reclaimed: IntCounter,
    pools_damaged: IntCounter,
    cleared_pages: IntCounter,
    draining: IntGauge,
    pool_bytes: IntGaugeVec,
    pool_pages: IntGaugeVec,
    dirty_pages: IntGauge,
    pinned_pages: IntGauge,
    pins: IntGauge,
    sessions: IntGauge,
    pools: IntGauge,
    tenant_pages: IntGaugeVec,
    tenant_quota_pages: IntGaugeVec,
    tenant_quota: IntCounterVec,
}

impl L2Metrics {
    /// Declares the series in `r`, with known label values at zero, and refreshes the
    /// mirrored ones from `state` at each scrape.
    pub fn new(r: &MetricRegistry, state: Arc<Shared>) -> Result<Self> {
        let m = Self {
            hit_ceiling: Arc::default(),
            hit_ceiling_ratio: r.ratio_gauge(
                "kvtier_lookup_hit_ceiling_ratio",
                "Share of the pages looked up within metrics.hit_ceiling_window (one to two of \
                 it) that had been looked up before in it: the hit rate a cache without bound \
                 could reach, beside kvtier_lookup_pages_total's",
            )?,
            requests: r.counter_vec(
                "kvtier_l2_requests_total",
                "Host-tier RPCs by operation and outcome",
                &["op", "outcome"],
            )?,
            request_seconds: r.histogram_vec(
                "kvtier_l2_request_duration_seconds",
                "Time to serve a host-tier RPC, by operation",
                &["op"],
                RPC_BUCKETS,
            )?,
            pages: r.counter_vec(
                "kvtier_l2_pages_total",
                "Pages by operation: reserved, deduplicated, no_space, committed, acquired, \
                 released",
                &["op"],
            )?,
            evictions: r.counter("kvtier_l2_evictions_total", "Pages evicted from L2")?,
            expired_sessions: r.counter(
                "kvtier_l2_expired_sessions_total",
                "Sessions ended because their lease expired",
            )?,
            dropped_pins: r.counter(
                "kvtier_l2_dropped_pins_total",
                "Pins dropped because their session ended holding them",
            )?,
            dropped_reservations: r.counter(
                "kvtier_l2_dropped_reservations_total",
                "Reserved pages freed because their session ended before committing",
            )?,
            lost_pages: r.counter_vec(
                "kvtier_l2_lost_pages_total",
                "Pages that left L2 while L3 did not hold them, by reason: no_l3, l3_down \
                 (evicted), cleared (an operator's clear), pool_damaged (their pool's file \
                 was shrunk or grown by a client)",
                &["reason"],
            )?,
            admission_pages: r.counter_vec(
                "kvtier_l3_admission_pages_total",
                "Pages L2's admission filter (l3.admission) decided on, by decision: \
                 admitted (may go to L3: when stored, or declined before and seen again) or \
                 declined (when stored; they leave L2 unwritten unless seen again)",
                &["decision"],
            )?,
            declined_pages: r.counter(
                "kvtier_l2_declined_pages_total",
                "Pages that left L2 unwritten because the admission filter declined them: \
                 given up by choice (l3.admission), not lost",
            )?,
            declined_bytes: r.counter(
                "kvtier_l2_declined_bytes_total",
                "Bytes of those pages: what the admission filter kept from being written to L3",
            )?,
            takeover_pages: r.counter_vec(
                "kvtier_l2_takeover_pages_total",
                "Pages of a crashed kvtierd's pools found at start, by outcome: adopted \
                 (verified and served), refused_checksum (bytes no longer match their sealed \
                 record), no_room (the new pool was full)",
                &["outcome"],
            )?,
            takeover_pools: r.counter_vec(
                "kvtier_l2_takeover_pools_total",
                "Pools of crashed kvtierd processes found at start: taken_over, removed \
                 (no or damaged slot table, foreign layout, takeover off), or ignored (not \
                 kvtierd's own file, or held by a live process)",
                &["outcome"],
            )?,
            pools_reclaimed: r.counter(
                "kvtier_l2_pools_reclaimed_total",
                "Pools removed because no session used them: idle for l2.idle_pool_ttl, or \
                 their place was needed by a new layout past l2.max_pools",
            )?,
            pools_damaged: r.counter(
                "kvtier_l2_damaged_pools_total",
                "Pools retired because a client holding their descriptor shrank or grew their \
                 file: their sessions ended, their pages gone",
            )?,
            sealed_pages: r.counter(
                "kvtier_l2_sealed_pages_total",
                "Committed L2 pages checksummed and recorded beside their pool, so a kvtierd \
                 started after a crash can take them over",
            )?,
            sealed_from_reads: r.counter(
                "kvtier_l2_sealed_from_reads_total",
                "Of the sealed pages, those a prefetch read from L3: sealed with the CRC32C \
                 their verified read computed, without a second pass over their bytes",
            )?,
            cleared_pages: r.counter(
                "kvtier_l2_cleared_pages_total",
                "L2 pages removed by an operator's clear (kvtierctl clear l2)",
            )?,
            draining: r.gauge(
                "kvtier_l2_draining",
                "1 while kvtierd drains (kvtierctl drain): no new sessions, writes or \
                 prefetches",
            )?,
            pool_bytes: r.gauge_vec(
                "kvtier_l2_pool_bytes",
                "Shared-memory pool bytes: total, used",
                &["state"],
            )?,
            pool_pages: r.gauge_vec(
                "kvtier_l2_pool_pages",
                "Pool pages by state: ready, writing, free",
                &["state"],
            )?,
            dirty_pages: r.gauge(
                "kvtier_l2_dirty_pages",
                "Pages clients wrote to L2 that L3 does not hold yet",
            )?,
            pinned_pages: r.gauge("kvtier_l2_pinned_pages", "Pages with at least one pin")?,
            pins: r.gauge("kvtier_l2_pins", "Pins held, with multiplicity")?,
            sessions: r.gauge("kvtier_l2_sessions", "Live client sessions")?,
            pools: r.gauge("kvtier_l2_pools", "Pool classes (layouts) served")?,
            lookup_pages: r.counter_vec(
                "kvtier_lookup_pages_total",
                "Looked-up pages by where they were found: l2, l3, miss (in neither), \
                 unchecked (not in L2; L3 not asked)",
                &["tier"],
            )?,
            tenant_pages: r.gauge_vec(
                "kvtier_tenant_l2_pages",
                "Pages each tenant holds in L2, all pools (tenancy on; the default tenant is \
                 \"\")",
                &["tenant"],
            )?,
            tenant_quota_pages: r.gauge_vec(
                "kvtier_tenant_l2_quota_pages",
                "Most pages each tenant may hold in each L2 pool (0: no quota)",
                &["tenant"],
            )?,
            tenant_quota: r.counter_vec(
                "kvtier_tenant_l2_quota_pages_total",
                "What a tenant at its L2 quota did, by outcome: evicted (its own page made \
                 room), refused (none of its own pages could leave)",
                &["tenant", "outcome"],
            )?,
        };
        for tier in ["l2", "l3", "miss", "unchecked"] {
            m.lookup_pages.with_label_values(&[tier]);
        }
        for reason in ["no_l3", "l3_down", "cleared", "pool_damaged"] {
            m.lost_pages.with_label_values(&[reason]);
        }
        for decision in ["admitted", "declined"] {
            m.admission_pages.with_label_values(&[decision]);
        }
        for outcome in ["adopted", "refused_checksum", "no_room"] {
            m.takeover_pages.with_label_values(&[outcome]);
        }
        for outcome in ["taken_over", "removed", "ignored"] {
            m.takeover_pools.with_label_values(&[outcome]);
        }
        let me = m.clone();
        r.on_scrape(move || me.refresh(&state.lock()));
        Ok(m)
    }

    /// Measures the hit-rate ceiling over windows of `window` (`metrics.hit_ceiling_window`),
    /// from now.
    pub fn set_hit_ceiling_window(&self, window: Duration) {
        *self.hit_ceiling.lock() = Some(HitCeiling::new(window, Instant::now()));
    }

    /// Counts a lookup of `keys` toward the hit-rate ceiling.
    pub fn observe_lookup(&self, keys: &[PageKey]) {
        if let Some(c) = &mut *self.hit_ceiling.lock() {
            c.observe(keys, Instant::now());
        }
    }

    fn refresh(&self, st: &HostState) {
        if let Some(c) = &mut *self.hit_ceiling.lock() {
            self.hit_ceiling_ratio.set(c.ratio(Instant::now()));
        }
        let t = st.totals();
        let (total, used) = st.pool_bytes();
        self.pool_bytes
            .with_label_values(&["total"])
            .set(total as i64);
        self.pool_bytes
            .with_label_values(&["used"])
            .set(used as i64);
        for (state, n) in [
            ("ready", t.ready),
            ("writing", t.writing),
            ("leased", t.leased),
            ("free", t.capacity - t.ready - t.writing - t.leased),
        ] {
            self.pool_pages
                .with_label_values(&[state])
                .set(i64::from(n));
        }
        self.pinned_pages.set(i64::from(t.pinned));
        self.dirty_pages.set(i64::from(t.dirty));
        self.pins.set(t.pins as i64);
        self.sessions.set(st.sessions().count() as i64);
        self.pools.set(st.pools().count() as i64);
        for (name, _, u) in st.tenant_usage() {
            let label = [name.as_str()];
            self.tenant_pages
                .with_label_values(&label)
                .set(i64::from(u.pages));
            self.tenant_quota_pages
                .with_label_values(&label)
                .set(i64::from(u.quota.unwrap_or(0)));
            for (outcome, n) in [
                ("evicted", u.quota_evictions),
                ("refused", u.quota_refusals),
            ] {
                catch_up(&self.tenant_quota.with_label_values(&[&name, outcome]), n);
            }
        }
        let c = st.counters;
        catch_up(&self.expired_sessions, c.expired_sessions);
        catch_up(&self.dropped_pins, c.dropped_pins);
        catch_up(&self.dropped_reservations, c.dropped_reservations);
        catch_up(&self.lost_pages.with_label_values(&["no_l3"]), c.lost_no_l3);
        catch_up(
            &self.lost_pages.with_label_values(&["l3_down"]),
            c.lost_l3_down,
        );
        catch_up(
            &self.lost_pages.with_label_values(&["cleared"]),
            c.lost_cleared,
        );
        catch_up(&self.cleared_pages, c.cleared_pages);
        catch_up(
            &self.admission_pages.with_label_values(&["admitted"]),
            c.admitted_pages,
        );
        catch_up(
            &self.admission_pages.with_label_values(&["declined"]),
            c.declined_pages,
        );
        let (declined, declined_bytes) = st.declined();
        catch_up(&self.declined_pages, declined);
        catch_up(&self.declined_bytes, declined_bytes);
        self.draining.set(i64::from(st.draining()));
        catch_up(&self.sealed_pages, c.sealed_pages);
        catch_up(&self.sealed_from_reads, c.sealed_from_reads);
        catch_up(&self.pools_reclaimed, c.pools_reclaimed);
        catch_up(&self.pools_damaged, c.pools_damaged);
        catch_up(
            &self.lost_pages.with_label_values(&["pool_damaged"]),
            c.lost_pool_damaged,
        );
        for (outcome, n) in [
            ("adopted", c.takeover.adopted),
            ("refused_checksum", c.takeover.refused_checksum),
            ("no_room", c.takeover.no_room),
        ] {
            catch_up(&self.takeover_pages.with_label_values(&[outcome]), n);
        }
        for (outcome, n) in [
            ("taken_over", c.takeover.pools),
            ("removed", c.takeover.pools_removed),
            ("ignored", c.takeover.pools_ignored),
        ] {
            catch_up(&self.takeover_pools.with_label_values(&[outcome]), n);
        }
    }
}
