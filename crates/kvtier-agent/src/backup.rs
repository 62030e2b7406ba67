//! Tree mode's device → L2 backups, and the eviction that never loses a computed page to
//! load.
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
//! Under every policy, [`Backups::evict`] gives a device page back to the engine only once
//! L2 holds a copy: it evicts what is backed up, backs up (concurrently) the victims in its
//! way, and waits for early backups in flight. Each backup is one [`L2::write`], which waits
//! for room in L2 while L3 makes progress: the backpressure an engine feels when L2 and L3
//! cannot keep up. A page is given up only when L2 refuses it, and then it is counted by
//! [`Loss`] reason.
//!
//! [`WritePolicy`]: kvtier_core::WritePolicy

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvtier_client::Evicted;
use kvtier_core::radix::NodeId;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc};

use crate::l2::{L2, Writer};
use crate::outcome::Loss;
use crate::shared::Shared;

type Queued = (NodeId, OwnedSemaphorePermit);

/// How one backup ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Backup {
    /// Every page of the node's path is in L2.
    Done,
    /// Some pages did not reach L2, for this reason.
    Failed(Loss),
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

/// The early-backup queue, its workers, and eviction.
pub(crate) struct Backups {
    s: Arc<Shared>,
    l2: L2,
    queue: mpsc::UnboundedSender<Queued>,
    /// Pages early backups may have queued or running; each entry holds its pages' share.
    room: Arc<Semaphore>,
    /// Woken whenever a backup ends (an Evict waiting for one).
    done: Notify,
}

/// The receiving end of the early-backup queue, for [`Backups::run`].
pub(crate) struct BackupWorker {
    rx: mpsc::UnboundedReceiver<Queued>,
}

impl Backups {
    pub(crate) fn new(s: Arc<Shared>, l2: L2) -> (Self, BackupWorker) {
        let (queue, rx) = mpsc::unbounded_channel();
        let room = Arc::new(Semaphore::new(s.settings.backup_queue_pages as usize));
        (
            Self {
                s,
                l2,
                queue,
                room,
                done: Notify::new(),
            },
            BackupWorker { rx },
        )
    }

    /// Queues an early backup of `node` (and its unbacked ancestors). The node is locked
    /// until its backup ends, so the engine's evictions cannot take its pages before they
    /// reached L2. When the queue has no room for its pages this waits, as long as the queue
    /// makes progress; after `cache.evict_wait` without any, the pages are left to their
    /// eviction (counted as deferred).
    pub(crate) async fn enqueue(&self, node: NodeId) {
        let s = &self.s;
        let pages = {
            let mut st = s.lock();
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
        let want = pages.min(s.settings.backup_queue_pages as usize) as u32;
        let permit = match self.room.clone().try_acquire_many_owned(want) {
            Ok(p) => Some(p),
            Err(TryAcquireError::Closed) => None,
            Err(TryAcquireError::NoPermits) => {
                let started = Instant::now();
                let p = self.wait_for_room(want).await;
                s.count_wait("insert", started.elapsed());
                p
            }
        };
        let queued = match permit {
            Some(p) => self.queue.send((node, p)).is_ok(),
            None => false,
        };
        if !queued {
            let _ = s.lock().tree.unlock(node);
            self.ended();
            s.counters
                .deferred
                .fetch_add(pages as u64, Ordering::Relaxed);
            s.count_backup("deferred", pages);
        }
    }

    /// Waits for `want` pages of room in the early-backup queue, as long as backups keep
    /// ending: `None` after `cache.evict_wait` in which none did.
    async fn wait_for_room(&self, want: u32) -> Option<OwnedSemaphorePermit> {
        let mut room = self.room.available_permits();
        loop {
            let acquire = self.room.clone().acquire_many_owned(want);
            match tokio::time::timeout(self.s.settings.evict_wait, acquire).await {
                Ok(p) => return p.ok(),
                Err(_) => {
                    let now = self.room.available_permits();
                    if now <= room {
                        return None;
                    }
                    room = now;
                }
            }
        }
    }

    fn ended(&self) {
        self.s.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.done.notify_waiters();
    }

    /// Backs up `node` and its ancestors not yet in L2, which the caller locked and counted
    /// in flight; unlocks it at the end. Pages are marked backed up as they reach L2, by the
    /// last one: the node is locked all along, so that page is still on its path however
    /// requests split the path meanwhile. A mark is made only through the current session (a
    /// mark made through a session since replaced would be assumed, not checked).
    async fn backup_locked(&self, node: NodeId) -> Backup {
        let fence = self.s.lock().engine.as_ref().map(|e| e.fence.clone());
        let r = self.backup(node).await;
        {
            // A registration since made a new tree: `node` names nothing of it (its ids
            // start over), so it is not touched. Checked under the lock a registration takes.
            let mut st = self.s.lock();
            if fence.is_some_and(|f| f.is_open()) {
                let _ = st.tree.unlock(node);
            }
        }
        self.ended();
        r
    }

    async fn backup(&self, node: NodeId) -> Backup {
        let s = &self.s;
        let (device, fence, keys, pages, parent) = {
            let st = s.lock();
            let Some((device, fence)) = st
                .engine
                .as_ref()
                .map(|e| (e.device.clone(), e.fence.clone()))
            else {
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
            (device, fence, keys, pages, parent)
        };
        let stored = self
            .l2
            .write(
                Writer::Background(&fence),
                &device,
                &keys,
                &pages,
                parent,
                |linked, upto| {
                    let mut st = s.lock();
                    if st.link_generation == linked.generation && fence.is_open() {
                        let _ = st.tree.mark_backed_up_through(node, &keys[upto - 1]);
                    }
                },
            )
            .await;
        match stored.failure {
            None => Backup::Done,
            Some(why) => Backup::Failed(why),
        }
    }

    /// Frees `n` device pages by policy, each one backed up to L2 first unless L2 refuses it
    /// (then it is lost, counted by reason). Fewer than `n` come back when the rest are
    /// locked by open requests, or by backups that did not finish within `cache.evict_wait`.
    pub(crate) async fn evict(&self, n: usize) -> Evicted {
        let s = &self.s;
        let wait = s.settings.evict_wait;
        let started = Instant::now();
        let mut ev = Evicting::default();
        let mut waited = false;
        // Waiting for early backups in flight ends when none ends for `evict_wait`.
        let mut deadline = started + wait;
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
                    deadline = now + wait;
                }
                in_flight = flying;
                if flying == 0 || now >= deadline {
                    break;
                }
                waited = true;
                let done = self.done.notified();
                let _ =
                    tokio::time::timeout(deadline.min(now + Duration::from_millis(50)) - now, done)
                        .await;
                continue;
            }
            waited = true;
            // Each backup waits for room in L2 itself, as long as L3 makes progress.
            let results: Vec<(NodeId, Backup)> = futures::stream::iter(blockers)
                .map(|b| async move { (b, self.backup_locked(b).await) })
                .buffer_unordered(s.settings.backup_concurrency)
                .collect()
                .await;
            for (node, r) in results {
                if let Backup::Failed(why) = r {
                    ev.given_up.insert(node, why);
                }
            }
        }
        if waited {
            s.count_wait("evict", started.elapsed());
        }
        let lost: u64 = ev.lost.iter().sum();
        for why in Loss::ALL {
            s.count_lost(why, ev.lost[why.index()]);
        }
        s.metrics.evicted_pages.inc_by(ev.pages.len() as u64);
        Evicted {
            pages: ev.pages,
            backed_up: ev.backed_up,
            lost: lost as u32,
        }
    }

    /// Evicts, in policy order, the victims that may go (backed up, or given up in this
    /// call), and returns the next ones in the way, locked and counted in flight for a backup.
    fn evict_ready(&self, n: usize, ev: &mut Evicting) -> Vec<NodeId> {
        let s = &self.s;
        let mut st = s.lock();
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

    /// Runs queued early backups, `cache.backup_concurrency` at a time, until the queue
    /// closes or `stop`.
    pub(crate) async fn run(self: Arc<Self>, worker: BackupWorker) {
        let stop = self.s.tasks.shutdown.clone();
        let BackupWorker { mut rx } = worker;
        let permits = Arc::new(Semaphore::new(self.s.settings.backup_concurrency));
        loop {
            let (node, room) = tokio::select! {
                n = rx.recv() => match n { Some(n) => n, None => break },
                () = stop.cancelled() => break,
            };
            let Ok(permit) = permits.clone().acquire_owned().await else {
                break;
            };
            let me = self.clone();
            self.s.tasks.spawn(async move {
                // Queued nodes were locked by `enqueue`; an early backup that fails is tried
                // again when the node is evicted. Its pages leave the queue's room when it
                // ends.
                me.backup_locked(node).await;
                drop((permit, room));
            });
        }
    }
}
