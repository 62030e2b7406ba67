//! Device → L2 backups, and the eviction that never loses a computed page to load.
//!
//! The write policy ([`WritePolicy`]) decides when a backup starts *early*: on insert
//! (`write_through`), once a page is hot (`write_through_selective`), or never (`write_back`).
//! Early backups go through a queue bounded in pages (`cache.backup_queue`) and run
//! `cache.backup_concurrency` at a time; a queued node is locked in the tree, so the engine
//! cannot take its pages back before they reached L2. A full queue is backpressure: the
//! Insert (or Match) that queues a backup waits for room, so an engine never runs far ahead
//! of what reaches L2 and other workers see its pages soon. Only when the queue makes no
//! progress for `cache.evict_wait` is the backup left to eviction (counted as deferred); it
//! is never dropped.
//!
//! Under every policy, [`AgentService::evict`] gives a device page back to the engine only
//! once L2 holds a copy: it evicts what is backed up, backs up (concurrently) the victims in
//! its way, and waits for early backups in flight. A backup that finds L2 full (its writes to
//! L3 not landed yet) tries again for as long as L2 keeps making progress, giving up only
//! after `cache.evict_wait` without any. That wait is the backpressure an engine feels when
//! L2 and L3 cannot keep up. A page is given up only when L2 refuses it — kvtierd
//! unreachable, no progress for `cache.evict_wait`, a failed copy, a refused call — and then
//! it is counted by [`Loss`] reason.
//!
//! [`WritePolicy`]: kvtier_core::WritePolicy

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvtier_client::{ClientError, Reserved};
use kvtier_core::PageKey;
use kvtier_core::radix::NodeId;
use kvtier_device::{Device, DeviceError, PageCopy};
use kvtier_proto::ApiError;
use kvtier_proto::v1;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

use crate::agent::{AgentService, lock};
use crate::link::{Linked, is_link_error};
use crate::owner::Caller;

/// Why a page left the device without a copy in L2: the `reason` of
/// `kvtier_agent_lost_pages_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loss {
    /// No session with kvtierd, or it stopped answering.
    DaemonUnreachable,
    /// kvtierd's pool had no room (full of pinned pages or pages not yet in L3) for longer
    /// than `cache.evict_wait`.
    L2Full,
    /// The device → host copy failed.
    CopyFailed,
    /// kvtierd refused a call (an error other than the link going away).
    Refused,
}

impl Loss {
    /// Every reason, in label order.
    pub const ALL: [Loss; 4] = [
        Loss::DaemonUnreachable,
        Loss::L2Full,
        Loss::CopyFailed,
        Loss::Refused,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Loss::DaemonUnreachable => "daemon_unreachable",
            Loss::L2Full => "l2_full",
            Loss::CopyFailed => "copy_failed",
            Loss::Refused => "refused",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// How one backup ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backup {
    /// Every page of the node's path is in L2.
    Done,
    /// L2 took some pages but had no room for the rest now (marked as far as they got).
    Partial,
    /// Nothing more reached L2.
    Failed(Loss),
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
    /// Pages lost, in total and by reason.
    pub(crate) fn lost(&self) -> (u64, Vec<v1::LostPages>) {
        let by: Vec<v1::LostPages> = Loss::ALL
            .iter()
            .map(|l| v1::LostPages {
                reason: l.label().to_string(),
                pages: self.lost[l.index()].load(Ordering::Relaxed),
            })
            .collect();
        (by.iter().map(|l| l.pages).sum(), by)
    }

    /// Seconds calls spent waiting for backups.
    pub(crate) fn wait_seconds(&self) -> f64 {
        Duration::from_nanos(self.wait_nanos.load(Ordering::Relaxed)).as_secs_f64()
    }
}

/// The receiving end of the early-backup queue, for [`run_backups`].
pub struct BackupWorker {
    pub(crate) rx: mpsc::UnboundedReceiver<(NodeId, OwnedSemaphorePermit)>,
    pub(crate) concurrency: usize,
}

/// What one Evict has done so far.
#[derive(Default)]
struct Evicting {
    pages: Vec<u32>,
    backed_up: u32,
    lost: [u64; Loss::ALL.len()],
    /// Victims whose backup failed for good in this call: they may go, counted.
    given_up: HashMap<NodeId, Loss>,
}

impl AgentService {
    /// Queues an early backup of `node` (and its unbacked ancestors). The node is locked
    /// until its backup ends, so the engine's evictions cannot take its pages before they
    /// reached L2. When the queue has no room for its pages this waits, as long as the queue
    /// makes progress; after `cache.evict_wait` without any, the pages are left to their
    /// eviction (counted as deferred).
    pub(crate) async fn enqueue_backup(&self, node: NodeId) {
        let s = &self.shared;
        let pages = {
            let mut st = lock(&s.state);
            let Ok(path) = st.tree.unbacked_path(node) else {
                return;
            };
            let pages: usize = path
                .iter()
                .filter_map(|&n| st.tree.view(n).ok().map(|v| v.keys.len()))
                .sum();
            if pages == 0 || st.tree.lock(node).is_err() {
                return;
            }
            pages
        };
        s.counters.in_flight.fetch_add(1, Ordering::Relaxed);
        // A path longer than the whole queue waits for all of it.
        let want = pages.min(s.backup_room_pages as usize) as u32;
        let permit = match s.backup_room.clone().try_acquire_many_owned(want) {
            Ok(p) => Some(p),
            Err(TryAcquireError::Closed) => None,
            Err(TryAcquireError::NoPermits) => {
                let started = Instant::now();
                let p = self.wait_for_room(want).await;
                self.count_wait("insert", started.elapsed());
                p
            }
        };
        let queued = match permit {
            Some(p) => s.backups.send((node, p)).is_ok(),
            None => false,
        };
        if !queued {
            let _ = lock(&s.state).tree.unlock(node);
            self.backup_ended();
            s.counters
                .deferred
                .fetch_add(pages as u64, Ordering::Relaxed);
            self.count_backup("deferred", pages);
        }
    }

    /// Waits for `want` pages of room in the early-backup queue, as long as backups keep
    /// ending: `None` after `cache.evict_wait` in which none did.
    async fn wait_for_room(&self, want: u32) -> Option<OwnedSemaphorePermit> {
        let s = &self.shared;
        let mut room = s.backup_room.available_permits();
        loop {
            let acquire = s.backup_room.clone().acquire_many_owned(want);
            match tokio::time::timeout(s.evict_wait, acquire).await {
                Ok(p) => return p.ok(),
                Err(_) => {
                    let now = s.backup_room.available_permits();
                    if now <= room {
                        return None;
                    }
                    room = now;
                }
            }
        }
    }

    pub(crate) fn count_wait(&self, at: &str, t: Duration) {
        let s = &self.shared;
        s.counters.waits.fetch_add(1, Ordering::Relaxed);
        s.counters
            .wait_nanos
            .fetch_add(t.as_nanos() as u64, Ordering::Relaxed);
        s.metrics.backup_waits.with_label_values(&[at]).inc();
        s.metrics
            .backup_wait_seconds
            .with_label_values(&[at])
            .observe(t.as_secs_f64());
    }

    fn backup_ended(&self) {
        let s = &self.shared;
        s.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        s.backup_done.notify_waiters();
    }

    pub(crate) fn count_backup(&self, outcome: &str, pages: usize) {
        if pages == 0 {
            return;
        }
        let s = &self.shared;
        s.metrics
            .backup_pages
            .with_label_values(&[s.policy.name(), outcome])
            .inc_by(pages as u64);
        if matches!(outcome, "stored" | "present") {
            s.counters
                .backed_up
                .fetch_add(pages as u64, Ordering::Relaxed);
        }
    }

    pub(crate) fn count_lost(&self, why: Loss, pages: u64) {
        if pages == 0 {
            return;
        }
        let s = &self.shared;
        s.counters.lost[why.index()].fetch_add(pages, Ordering::Relaxed);
        s.metrics
            .lost_pages
            .with_label_values(&[why.label()])
            .inc_by(pages);
    }

    /// Backs up `node`, which the caller locked and counted in flight; unlocks it at the end.
    /// While L2 has no room it tries again, as long as each `cache.evict_wait` brings some
    /// progress (writes to L3 landing make room): slow storage is backpressure, not a reason
    /// to give a page up.
    pub(crate) async fn backup_locked(&self, node: NodeId) -> Backup {
        let wait = self.shared.evict_wait;
        let mut deadline = Instant::now() + wait;
        let mut pause = Duration::from_millis(1);
        let r = loop {
            let r = self.backup_inner(node).await;
            let now = Instant::now();
            match r {
                Backup::Partial => {
                    deadline = now + wait;
                    pause = Duration::from_millis(1);
                }
                Backup::Failed(Loss::L2Full) if now < deadline => {}
                // kvtierd went away: a restart is a blip, so wait for the link (for
                // `evict_wait` after it broke; at once to failure when it was down longer).
                Backup::Failed(Loss::DaemonUnreachable) if self.shared.link.may_come_back(wait) => {
                }
                r => break r,
            }
            tokio::time::sleep(pause.min(deadline.saturating_duration_since(now))).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        };
        let _ = lock(&self.shared.state).tree.unlock(node);
        self.backup_ended();
        r
    }

    /// Backs up `node` and its ancestors not yet in L2: reserve in kvtierd, copy device →
    /// host into the reserved slots, commit; only then are the pages marked backed up. The
    /// pages stay locked in the tree while the copy reads them.
    async fn backup_inner(&self, node: NodeId) -> Backup {
        let t = Instant::now();
        let s = &self.shared;
        let Some(linked) = s.link.current_or_wait(s.evict_wait).await else {
            return Backup::Failed(Loss::DaemonUnreachable);
        };
        let plan = {
            let st = lock(&s.state);
            let Some(device) = st.engine.as_ref().map(|e| e.device.clone()) else {
                return Backup::Failed(Loss::Refused);
            };
            let Ok(path) = st.tree.unbacked_path(node) else {
                return Backup::Done;
            };
            let mut keys = Vec::new();
            let mut pages = Vec::new();
            for &n in &path {
                let Ok(v) = st.tree.view(n) else {
                    return Backup::Failed(Loss::Refused);
                };
                let Some(values) = v.values else {
                    // Not on the device any more: nothing of it left to copy.
                    return Backup::Failed(Loss::Refused);
                };
                keys.extend_from_slice(v.keys);
                pages.extend_from_slice(values);
            }
            let parent = match path.first() {
                Some(&first) => st.tree.parent_key(first).ok().flatten(),
                None => return Backup::Done,
            };
            (device, keys, pages, parent)
        };
        let (device, keys, pages, parent) = plan;
        let stored = self.store(&linked, &device, &keys, &pages, parent).await;
        if let Ok((upto, _)) = &stored
            && let Some(last) = upto.checked_sub(1).map(|i| keys[i])
        {
            // Mark what reached L2, by its last page: the node was locked all along, so that
            // page is still on its path, however requests split the path meanwhile. A retry
            // goes on from there (pages that reached L2 may have left it for L3 since, and
            // must not be copied again). Only for the current session: a mark made through
            // a session that has since been replaced would be assumed, not checked.
            let mut st = lock(&s.state);
            if st.link_generation == linked.generation {
                let _ = st.tree.mark_backed_up_through(node, &last);
            }
        }
        let policy = s.policy.name();
        match stored {
            Ok((upto, copied)) => {
                self.count_backup("stored", copied);
                self.count_backup("present", upto - copied);
                self.count_backup("failed", keys.len() - upto);
                let bytes = copied * device.pool().layout().page_bytes();
                let m = &s.metrics;
                m.backup_bytes
                    .with_label_values(&[policy])
                    .inc_by(bytes as u64);
                m.backup_seconds
                    .with_label_values(&[policy])
                    .observe(t.elapsed().as_secs_f64());
                if upto == keys.len() {
                    Backup::Done
                } else if upto > 0 {
                    Backup::Partial
                } else {
                    Backup::Failed(Loss::L2Full)
                }
            }
            Err(why) => {
                self.count_backup("failed", keys.len());
                Backup::Failed(why)
            }
        }
    }

    /// A daemon call for a backup: a failure is the [`Loss`] it would cause.
    pub(crate) async fn call_for_backup<T>(
        &self,
        linked: &Arc<Linked>,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Result<T, Loss> {
        let r = match tokio::time::timeout(self.shared.link.timeout(), fut).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Protocol("kvtierd call timed out".into())),
        };
        r.map_err(|e| {
            if is_link_error(&e) || matches!(e, ClientError::Protocol(_)) {
                self.shared.link.broken(linked, &e);
                Loss::DaemonUnreachable
            } else {
                tracing::debug!("kvtierd refused a backup call: {e}");
                Loss::Refused
            }
        })
    }

    /// Reserve, copy, commit. Returns how many leading pages L2 now holds and how many of
    /// those this call copied.
    pub(crate) async fn store(
        &self,
        linked: &Arc<Linked>,
        device: &Arc<dyn Device>,
        keys: &[PageKey],
        pages: &[u32],
        parent: Option<PageKey>,
    ) -> Result<(usize, usize), Loss> {
        let mut c = linked.client.clone();
        let r = self
            .call_for_backup(linked, c.reserve(linked.session, parent.as_ref(), keys))
            .await?;
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        let upto = r
            .iter()
            .take(keys.len())
            .take_while(|r| **r != Reserved::NoSpace)
            .count();
        let mine: Vec<(PageKey, PageCopy)> = keys
            .iter()
            .zip(pages)
            .zip(&r)
            .take(upto)
            .filter_map(|((k, &p), r)| match r {
                Reserved::Slot(s) => Some((
                    *k,
                    PageCopy {
                        device_page: p,
                        host_slot: *s,
                    },
                )),
                _ => None,
            })
            .collect();
        if mine.is_empty() {
            return Ok((upto, 0));
        }
        let reserved: Vec<PageKey> = mine.iter().map(|(k, _)| *k).collect();
        let copies: Vec<PageCopy> = mine.iter().map(|(_, c)| *c).collect();
        let (pool, dev) = (linked.pool.clone(), device.clone());
        let copied =
            match tokio::task::spawn_blocking(move || dev.copy_to_host(&pool, &copies)).await {
                Ok(r) => r,
                Err(e) => Err(DeviceError::Copy(format!("copy task failed: {e}"))),
            };
        if let Err(e) = copied {
            tracing::warn!("backup copy failed: {e}");
            let _ = self
                .call_for_backup(linked, c.abort(linked.session, &reserved))
                .await;
            return Err(Loss::CopyFailed);
        }
        self.call_for_backup(linked, c.commit(linked.session, &reserved))
            .await?;
        Ok((upto, reserved.len()))
    }

    /// Frees `n` device pages by policy, each one backed up to L2 first unless L2 refuses it
    /// (then it is lost, counted by reason). Fewer than `n` come back when the rest are
    /// locked by open requests, or by backups that did not finish within `cache.evict_wait`.
    pub(crate) async fn evict(
        &self,
        caller: &Caller,
        n: usize,
    ) -> Result<v1::EvictResponse, ApiError> {
        lock(&self.shared.state).engine(caller)?;
        let s = &self.shared;
        let started = Instant::now();
        let mut ev = Evicting::default();
        let mut waited = false;
        // Waiting for early backups in flight ends when none ends for `evict_wait`.
        let mut deadline = started + s.evict_wait;
        let mut in_flight = s.counters.in_flight.load(Ordering::Relaxed);
        loop {
            let blockers = self.evict_ready(n, &mut ev);
            if ev.pages.len() >= n {
                break;
            }
            let now = Instant::now();
            if blockers.is_empty() {
                // Nothing more may go now except pages whose early backups are in flight:
                // wait for those, as long as they keep ending.
                let flying = s.counters.in_flight.load(Ordering::Relaxed);
                if flying < in_flight {
                    deadline = now + s.evict_wait;
                }
                in_flight = flying;
                if flying == 0 || now >= deadline {
                    break;
                }
                waited = true;
                let done = s.backup_done.notified();
                let _ =
                    tokio::time::timeout(deadline.min(now + Duration::from_millis(50)) - now, done)
                        .await;
                continue;
            }
            waited = true;
            // Each backup waits for room in L2 itself, as long as L3 makes progress.
            let results: Vec<(NodeId, Backup)> = futures::stream::iter(blockers)
                .map(|b| async move { (b, self.backup_locked(b).await) })
                .buffer_unordered(s.backup_concurrency)
                .collect()
                .await;
            for (node, r) in results {
                if let Backup::Failed(why) = r {
                    ev.given_up.insert(node, why);
                }
            }
        }
        if waited {
            self.count_wait("evict", started.elapsed());
        }
        let lost: u64 = ev.lost.iter().sum();
        for why in Loss::ALL {
            self.count_lost(why, ev.lost[why.index()]);
        }
        s.metrics.evicted_pages.inc_by(ev.pages.len() as u64);
        Ok(v1::EvictResponse {
            pages: ev.pages,
            backed_up: ev.backed_up,
            lost: lost as u32,
        })
    }

    /// Evicts, in policy order, the victims that may go (backed up, or given up in this
    /// call), and returns the next ones in the way, locked and counted in flight for a backup.
    fn evict_ready(&self, n: usize, ev: &mut Evicting) -> Vec<NodeId> {
        let s = &self.shared;
        let mut st = lock(&s.state);
        let need = n - ev.pages.len();
        let given_up = &ev.given_up;
        let evicted = st.tree.evict_while(need, |id, backed_up| {
            backed_up || given_up.contains_key(&id)
        });
        for e in evicted {
            for &p in &e.values {
                st.in_tree[p as usize] = false;
            }
            let len = e.values.len() as u32;
            if e.backed_up {
                ev.backed_up += len;
            } else {
                let why = ev.given_up.get(&e.node).copied().unwrap_or(Loss::Refused);
                ev.lost[why.index()] += u64::from(len);
            }
            ev.pages.extend(e.values);
        }
        if ev.pages.len() >= n {
            return Vec::new();
        }
        let blockers: Vec<NodeId> = st
            .tree
            .peek_victims(n - ev.pages.len())
            .into_iter()
            .filter(|id| {
                !ev.given_up.contains_key(id) && st.tree.view(*id).is_ok_and(|v| !v.backed_up)
            })
            .collect();
        for &b in &blockers {
            // Victims are unlocked leaves: locking them cannot fail.
            let _ = st.tree.lock(b);
            s.counters.in_flight.fetch_add(1, Ordering::Relaxed);
        }
        blockers
    }
}

/// Runs queued early backups, `concurrency` at a time, until the queue closes.
pub async fn run_backups(
    svc: AgentService,
    worker: BackupWorker,
    stop: tokio_util::sync::CancellationToken,
) {
    let BackupWorker {
        mut rx,
        concurrency,
    } = worker;
    let permits = Arc::new(Semaphore::new(concurrency));
    loop {
        let (node, room) = tokio::select! {
            n = rx.recv() => match n { Some(n) => n, None => break },
            () = stop.cancelled() => break,
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let svc = svc.clone();
        tokio::spawn(async move {
            // Queued nodes were locked by `enqueue_backup`; an early backup that fails is
            // tried again when the node is evicted. Its pages leave the queue's room when it
            // ends.
            svc.backup_locked(node).await;
            drop((permit, room));
        });
    }
}
