//! The gRPC edge: conversions between the generated `kvtier.v1` messages and the daemon's
//! own types. Nothing inside the daemon (state, prefetch, L3) sees a wire type; a request is
//! validated and turned into a domain value here, once, and replies are built here.

use std::time::Duration;

use kvtier_config::daemon::StopPolicy;
use kvtier_proto::{ApiError, Lost, page_keys, request_keys, v1};

use crate::prefetch::PrefetchAsk;
use crate::state::{ClientReport, Phase, Progress, StateError};

impl From<StateError> for ApiError {
    fn from(e: StateError) -> Self {
        let msg = e.to_string();
        match e {
            StateError::Invalid { field, reason } => ApiError::invalid(field, reason),
            StateError::UnknownSession { .. } => ApiError::Lost(Lost::Session, msg),
            StateError::UnknownPrefetch(_) => ApiError::NotFound(msg),
            StateError::Full(_) => ApiError::ResourceExhausted(msg),
            StateError::Refused(_) => ApiError::FailedPrecondition(msg),
            StateError::Draining(_) => ApiError::Unavailable(msg),
            StateError::Internal(_) => ApiError::Internal(msg),
        }
    }
}

/// A Prefetch request as the prefetcher takes it.
pub fn prefetch_ask(req: v1::PrefetchRequest) -> Result<PrefetchAsk, ApiError> {
    let keys = request_keys(&req.keys, &req.packed_keys)?;
    let parent = match req.parent.len() {
        0 => None,
        _ => Some(page_keys("parent", std::slice::from_ref(&req.parent))?[0]),
    };
    let hints = req.hints.unwrap_or_default();
    Ok(PrefetchAsk {
        session: kvtier_proto::session_id(&req.session_id)?,
        request_id: req.request_id,
        keys,
        parent,
        policy: stop_policy(req.policy)?,
        timeout: (hints.timeout_ms > 0).then(|| Duration::from_millis(hints.timeout_ms)),
        threshold_tokens: hints.threshold_tokens,
        recompute_tokens_per_second: (hints.recompute_tokens_per_second > 0)
            .then_some(hints.recompute_tokens_per_second),
        whole_load_pages: u64::from(hints.whole_load_pages),
    })
}

/// A wire prefetch policy: `None` for unspecified (the daemon's default).
pub fn stop_policy(raw: i32) -> Result<Option<StopPolicy>, ApiError> {
    match v1::PrefetchPolicy::try_from(raw) {
        Ok(v1::PrefetchPolicy::Unspecified) => Ok(None),
        Ok(v1::PrefetchPolicy::BestEffort) => Ok(Some(StopPolicy::BestEffort)),
        Ok(v1::PrefetchPolicy::WaitComplete) => Ok(Some(StopPolicy::WaitComplete)),
        Ok(v1::PrefetchPolicy::Timeout) => Ok(Some(StopPolicy::Timeout)),
        Err(_) => Err(ApiError::invalid(
            "policy",
            format!("{raw} is not a PrefetchPolicy"),
        )),
    }
}

fn wire_policy(p: StopPolicy) -> v1::PrefetchPolicy {
    match p {
        StopPolicy::BestEffort => v1::PrefetchPolicy::BestEffort,
        StopPolicy::WaitComplete => v1::PrefetchPolicy::WaitComplete,
        StopPolicy::Timeout => v1::PrefetchPolicy::Timeout,
    }
}

fn wire_phase(p: Phase) -> v1::PrefetchState {
    match p {
        Phase::Running => v1::PrefetchState::Running,
        Phase::Completed => v1::PrefetchState::Completed,
        Phase::Partial => v1::PrefetchState::Partial,
        Phase::TimedOut => v1::PrefetchState::TimedOut,
        Phase::Revoked => v1::PrefetchState::Revoked,
        Phase::Failed => v1::PrefetchState::Failed,
    }
}

/// A prefetch's progress on the wire.
pub fn progress(p: Progress) -> v1::PrefetchProgress {
    v1::PrefetchProgress {
        request_id: p.request_id,
        state: wire_phase(p.phase) as i32,
        reason: p.reason,
        policy: wire_policy(p.policy) as i32,
        l2_pages: p.l2_pages as u32,
        hit_pages: p.hit_pages as u32,
        landed_pages: p.landed_pages as u32,
        landed_bytes: p.landed_bytes,
        elapsed_ms: p.elapsed.as_millis() as u64,
        deadline_ms: p.deadline.as_millis() as u64,
    }
}

/// An agent's heartbeat report.
pub fn report_in(r: v1::ClientReport) -> ClientReport {
    ClientReport {
        matches: r.matches,
        device_hit_pages: r.device_hit_pages,
        l2_hit_pages: r.l2_hit_pages,
        l3_hit_pages: r.l3_hit_pages,
        miss_pages: r.miss_pages,
        load_back_pages: r.load_back_pages,
        backup_pages: r.backup_pages,
        lost_pages: r.lost_pages,
        evicted_pages: r.evicted_pages,
        device_pages: r.device_pages,
        locked_pages: r.locked_pages,
    }
}

/// A kept report, for Stats.
pub fn report_out(r: ClientReport) -> v1::ClientReport {
    v1::ClientReport {
        matches: r.matches,
        device_hit_pages: r.device_hit_pages,
        l2_hit_pages: r.l2_hit_pages,
        l3_hit_pages: r.l3_hit_pages,
        miss_pages: r.miss_pages,
        load_back_pages: r.load_back_pages,
        backup_pages: r.backup_pages,
        lost_pages: r.lost_pages,
        evicted_pages: r.evicted_pages,
        device_pages: r.device_pages,
        locked_pages: r.locked_pages,
    }
}

/// The wire form of gathered metric families: one sample per series, with the same names,
/// labels and values the text endpoint shows; with `only_tenant`, none labelled with another
/// tenant.
pub fn samples(
    families: &[prometheus::proto::MetricFamily],
    only_tenant: Option<&str>,
) -> Vec<kvtier_proto::v1::MetricSample> {
    use kvtier_proto::v1::{HistogramBucket, MetricKind, MetricLabel, MetricSample};
    use prometheus::proto::MetricType;
    let mut out = Vec::new();
    for f in families {
        for m in f.get_metric() {
            // Another tenant's series, for a caller that sees only its own.
            if let Some(t) = only_tenant
                && m.get_label()
                    .iter()
                    .any(|l| l.name() == "tenant" && l.value() != t)
            {
                continue;
            }
            let labels = m
                .get_label()
                .iter()
                .map(|l| MetricLabel {
                    name: l.name().to_string(),
                    value: l.value().to_string(),
                })
                .collect();
            let mut s = MetricSample {
                name: f.name().to_string(),
                labels,
                ..MetricSample::default()
            };
            match f.get_field_type() {
                MetricType::COUNTER => {
                    s.kind = MetricKind::Counter as i32;
                    s.value = m.get_counter().get_value();
                }
                MetricType::GAUGE => {
                    s.kind = MetricKind::Gauge as i32;
                    s.value = m.get_gauge().get_value();
                }
                MetricType::HISTOGRAM => {
                    let h = m.get_histogram();
                    s.kind = MetricKind::Histogram as i32;
                    s.count = h.get_sample_count();
                    s.sum = h.get_sample_sum();
                    s.buckets = h
                        .get_bucket()
                        .iter()
                        .map(|b| HistogramBucket {
                            upper_bound: b.upper_bound(),
                            cumulative_count: b.cumulative_count(),
                        })
                        .collect();
                    s.buckets.push(HistogramBucket {
                        upper_bound: f64::INFINITY,
                        cumulative_count: h.get_sample_count(),
                    });
                }
                _ => continue,
            }
            out.push(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_survives_the_round_trip_field_for_field() {
        let wire = v1::ClientReport {
            matches: 1,
            device_hit_pages: 2,
            l2_hit_pages: 3,
            l3_hit_pages: 4,
            miss_pages: 5,
            load_back_pages: 6,
            backup_pages: 7,
            lost_pages: 8,
            evicted_pages: 9,
            device_pages: 10,
            locked_pages: 11,
        };
        assert_eq!(report_out(report_in(wire)), wire);
    }

    #[test]
    fn policies_map_both_ways_and_unknown_values_are_named() {
        for p in [
            StopPolicy::BestEffort,
            StopPolicy::WaitComplete,
            StopPolicy::Timeout,
        ] {
            assert_eq!(stop_policy(wire_policy(p) as i32).unwrap(), Some(p));
        }
        assert_eq!(stop_policy(0).unwrap(), None);
        let e = stop_policy(42).unwrap_err().to_string();
        assert!(e.contains("policy") && e.contains("42"), "{e}");
    }

    #[test]
    fn progress_keeps_its_numbers_on_the_wire() {
        let p = Progress {
            request_id: "r".into(),
            phase: Phase::TimedOut,
            reason: String::new(),
            policy: StopPolicy::Timeout,
            l2_pages: 3,
            hit_pages: 5,
            landed_pages: 2,
            landed_bytes: 2048,
            elapsed: Duration::from_millis(70),
            deadline: Duration::from_millis(100),
        };
        let w = progress(p);
        assert_eq!(w.state, v1::PrefetchState::TimedOut as i32);
        assert_eq!(w.policy, v1::PrefetchPolicy::Timeout as i32);
        assert_eq!(
            (w.l2_pages, w.hit_pages, w.landed_pages, w.landed_bytes),
            (3, 5, 2, 2048)
        );
        assert_eq!((w.elapsed_ms, w.deadline_ms), (70, 100));
    }
}
