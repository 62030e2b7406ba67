//! The pool side of prefetches: the open prefetches of every session, their reserved slots
//! and landed pages. The fetching itself is in [`crate::prefetch`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::StopPolicy;
use kvtier_core::host_index::{OwnerId, Reserve};
use kvtier_core::{Layout, LayoutFingerprint, PageKey, SessionId};
use kvtier_shm::ShmPool;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::HostState;
use super::StateError;

/// Index owners of prefetches have this bit set, so they never collide with session ids.
const PREFETCH_OWNER: OwnerId = 1 << 63;

/// Where a prefetch stands: running, or how it ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Pages are being fetched.
    Running,
    /// Every hit page landed.
    Completed,
    /// A best-effort take stopped it; what landed is usable.
    Partial,
    /// Its deadline came; what landed is usable.
    TimedOut,
    /// Nothing was allocated (see the reason).
    Revoked,
    /// It stopped at a page that could not be read, or was released (see the reason).
    Failed,
}

impl Phase {
    /// The metric label and log word for it.
    pub fn label(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Partial => "partial",
            Self::TimedOut => "timed_out",
            Self::Revoked => "revoked",
            Self::Failed => "failed",
        }
    }

    /// Whether it has ended (nothing will change any more).
    pub fn is_final(self) -> bool {
        self != Self::Running
    }
}

/// Where one prefetch stands, as its session sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The session's name for it.
    pub request_id: String,
    /// Running, or how it ended.
    pub phase: Phase,
    /// Why it ended that way (revoked, failed).
    pub reason: String,
    /// Its stop policy.
    pub policy: StopPolicy,
    /// Leading keys ready in L2 when it started (not fetched).
    pub l2_pages: usize,
    /// Keys after those being (or that were) fetched from L3.
    pub hit_pages: usize,
    /// Of the hit pages, the leading ones that landed.
    pub landed_pages: usize,
    /// Bytes of the landed pages.
    pub landed_bytes: u64,
    /// Since it started.
    pub elapsed: Duration,
    /// When the daemon stops it, from its start (zero: not planned).
    pub deadline: Duration,
}

impl Progress {
    /// A prefetch that allocated nothing, for `reason`.
    pub fn revoked(request_id: String, policy: StopPolicy, l2: usize, reason: &str) -> Self {
        Self {
            request_id,
            phase: Phase::Revoked,
            reason: reason.to_string(),
            policy,
            l2_pages: l2,
            hit_pages: 0,
            landed_pages: 0,
            landed_bytes: 0,
            elapsed: Duration::ZERO,
            deadline: Duration::ZERO,
        }
    }
}

/// Why a running prefetch was told to stop early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopCause {
    /// A best-effort take: keep what landed.
    Taken,
    /// ReleasePrefetch: drop everything.
    Released,
    /// Its session closed or expired: drop everything.
    SessionClosed,
}

/// One open prefetch: its pages, how far it got, and who waits on it.
#[derive(Debug)]
pub struct PrefetchEntry {
    /// The session that asked.
    pub session: SessionId,
    /// The session's name for it.
    pub request_id: String,
    /// The pool ([`super::L2Pool::key`]).
    pub fp: LayoutFingerprint,
    /// Stop policy.
    pub policy: StopPolicy,
    /// The request's keys up to the end of the hit.
    pub keys: Vec<PageKey>,
    /// Leading keys that were ready in L2.
    pub l2: usize,
    /// Keys of the hit and their slots, in order: reserved for fetching, or (where
    /// `in_place`) ready in L2 already and pinned by the prefetch.
    pub hit: Vec<(PageKey, u32)>,
    /// Which hit pages were ready in L2 when the prefetch opened: a page whose prefix left
    /// L2 for L3 may still be in L2 itself. Nothing is fetched for them.
    pub in_place: Vec<bool>,
    /// Leading hit pages that landed (committed and pinned).
    pub landed: usize,
    /// Bytes per page.
    pub page_bytes: u64,
    /// When it started.
    pub started: Instant,
    /// When the daemon stops it.
    pub deadline: Instant,
    /// The L3 generation it read from: pages it lands after L3 was cleared are not marked
    /// held by L3.
    pub epoch: u64,
    /// Running, or how it ended.
    pub state: Phase,
    /// Why it ended that way (failed / revoked).
    pub reason: String,
    /// Cancels its fetches.
    pub cancel: CancellationToken,
    /// Set when something told it to stop early.
    pub stop: Option<StopCause>,
    /// Progress, for streams and waiters.
    pub tx: watch::Sender<Progress>,
}

impl PrefetchEntry {
    /// Where it stands.
    pub fn progress(&self) -> Progress {
        Progress {
            request_id: self.request_id.clone(),
            phase: self.state,
            reason: self.reason.clone(),
            policy: self.policy,
            l2_pages: self.l2,
            hit_pages: self.hit.len(),
            landed_pages: self.landed,
            landed_bytes: self.landed as u64 * self.page_bytes,
            elapsed: self.started.elapsed(),
            deadline: self.deadline.saturating_duration_since(self.started),
        }
    }

    /// Sends the current progress to every subscriber.
    pub fn publish(&self) {
        self.tx.send_replace(self.progress());
    }

    fn owner(id: u64) -> OwnerId {
        PREFETCH_OWNER | id
    }
}

/// What a prefetch asks of the pool when it opens (see [`HostState::prefetch_open`]).
#[derive(Debug)]
pub struct PrefetchOpen {
    /// The asking session.
    pub session: SessionId,
    /// Its name for the request.
    pub request_id: String,
    /// The request's keys.
    pub keys: Vec<PageKey>,
    /// The key before `keys[0]`, if any.
    pub parent: Option<PageKey>,
    /// Leading keys found ready in L2 while planning.
    pub l2: usize,
    /// Keys after those that L3 holds.
    pub hit: usize,
    /// Fewest pages worth fetching (the threshold).
    pub min_pages: usize,
    /// Stop policy.
    pub policy: StopPolicy,
    /// When it started.
    pub started: Instant,
    /// When the daemon stops it.
    pub deadline: Instant,
    /// Cancels its fetches.
    pub cancel: CancellationToken,
}

/// The outcome of [`HostState::prefetch_open`].
#[derive(Debug)]
pub enum Opened {
    /// Slots reserved: fetch `hit` into them (but those `in_place`).
    Open {
        /// Its id.
        id: u64,
        /// Keys and their slots, in order.
        hit: Vec<(PageKey, u32)>,
        /// Hit pages ready in L2 already (pinned, nothing to fetch).
        in_place: Vec<bool>,
        /// Leading keys ready in L2.
        l2: usize,
        /// The pool to copy into.
        shm: Arc<ShmPool>,
        /// Its progress after this.
        rx: watch::Receiver<Progress>,
        /// Its progress now: the plan.
        first: Progress,
    },
    /// Nothing allocated, for this reason.
    Revoked(&'static str),
}

/// What a finished prefetch did, for metrics.
#[derive(Debug, Clone)]
pub struct Finished {
    /// How it ended.
    pub state: Phase,
    /// Why (failed).
    pub reason: String,
    /// Pages that landed.
    pub landed: usize,
    /// Bytes that landed.
    pub bytes: u64,
    /// When it started.
    pub started: Instant,
}

/// Prefetches: the pool side. The fetching itself is in [`crate::prefetch`].
/// The open prefetches: by daemon id, and by the name each session gave its own. Their
/// slots live in the pools; the methods of [`HostState`] below move both together.
#[derive(Debug)]
pub struct Prefetches {
    entries: HashMap<u64, PrefetchEntry>,
    names: HashMap<(SessionId, String), u64>,
    next: u64,
    /// Share of a pool's slots prefetches may hold (`prefetch.budget_fraction`).
    budget: f64,
}

impl Prefetches {
    pub(super) fn new(budget: f64) -> Self {
        Self {
            entries: HashMap::new(),
            names: HashMap::new(),
            next: 1,
            budget,
        }
    }

    /// The names of the prefetches `session` has open.
    pub(super) fn of_session(&self, session: SessionId) -> Vec<String> {
        self.names
            .keys()
            .filter(|(sid, _)| *sid == session)
            .map(|(_, name)| name.clone())
            .collect()
    }

    /// How many prefetches `session` has open.
    fn open_in(&self, session: SessionId) -> usize {
        self.names.keys().filter(|(s, _)| *s == session).count()
    }

    /// Whether `session` has a prefetch named `name` open.
    fn is_open(&self, session: SessionId, name: &str) -> bool {
        self.names.contains_key(&(session, name.to_string()))
    }
}

impl HostState {
    /// Checks that `session` may open prefetch `request_id`; returns its layout and how many
    /// leading `keys` are ready in L2.
    pub fn prefetch_check(
        &mut self,
        session: SessionId,
        request_id: &str,
        keys: &[PageKey],
        max_per_session: usize,
        now: Instant,
    ) -> Result<(Layout, usize), StateError> {
        self.admitting("new prefetches")?;
        let (_, pool) = self.session_pool(session, now)?;
        let l2 = pool.index.lookup(keys);
        let layout = pool.layout.clone();
        if self.prefetches.is_open(session, request_id) {
            return Err(StateError::invalid(
                "request_id",
                format!("{request_id:?} is already open in this session; take or release it first"),
            ));
        }
        let open = self.prefetches.open_in(session);
        if open >= max_per_session {
            return Err(StateError::Full(format!(
                "the session has {open} open prefetches (prefetch.max_per_session); take or \
                 release some"
            )));
        }
        Ok((layout, l2))
    }

    /// Reserves slots for the hit pages after the L2 prefix, within the prefetch budget, or
    /// decides not to (nothing allocated then).
    pub fn prefetch_open(&mut self, o: PrefetchOpen) -> Result<Opened, StateError> {
        let budget = self.prefetches.budget;
        let id = self.prefetches.next;
        if self.prefetches.is_open(o.session, &o.request_id) {
            return Err(StateError::invalid(
                "request_id",
                format!("{:?} is already open in this session", o.request_id),
            ));
        }
        let (_, pool) = self.session_pool(o.session, o.started)?;
        // L2 may have changed since planning: pages evicted from the prefix make the hit
        // unreachable; pages that arrived are skipped.
        let l2 = pool.index.lookup(&o.keys[..o.l2 + o.hit]);
        if l2 < o.l2 {
            return Ok(Opened::Revoked("busy"));
        }
        let min = o.min_pages.max(1);
        let limit = (f64::from(pool.index.stats().capacity) * budget) as u32;
        let room = limit.saturating_sub(pool.prefetch_held) as usize;
        let end = (o.l2 + o.hit).min(l2 + room);
        if end < l2 + min {
            return Ok(Opened::Revoked(if l2 >= o.l2 + o.hit {
                "in_l2"
            } else {
                "budget"
            }));
        }
        let want = &o.keys[l2..end];
        let parent = if l2 > 0 {
            Some(o.keys[l2 - 1])
        } else {
            o.parent
        };
        let owner = PrefetchEntry::owner(id);
        // Hit pages ready in L2 (behind a page that left for L3) are pinned in place first,
        // so making room for the others cannot evict them.
        let pinned: Vec<Option<u32>> = want.iter().map(|k| pool.index.acquire_one(k)).collect();
        let (mode, lost) = (pool.index.l3_mode(), pool.index.stats().unwritten_evictions);
        let (out, evicted) = pool.index.reserve_clean(owner, parent, want);
        pool.handed_out(out.iter().filter_map(|r| match r {
            Reserve::Reserved(s) => Some(*s),
            _ => None,
        }));
        let lost_after = pool.index.stats().unwritten_evictions;
        let slot = |i: usize| match (out[i], pinned[i]) {
            (Reserve::Reserved(s), _) | (_, Some(s)) => Some(s),
            _ => None,
        };
        // Pages after a gap (being written by someone else, or no room) cannot be a prefix.
        let run = (0..want.len()).take_while(|&i| slot(i).is_some()).count();
        let (mut abort, mut unpin) = (Vec::new(), Vec::new());
        for (i, k) in want.iter().enumerate() {
            let gone = i >= run || run < min;
            if gone && matches!(out[i], Reserve::Reserved(_)) {
                abort.push(*k);
            }
            if gone && pinned[i].is_some() {
                unpin.push(*k);
            }
        }
        if let Err(e) = pool.index.abort(owner, &abort) {
            tracing::error!("prefetch reservations disagree with the index: {e}");
        }
        if let Err(e) = pool.index.release(&unpin) {
            tracing::error!("prefetch pins disagree with the index: {e}");
        }
        if run < min {
            self.count_lost(mode, lost, lost_after);
            return Ok(Opened::Revoked(match out.get(run) {
                Some(Reserve::Present) => "busy",
                _ => "no_space",
            }));
        }
        let hit: Vec<(PageKey, u32)> = (0..run)
            .filter_map(|i| slot(i).map(|s| (want[i], s)))
            .collect();
        let in_place: Vec<bool> = pinned[..run].iter().map(Option::is_some).collect();
        pool.prefetch_held += run as u32;
        let shm = pool.shm.clone();
        let page_bytes = pool.layout.page_bytes() as u64;
        let fp = pool.key;
        self.counters.prefetch_evictions += evicted.len() as u64;
        self.count_lost(mode, lost, lost_after);
        self.prefetches.next += 1;
        let mut keys = o.keys;
        keys.truncate(l2 + run);
        let entry = PrefetchEntry {
            session: o.session,
            request_id: o.request_id.clone(),
            fp,
            policy: o.policy,
            keys,
            l2,
            hit: hit.clone(),
            in_place: in_place.clone(),
            landed: 0,
            page_bytes,
            started: o.started,
            deadline: o.deadline,
            epoch: self.l3.epoch(),
            state: Phase::Running,
            reason: String::new(),
            cancel: o.cancel,
            stop: None,
            tx: watch::channel(Progress::revoked(String::new(), o.policy, 0, "")).0,
        };
        let first = entry.progress();
        entry.tx.send_replace(first.clone());
        let rx = entry.tx.subscribe();
        self.prefetches.entries.insert(id, entry);
        self.prefetches.names.insert((o.session, o.request_id), id);
        Ok(Opened::Open {
            id,
            hit,
            in_place,
            l2,
            shm,
            rx,
            first,
        })
    }

    /// A fetched page is in its slot: make it ready, pinned, and persisted, and seal its
    /// slot's record with `crc`, the CRC32C its verified read computed of the bytes it wrote
    /// there (none: the sealer checksums it later). `false` when the prefetch is gone or the
    /// page is not its next one (the caller then stops).
    pub fn prefetch_land(&mut self, id: u64, crc: Option<u32>) -> bool {
        let Some(e) = self.prefetches.entries.get_mut(&id) else {
            return false;
        };
        let Some(&(key, _)) = e.hit.get(e.landed) else {
            return false;
        };
        if e.in_place.get(e.landed).copied().unwrap_or(false) {
            // Ready and pinned since the prefetch opened.
            e.landed += 1;
            return true;
        }
        let Some(pool) = self.pools.get_mut(&e.fp) else {
            return false;
        };
        let held = e.epoch == self.l3.epoch();
        match pool
            .index
            .commit_pinned(PrefetchEntry::owner(id), &[key], held)
        {
            Ok(_) => {
                if crc.is_some_and(|crc| pool.committed_read(key, crc)) {
                    self.counters.sealed_pages += 1;
                    self.counters.sealed_from_reads += 1;
                } else {
                    pool.committed(&[key]);
                }
                e.landed += 1;
                true
            }
            Err(err) => {
                tracing::error!(prefetch = id, "landing a page failed: {err}");
                false
            }
        }
    }

    /// Publishes a prefetch's progress.
    pub fn prefetch_publish(&self, id: u64) {
        if let Some(e) = self.prefetches.entries.get(&id) {
            e.publish();
        }
    }

    /// Ends a prefetch's fetching: frees the slots of pages that did not land and records how
    /// it ended. A prefetch dropped meanwhile (released, session closed) also gives up its
    /// landed pages and is forgotten.
    pub fn prefetch_finish(&mut self, id: u64, state: Phase, reason: &str) -> Option<Finished> {
        let e = self.prefetches.entries.get_mut(&id)?;
        let pool = self.pools.get_mut(&e.fp)?;
        let (mut rest, mut unpin) = (Vec::new(), Vec::new());
        for (&(k, _), &in_place) in e.hit.iter().zip(&e.in_place).skip(e.landed) {
            if in_place {
                unpin.push(k);
            } else {
                rest.push(k);
            }
        }
        if let Err(err) = pool.index.abort(PrefetchEntry::owner(id), &rest) {
            tracing::error!(
                prefetch = id,
                "prefetch reservations disagree with the index: {err}"
            );
        }
        if let Err(err) = pool.index.release(&unpin) {
            tracing::error!(
                prefetch = id,
                "prefetch pins disagree with the index: {err}"
            );
        }
        pool.prefetch_held -= (rest.len() + unpin.len()) as u32;
        let all = e.landed == e.hit.len();
        let (state, reason) = match e.stop {
            Some(StopCause::Released) => (Phase::Failed, "released".to_string()),
            Some(StopCause::SessionClosed) => (Phase::Failed, "session_closed".to_string()),
            // Everything landed just as a take or the deadline came.
            _ if all => (Phase::Completed, String::new()),
            Some(StopCause::Taken) if state == Phase::Failed && reason == "cancelled" => {
                (Phase::Partial, String::new())
            }
            _ => (state, reason.to_string()),
        };
        e.state = state;
        e.reason = reason.clone();
        e.hit.truncate(e.landed);
        e.in_place.truncate(e.landed);
        e.keys.truncate(e.l2 + e.landed);
        e.publish();
        let done = Finished {
            state,
            reason,
            landed: e.landed,
            bytes: e.landed as u64 * e.page_bytes,
            started: e.started,
        };
        if matches!(e.stop, Some(StopCause::Released | StopCause::SessionClosed)) {
            let (session, name) = (e.session, e.request_id.clone());
            self.prefetch_forget(session, &name);
        }
        Some(done)
    }

    /// Unpins a finished prefetch's landed pages and forgets it.
    fn prefetch_forget(&mut self, session: SessionId, request_id: &str) {
        let Some(id) = self
            .prefetches
            .names
            .remove(&(session, request_id.to_string()))
        else {
            return;
        };
        let Some(e) = self.prefetches.entries.remove(&id) else {
            return;
        };
        if let Some(pool) = self.pools.get_mut(&e.fp) {
            let landed: Vec<PageKey> = e.hit[..e.landed].iter().map(|(k, _)| *k).collect();
            if let Err(err) = pool.index.release(&landed) {
                tracing::error!(
                    prefetch = id,
                    "prefetch pins disagree with the index: {err}"
                );
            }
            pool.prefetch_held -= e.landed as u32;
        }
    }

    /// Stops a prefetch for `cause` (release, session end) and drops its pins: at once when it
    /// is done, else when its fetching has stopped. `false` when there is no such prefetch.
    pub fn prefetch_drop(
        &mut self,
        session: SessionId,
        request_id: &str,
        cause: StopCause,
    ) -> bool {
        let Some(&id) = self
            .prefetches
            .names
            .get(&(session, request_id.to_string()))
        else {
            return false;
        };
        let Some(e) = self.prefetches.entries.get_mut(&id) else {
            return false;
        };
        if e.state == Phase::Running {
            e.stop = Some(cause);
            e.cancel.cancel();
        } else {
            self.prefetch_forget(session, request_id);
        }
        true
    }

    /// A prefetch's progress receiver, policy and cancel token. A best-effort prefetch is told
    /// to stop here when `take` is set.
    pub fn prefetch_watch(
        &mut self,
        session: SessionId,
        request_id: &str,
        take: bool,
        now: Instant,
    ) -> Result<(watch::Receiver<Progress>, StopPolicy), StateError> {
        self.touch(session, now)?;
        let e = self
            .prefetches
            .names
            .get(&(session, request_id.to_string()))
            .and_then(|id| self.prefetches.entries.get_mut(id))
            .ok_or_else(|| unknown_prefetch(request_id))?;
        if take && e.policy == StopPolicy::BestEffort && e.state == Phase::Running {
            e.stop = Some(StopCause::Taken);
            e.cancel.cancel();
        }
        Ok((e.tx.subscribe(), e.policy))
    }

    /// Hands a finished prefetch to its session: pins the L2 pages it skipped and turns the
    /// landed pages' pins into the session's. Returns its final progress and the slots of
    /// the usable prefix.
    pub fn prefetch_take(
        &mut self,
        session: SessionId,
        request_id: &str,
        now: Instant,
    ) -> Result<(Progress, Vec<u32>), StateError> {
        let name = (session, request_id.to_string());
        let id = *self
            .prefetches
            .names
            .get(&name)
            .ok_or_else(|| unknown_prefetch(request_id))?;
        let e = self
            .prefetches
            .entries
            .get(&id)
            .ok_or_else(|| unknown_prefetch(request_id))?;
        if e.state == Phase::Running {
            return Err(StateError::Refused(format!(
                "prefetch {request_id:?} is still running"
            )));
        }
        let progress = e.progress();
        let (l2_keys, landed): (Vec<PageKey>, Vec<(PageKey, u32)>) =
            (e.keys[..e.l2].to_vec(), e.hit[..e.landed].to_vec());
        let (sess, pool) = self.session_pool(session, now)?;
        let mut slots = pool.index.acquire(&l2_keys);
        for &s in &slots {
            *sess.pins.entry(s).or_insert(0) += 1;
        }
        let usable = slots.len() == l2_keys.len();
        if usable {
            for &(_, s) in &landed {
                *sess.pins.entry(s).or_insert(0) += 1;
                slots.push(s);
            }
        } else {
            let keys: Vec<PageKey> = landed.iter().map(|(k, _)| *k).collect();
            if let Err(err) = pool.index.release(&keys) {
                tracing::error!(
                    prefetch = id,
                    "prefetch pins disagree with the index: {err}"
                );
            }
        }
        pool.prefetch_held -= landed.len() as u32;
        self.prefetches.names.remove(&name);
        self.prefetches.entries.remove(&id);
        self.counters.acquired_pages += slots.len() as u64;
        Ok((progress, slots))
    }

    /// The progress of an open prefetch.
    pub fn prefetch_status(
        &mut self,
        session: SessionId,
        request_id: &str,
        now: Instant,
    ) -> Result<Progress, StateError> {
        self.touch(session, now)?;
        self.prefetches
            .names
            .get(&(session, request_id.to_string()))
            .and_then(|id| self.prefetches.entries.get(id))
            .map(PrefetchEntry::progress)
            .ok_or_else(|| unknown_prefetch(request_id))
    }

    /// Prefetches running, slots they hold, and the budget over every pool.
    pub fn prefetch_totals(&self) -> (usize, u64, u64) {
        let running = self
            .prefetches
            .entries
            .values()
            .filter(|e| e.state == Phase::Running)
            .count();
        let held = self
            .pools
            .values()
            .map(|p| u64::from(p.prefetch_held))
            .sum();
        let limit = self
            .pools
            .values()
            .map(|p| (f64::from(p.index.stats().capacity) * self.prefetches.budget) as u64)
            .sum();
        (running, held, limit)
    }
}

fn unknown_prefetch(request_id: &str) -> StateError {
    StateError::UnknownPrefetch(request_id.to_string())
}
