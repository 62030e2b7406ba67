//! How the agent's page moves end when they do not: why a computed page left the device
//! without a copy in L2 ([`Loss`]), why a page a Load was asked for did not load
//! ([`LoadFailure`]), and the counters AgentStats and the heartbeat report show. Every mode
//! counts through these; the metric labels are the enums' own.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a page left the device without a copy in L2: the `reason` of
/// `kvtier_agent_lost_pages_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Loss {
    /// No session with kvtierd, or it stopped answering.
    DaemonUnreachable,
    /// kvtierd's pool had no room (full of pinned pages or pages not yet in L3) for longer
    /// than `cache.evict_wait`.
    L2Full,
    /// The device → host copy failed.
    CopyFailed,
    /// kvtierd refused a call (an error other than the link going away).
    Refused,
    /// The engine's call was past its deadline, or its client gone, before the page was
    /// copied: the engine may have reused the page, so it is not read (the call's fence).
    Late,
}

impl Loss {
    /// Every reason, in label order.
    pub(crate) const ALL: [Loss; 5] = [
        Loss::DaemonUnreachable,
        Loss::L2Full,
        Loss::CopyFailed,
        Loss::Refused,
        Loss::Late,
    ];

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Loss::DaemonUnreachable => "daemon_unreachable",
            Loss::L2Full => "l2_full",
            Loss::CopyFailed => "copy_failed",
            Loss::Refused => "refused",
            Loss::Late => "late",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Whether a write that failed this way is worth trying again: L2 full while the
    /// deadline has not passed (`within_deadline`), or kvtierd gone while it may come back.
    pub(crate) fn retry(self, within_deadline: bool, daemon_may_come_back: bool) -> bool {
        match self {
            Loss::L2Full => within_deadline,
            Loss::DaemonUnreachable => daemon_may_come_back,
            Loss::CopyFailed | Loss::Refused | Loss::Late => false,
        }
    }
}

/// Why a page a Load was asked for did not load: the `reason` of
/// `kvtier_agent_load_failed_pages_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LoadFailure {
    /// Neither in L2 nor fetched from L3 in time (evicted since the lookup, a prefetch that
    /// stopped at its deadline, an L3 copy that failed its checksum).
    Missing,
    /// No session with kvtierd, or it stopped answering.
    DaemonUnreachable,
    /// The host → device copy failed.
    CopyFailed,
    /// The call was past its deadline, or its client gone, before the page was copied in:
    /// the engine may have given its pages to another request, so none is written.
    Late,
}

impl LoadFailure {
    /// Every reason, in label order.
    pub(crate) const ALL: [LoadFailure; 4] = [
        LoadFailure::Missing,
        LoadFailure::DaemonUnreachable,
        LoadFailure::CopyFailed,
        LoadFailure::Late,
    ];

    /// The metric label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            LoadFailure::Missing => "missing",
            LoadFailure::DaemonUnreachable => "daemon_unreachable",
            LoadFailure::CopyFailed => "copy_failed",
            LoadFailure::Late => "late",
        }
    }
}

/// Backup and loss counters shown by AgentStats and the heartbeat report.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) backed_up: AtomicU64,
    lost: [AtomicU64; Loss::ALL.len()],
    pub(crate) deferred: AtomicU64,
    /// Backups queued or running (early ones, and those an Evict runs).
    pub(crate) in_flight: AtomicU64,
    /// Calls that waited for backups, and how long in all.
    pub(crate) waits: AtomicU64,
    wait_nanos: AtomicU64,
}

impl Counters {
    /// Pages lost, in total and by reason (every reason, in label order).
    pub(crate) fn lost(&self) -> (u64, Vec<(Loss, u64)>) {
        let by: Vec<(Loss, u64)> = Loss::ALL
            .iter()
            .map(|&l| (l, self.lost[l.index()].load(Ordering::Relaxed)))
            .collect();
        (by.iter().map(|(_, n)| n).sum(), by)
    }

    pub(crate) fn add_lost(&self, why: Loss, pages: u64) {
        self.lost[why.index()].fetch_add(pages, Ordering::Relaxed);
    }

    pub(crate) fn add_wait(&self, t: Duration) {
        self.waits.fetch_add(1, Ordering::Relaxed);
        self.wait_nanos
            .fetch_add(t.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Seconds calls spent waiting for backups.
    pub(crate) fn wait_seconds(&self) -> f64 {
        Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed)).as_secs_f64()
    }
}
