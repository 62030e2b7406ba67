//! How many long-lived streams (`WatchEvents`, `WatchMetrics`) each caller holds open: one
//! caller is one role (the operator, peer kvtierds, each tenant; every process of a tenant
//! counts together), and each may hold at most `server.max_streams_per_caller` streams of a
//! kind. A stream holds memory (an events snapshot, its unsent batches) and its opening costs
//! a scan of the index under the state lock, so without a bound one tenant opening streams
//! slowed every other's writes. A stream past the bound is refused (`RESOURCE_EXHAUSTED`,
//! naming the bound) and counted in `kvtier_streams_refused_total{stream}`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use kvtier_proto::ApiError;
use kvtier_server::metrics::MetricRegistry;

use crate::roles::Role;

/// The kinds of stream.
pub const KINDS: [&str; 2] = ["watch_events", "watch_metrics"];

/// Open streams per (kind, caller), and the bound.
#[derive(Debug)]
pub struct StreamCaps {
    per_caller: AtomicU32,
    open: Mutex<HashMap<(&'static str, String), u32>>,
    refused: prometheus::IntCounterVec,
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
        for k in KINDS {
            refused.with_label_values(&[k]);
        }
        Ok(Arc::new(Self {
            per_caller: AtomicU32::new(per_caller.max(1)),
            open: Mutex::new(HashMap::new()),
            refused,
        }))
    }

    /// A place for one more `kind` stream of `role`'s, or `RESOURCE_EXHAUSTED` when it holds
    /// the bound already.
    pub fn open(self: &Arc<Self>, kind: &'static str, role: &Role) -> Result<StreamSlot, ApiError> {
        let caller = match role {
            Role::Operator => "operator".to_string(),
            Role::Peer => "peer".to_string(),
            Role::Tenant(t) => format!("tenant:{t}"),
        };
        let key = (kind, caller);
        let bound = self.per_caller.load(Ordering::Relaxed);
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let n = open.entry(key.clone()).or_default();
        if *n >= bound {
            self.refused.with_label_values(&[kind]).inc();
            return Err(ApiError::ResourceExhausted(format!(
                "{} holds {} {kind} streams open already (server.max_streams_per_caller); \
                 close one first",
                role.describe(),
                bound
            )));
        }
        *n += 1;
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
        let open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.iter()
            .filter(|((k, _), _)| *k == kind)
            .map(|(_, n)| n)
            .sum()
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.caps.open.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = open.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.key);
            }
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
        let a = caps.open("watch_events", &acme).unwrap();
        let _b = caps.open("watch_events", &acme).unwrap();
        let e = caps.open("watch_events", &acme).unwrap_err().to_string();
        assert!(e.contains("max_streams_per_caller"), "{e}");
        // Another caller, and another kind, are not held by acme's.
        let _g = caps
            .open("watch_events", &Role::Tenant("globex".into()))
            .unwrap();
        let _m = caps.open("watch_metrics", &acme).unwrap();
        drop(a);
        let _c = caps.open("watch_events", &acme).unwrap();
        assert_eq!(caps.open_now("watch_events"), 3);
    }
}
