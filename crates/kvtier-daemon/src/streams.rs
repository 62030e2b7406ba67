//! How many long-lived streams each caller holds open, and how often it opens them. The
//! streams are those whose row in the doors table (`kvtier_server::doors`) is bounded by
//! `StreamsPerCaller`: `WatchEvents` and `WatchMetrics`. One caller is one role (the operator, peer kvtierds, each tenant)
//! and, on the Unix socket, one uid of it: each may hold at most
//! `server.max_streams_per_caller` streams of a kind, and open at most [`OPENS_PER_S`] a
//! second (a burst of the bound). A stream holds memory (an events snapshot, its unsent
//! batches) and its opening costs a scan of the index under the state lock, so without a
//! bound one tenant opening streams slowed every other's writes. A stream past either bound
//! is refused (`RESOURCE_EXHAUSTED`, naming it) and counted in
//! `kvtier_streams_refused_total{stream}`.

use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use kvtier_proto::ApiError;
use kvtier_server::doors;
use kvtier_server::metrics::MetricRegistry;

use crate::roles::Role;

/// Streams one caller may open a second, on average.
pub const OPENS_PER_S: f64 = 4.0;

/// Open streams per (kind, caller), and the bound.
#[derive(Debug)]
pub struct StreamCaps {
    /// The kinds: the methods whose doors-table row is bounded by `StreamsPerCaller`.
    kinds: Vec<String>,
    per_caller: AtomicU32,
    open: Mutex<HashMap<(&'static str, String), Caller>>,
    refused: prometheus::IntCounterVec,
}

/// One caller's open streams of a kind, and its allowance of opens (a token bucket).
#[derive(Debug)]
struct Caller {
    open: u32,
    tokens: f64,
    at: std::time::Instant,
}

/// One open stream's place under its caller's bound: given back when dropped (the stream
/// ended: its caller went, or kvtierd shuts down).
#[derive(Debug)]
pub struct StreamSlot {
    caps: Arc<StreamCaps>,
    key: (&'static str, String),
}

impl StreamCaps {
    /// `per_caller` streams of each kind per caller; declares the refusal counter.
    pub fn new(per_caller: u32, metrics: &MetricRegistry) -> prometheus::Result<Arc<Self>> {
        let refused = metrics.counter_vec(
            "kvtier_streams_refused_total",
            "WatchEvents and WatchMetrics streams refused because their caller (a role: the operator, peers, one tenant) held server.max_streams_per_caller of that kind already",
            &["stream"],
        )?;
        let kinds: Vec<String> = doors::capped_streams(doors::Server::Kvtierd)
            .map(|d| d.method_label())
            .collect();
        for k in &kinds {
            refused.with_label_values(&[k]);
        }
        Ok(Arc::new(Self {
            kinds,
            per_caller: AtomicU32::new(per_caller.max(1)),
            open: Mutex::new(HashMap::new()),
            refused,
        }))
    }

    /// A place for one more `kind` stream of `role`'s (of its Unix peer `uid`, when the call
    /// came on the Unix socket), or `RESOURCE_EXHAUSTED` when it holds the bound already or
    /// opens them faster than [`OPENS_PER_S`]. `kind` is the method's label
    /// (`watch_events`); a method whose row does not bound it this way is refused.
    pub fn open(
        self: &Arc<Self>,
        kind: &'static str,
        role: &Role,
        uid: Option<u32>,
    ) -> Result<StreamSlot, ApiError> {
        if !self.kinds.iter().any(|k| k == kind) {
            return Err(ApiError::Internal(format!(
                "{kind} streams have no row bounding them per caller in the doors table"
            )));
        }
        let mut caller = match role {
            Role::Operator => "operator".to_string(),
            Role::Peer => "peer".to_string(),
            Role::Tenant(t) => format!("tenant:{t}"),
        };
        if let Some(uid) = uid {
            caller.push_str(&format!("/uid:{uid}"));
        }
        let key = (kind, caller);
        let bound = self.per_caller.load(Ordering::Relaxed);
        let mut open = self.open.lock();
        let now = std::time::Instant::now();
        let c = open.entry(key.clone()).or_insert(Caller {
            open: 0,
            tokens: f64::from(bound),
            at: now,
        });
        c.tokens =
            (c.tokens + now.duration_since(c.at).as_secs_f64() * OPENS_PER_S).min(f64::from(bound));
        c.at = now;
        let refuse = |why: String| {
            self.refused.with_label_values(&[kind]).inc();
            Err(ApiError::ResourceExhausted(why))
        };
        if c.open >= bound {
            return refuse(format!(
                "{} holds {bound} {kind} streams open already \
                 (server.max_streams_per_caller); close one first",
                role.describe()
            ));
        }
        if c.tokens < 1.0 {
            return refuse(format!(
                "{} opens {kind} streams faster than {OPENS_PER_S} a second; retry in a \
                 second",
                role.describe()
            ));
        }
        c.tokens -= 1.0;
        c.open += 1;
        Ok(StreamSlot {
            caps: self.clone(),
            key,
        })
    }

    /// Sets the bound (`server.max_streams_per_caller`; streams open now stay).
    pub fn set_per_caller(&self, n: u32) {
        self.per_caller.store(n.max(1), Ordering::Relaxed);
    }

    /// Streams of `kind` open for all callers (tests).
    pub fn open_now(&self, kind: &str) -> u32 {
        let open = self.open.lock();
        open.iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|(_, c)| c.open)
            .sum()
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.caps.open.lock();
        if let Some(c) = open.get_mut(&self.key) {
            c.open = c.open.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_caller_holds_at_most_its_bound_and_gets_places_back() {
        let caps = StreamCaps::new(2, &MetricRegistry::new()).unwrap();
        let acme = Role::Tenant("acme".into());
        let a = caps.open("watch_events", &acme, Some(1000)).unwrap();
        let _b = caps.open("watch_events", &acme, Some(1000)).unwrap();
        let e = caps
            .open("watch_events", &acme, Some(1000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_streams_per_caller"), "{e}");
        // Another caller (another tenant, another uid of acme's), and another kind, are not
        // held by this one's.
        let _g = caps
            .open("watch_events", &Role::Tenant("globex".into()), Some(1000))
            .unwrap();
        let _u = caps.open("watch_events", &acme, Some(1001)).unwrap();
        let _m = caps.open("watch_metrics", &acme, Some(1000)).unwrap();
        drop(a);
        // Its place is back, but it opened its burst already: the next waits for the rate.
        let e = caps
            .open("watch_events", &acme, Some(1000))
            .unwrap_err()
            .to_string();
        assert!(e.contains("faster than"), "{e}");
        std::thread::sleep(std::time::Duration::from_millis(300));
        let _c = caps.open("watch_events", &acme, Some(1000)).unwrap();
        assert_eq!(caps.open_now("watch_events"), 4);
        // A stream the doors table does not bound per caller is not served at all.
        assert!(caps.open("prefetch", &acme, Some(1000)).is_err());
    }
}
