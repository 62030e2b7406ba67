//! The daemon's L2 state: one pool per layout class (shared memory + index) and the client
//! sessions that own pins and reservations. Synchronous; the service holds it behind a mutex
//! for the few microseconds each batch takes, and never across an await.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::{DaemonConfig, StopPolicy, WritePolicy};
use kvtier_core::host_index::{HostIndex, HostIndexStats, OwnerId, Reserve};
use kvtier_core::{Layout, LayoutFingerprint, PageKey, PolicyKind};
use kvtier_proto::ApiError;
use kvtier_proto::v1::{self, PrefetchState};
use kvtier_shm::{Backing, PoolSpec, ShmPool};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::l3::Job;

/// One pool class: the shared memory of one layout and its index.
#[derive(Debug)]
pub struct Pool {
    /// The layout every page in this pool has.
    pub layout: Layout,
    /// The shared memory (shared with the L3 writer, which copies pinned slots out).
    pub shm: Arc<ShmPool>,
    /// Which key is in which slot.
    pub index: HostIndex,
    /// Slots held by prefetches: reserved for pages on their way, or landed and not taken.
    pub prefetch_held: u32,
}

/// Index owners of prefetches have this bit set, so they never collide with session ids.
const PREFETCH_OWNER: OwnerId = 1 << 63;

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
    pub session: u64,
    /// The session's name for it.
    pub request_id: String,
    /// The pool class.
    pub fp: LayoutFingerprint,
    /// Stop policy.
    pub policy: StopPolicy,
    /// The request's keys up to the end of the hit.
    pub keys: Vec<PageKey>,
    /// Leading keys that were ready in L2.
    pub l2: usize,
    /// Keys being fetched and their reserved slots, in order.
    pub hit: Vec<(PageKey, u32)>,
    /// Leading hit pages that landed (committed and pinned).
    pub landed: usize,
    /// Bytes per page.
    pub page_bytes: u64,
    /// When it started.
    pub started: Instant,
    /// When the daemon stops it.
    pub deadline: Instant,
    /// Running, or how it ended.
    pub state: PrefetchState,
    /// Why it ended that way (failed / revoked).
    pub reason: String,
    /// Cancels its fetches.
    pub cancel: CancellationToken,
    /// Set when something told it to stop early.
    pub stop: Option<StopCause>,
    /// Progress, for streams and waiters.
    pub tx: watch::Sender<v1::PrefetchProgress>,
}

impl PrefetchEntry {
    /// The wire view of where it stands.
    pub fn progress(&self) -> v1::PrefetchProgress {
        let policy = match self.policy {
            StopPolicy::BestEffort => v1::PrefetchPolicy::BestEffort,
            StopPolicy::WaitComplete => v1::PrefetchPolicy::WaitComplete,
            StopPolicy::Timeout => v1::PrefetchPolicy::Timeout,
        };
        v1::PrefetchProgress {
            request_id: self.request_id.clone(),
            state: self.state as i32,
            reason: self.reason.clone(),
            policy: policy as i32,
            l2_pages: self.l2 as u32,
            hit_pages: self.hit.len() as u32,
            landed_pages: self.landed as u32,
            landed_bytes: self.landed as u64 * self.page_bytes,
            elapsed_ms: self.started.elapsed().as_millis() as u64,
            deadline_ms: self
                .deadline
                .saturating_duration_since(self.started)
                .as_millis() as u64,
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
    pub session: u64,
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
    /// Slots reserved: fetch `hit` into them.
    Open {
        /// Its id.
        id: u64,
        /// Keys and their slots, in order.
        hit: Vec<(PageKey, u32)>,
        /// Leading keys ready in L2.
        l2: usize,
        /// The pool to copy into.
        shm: Arc<ShmPool>,
        /// Its progress after this.
        rx: watch::Receiver<v1::PrefetchProgress>,
        /// Its progress now: the plan.
        first: v1::PrefetchProgress,
    },
    /// Nothing allocated, for this reason.
    Revoked(&'static str),
}

/// What a finished prefetch did, for metrics.
#[derive(Debug, Clone)]
pub struct Finished {
    /// How it ended.
    pub state: PrefetchState,
    /// Why (failed).
    pub reason: String,
    /// Pages that landed.
    pub landed: usize,
    /// Bytes that landed.
    pub bytes: u64,
    /// When it started.
    pub started: Instant,
}

/// A registered client.
#[derive(Debug)]
pub struct Session {
    /// Client-chosen name.
    pub name: String,
    /// The pool class it uses.
    pub fingerprint: LayoutFingerprint,
    /// Last request or heartbeat.
    pub last_seen: Instant,
    /// Pins it holds, with multiplicity.
    pub pins: HashMap<PageKey, u32>,
    /// Pages it has reserved and not yet committed or aborted.
    pub writing: HashSet<PageKey>,
    /// The client's last report (agents send one with each heartbeat).
    pub report: Option<v1::ClientReport>,
}

/// Counters since start (exported as metrics and in Stats).
#[derive(Debug, Default, Clone, Copy)]
pub struct Counters {
    /// Reserve calls.
    pub reserve_calls: u64,
    /// Commit calls.
    pub commit_calls: u64,
    /// Acquire calls.
    pub acquire_calls: u64,
    /// Pages a Reserve found already present.
    pub dedup_pages: u64,
    /// Pages reserved.
    pub reserved_pages: u64,
    /// Pages committed.
    pub committed_pages: u64,
    /// Pages acquired (pinned).
    pub acquired_pages: u64,
    /// Pages a Reserve could not place.
    pub no_space_pages: u64,
    /// Sessions ended by lease expiry.
    pub expired_sessions: u64,
    /// Pins dropped because their session ended without releasing them.
    pub dropped_pins: u64,
    /// Reservations freed because their session ended without committing them.
    pub dropped_reservations: u64,
    /// Pages evicted to make room for prefetches.
    pub prefetch_evictions: u64,
}

/// What a client gets back from [`HostState::register`].
#[derive(Debug, Clone)]
pub struct Registered {
    /// The new session.
    pub session_id: u64,
    /// Its pool's path, slots and stride.
    pub pool_path: PathBuf,
    /// Slots in the pool.
    pub slots: u32,
    /// Bytes per slot.
    pub stride: usize,
}

/// All L2 state of the daemon.
#[derive(Debug)]
pub struct HostState {
    pools: HashMap<LayoutFingerprint, Pool>,
    sessions: HashMap<u64, Session>,
    next_session: u64,
    ttl: Duration,
    policy: PolicyKind,
    backing: Backing,
    shm_dir: PathBuf,
    pool_bytes: u64,
    pool_pages: u64,
    max_pools: u32,
    mlock: bool,
    huge_pages: bool,
    reserve: bool,
    /// The L3 write policy and threshold, when there is an L3.
    write: Option<(WritePolicy, u64)>,
    prefetches: HashMap<u64, PrefetchEntry>,
    prefetch_names: HashMap<(u64, String), u64>,
    next_prefetch: u64,
    prefetch_budget: f64,
    /// Counters since start.
    pub counters: Counters,
}

fn unknown_session(id: u64) -> ApiError {
    ApiError::NotFound(format!(
        "session {id} is unknown or expired; register again"
    ))
}

impl HostState {
    /// Empty state configured by `cfg` (already validated).
    pub fn new(cfg: &DaemonConfig) -> Self {
        Self {
            pools: HashMap::new(),
            sessions: HashMap::new(),
            next_session: 1,
            ttl: cfg.sessions.ttl.0,
            policy: cfg.eviction_policy(),
            backing: if cfg.l2.backing == "memfd" {
                Backing::Memfd
            } else {
                Backing::ShmFile
            },
            shm_dir: cfg.l2.shm_dir.clone(),
            pool_bytes: cfg.l2.pool_bytes.0,
            pool_pages: cfg.l2.pool_pages,
            max_pools: cfg.l2.max_pools,
            mlock: cfg.l2.mlock,
            huge_pages: cfg.l2.huge_pages,
            reserve: cfg.l2.reserve,
            write: (cfg.l3.backend != "none").then(|| (cfg.l3.policy(), cfg.l3.write_threshold)),
            prefetches: HashMap::new(),
            prefetch_names: HashMap::new(),
            next_prefetch: 1,
            prefetch_budget: cfg.prefetch.budget_fraction,
            counters: Counters::default(),
        }
    }

    fn jobs(pool: &Pool, queued: Vec<(PageKey, u32)>) -> Vec<Job> {
        queued
            .into_iter()
            .map(|(key, slot)| Job {
                fp: pool.layout.fingerprint(),
                key,
                slot,
                pool: pool.shm.clone(),
                len: pool.layout.page_bytes(),
            })
            .collect()
    }

    /// Changes the L3 write policy (an L3 tier attached, swapped or detached). Write-back
    /// makes eviction wait for L3; without it, every pool evicts freely again.
    pub fn set_write(&mut self, write: Option<(WritePolicy, u64)>) {
        self.write = write;
        let write_back = matches!(write, Some((WritePolicy::WriteBack, _)));
        for pool in self.pools.values_mut() {
            pool.index.set_evict_needs_l3(write_back);
        }
    }

    /// Ends an L3 write: unpins the page, marks it persisted if the write landed.
    pub fn finish_l3(&mut self, fp: &LayoutFingerprint, key: &PageKey, landed: bool) {
        if let Some(p) = self.pools.get_mut(fp) {
            p.index.finish_l3(key, landed);
        }
    }

    /// Write-back: the coldest unpersisted pages of every pool running short of free slots.
    pub fn flush_jobs(&mut self, batch: usize) -> Vec<Job> {
        let mut out = Vec::new();
        for pool in self.pools.values_mut() {
            let cap = pool.index.stats().capacity;
            if pool.index.free_slots() < cap / 4 + 1 {
                let queued = pool.index.flush_candidates(batch);
                out.extend(Self::jobs(pool, queued));
            }
        }
        out
    }

    /// The layout class of a session.
    pub fn session_fingerprint(&self, id: u64) -> Result<LayoutFingerprint, ApiError> {
        self.sessions
            .get(&id)
            .map(|s| s.fingerprint)
            .ok_or_else(|| unknown_session(id))
    }

    /// Marks a session alive and keeps the report its heartbeat carried.
    pub fn heartbeat(
        &mut self,
        id: u64,
        report: Option<v1::ClientReport>,
        now: Instant,
    ) -> Result<(), ApiError> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| unknown_session(id))?;
        s.last_seen = now;
        if report.is_some() {
            s.report = report;
        }
        Ok(())
    }

    /// Session lease.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Pools by layout.
    pub fn pools(&self) -> impl Iterator<Item = &Pool> {
        self.pools.values()
    }

    /// Live sessions.
    pub fn sessions(&self) -> impl Iterator<Item = (&u64, &Session)> {
        self.sessions.iter()
    }

    fn pool_for(&mut self, layout: &Layout) -> Result<&mut Pool, ApiError> {
        let fp = layout.fingerprint();
        if !self.pools.contains_key(&fp) {
            if self.pools.len() >= self.max_pools as usize {
                return Err(ApiError::ResourceExhausted(format!(
                    "l2.max_pools ({}) layouts are already served; this layout ({}) is not",
                    self.max_pools,
                    layout.spec().model_id
                )));
            }
            let stride = layout.slot_stride() as u64;
            let slots = if self.pool_pages > 0 {
                self.pool_pages
            } else {
                self.pool_bytes / stride
            };
            if slots == 0 {
                return Err(ApiError::FailedPrecondition(format!(
                    "l2.pool_bytes ({}) is smaller than one page of this layout ({stride} bytes)",
                    self.pool_bytes
                )));
            }
            let slots = u32::try_from(slots).unwrap_or(u32::MAX);
            let shm = ShmPool::create(&PoolSpec {
                name: format!("kvtier-{}-{}", std::process::id(), fp.to_hex()),
                dir: self.shm_dir.clone(),
                backing: self.backing,
                slots,
                stride: layout.slot_stride(),
                mlock: self.mlock,
                huge_pages: self.huge_pages,
                reserve: self.reserve,
            })
            .map_err(|e| match e {
                kvtier_shm::ShmError::NoSpace { .. } => ApiError::ResourceExhausted(format!(
                    "no room for the pool of {fp} ({e}): lower l2.pool_bytes / l2.pool_pages \
                     or give l2.shm_dir ({}) more space",
                    self.shm_dir.display()
                )),
                e => ApiError::Internal(format!("creating the pool for {fp}: {e}")),
            })?;
            tracing::info!(
                fingerprint = %fp,
                model = %layout.spec().model_id,
                slots,
                stride,
                path = %shm.path().display(),
                "created pool class"
            );
            let mut index = HostIndex::new(slots, self.policy);
            if matches!(self.write, Some((WritePolicy::WriteBack, _))) {
                index.set_evict_needs_l3(true);
            }
            self.pools.insert(
                fp,
                Pool {
                    layout: layout.clone(),
                    shm: Arc::new(shm),
                    index,
                    prefetch_held: 0,
                },
            );
        }
        match self.pools.get_mut(&fp) {
            Some(p) => Ok(p),
            None => unreachable!("pool inserted above"),
        }
    }

    /// Registers a client whose layout and hash self-test were already checked.
    pub fn register(
        &mut self,
        name: String,
        layout: &Layout,
        now: Instant,
    ) -> Result<Registered, ApiError> {
        let pool = self.pool_for(layout)?;
        let reg = Registered {
            session_id: 0,
            pool_path: pool.shm.path().to_path_buf(),
            slots: pool.shm.slots(),
            stride: pool.shm.stride(),
        };
        let id = self.next_session;
        self.next_session += 1;
        self.sessions.insert(
            id,
            Session {
                name,
                fingerprint: layout.fingerprint(),
                last_seen: now,
                pins: HashMap::new(),
                writing: HashSet::new(),
                report: None,
            },
        );
        Ok(Registered {
            session_id: id,
            ..reg
        })
    }

    /// Marks a session alive; every request does this.
    pub fn touch(&mut self, id: u64, now: Instant) -> Result<(), ApiError> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| unknown_session(id))?;
        s.last_seen = now;
        Ok(())
    }

    /// The session and its pool, marked alive.
    fn session_pool(
        &mut self,
        id: u64,
        now: Instant,
    ) -> Result<(&mut Session, &mut Pool), ApiError> {
        let s = self
            .sessions
            .get_mut(&id)
            .ok_or_else(|| unknown_session(id))?;
        s.last_seen = now;
        let pool = self
            .pools
            .get_mut(&s.fingerprint)
            .ok_or_else(|| ApiError::Internal(format!("session {id} has no pool")))?;
        Ok((s, pool))
    }

    /// Ends a session: drops its pins and frees what it was writing.
    pub fn close(&mut self, id: u64) -> Result<(), ApiError> {
        if !self.sessions.contains_key(&id) {
            return Err(unknown_session(id));
        }
        let open: Vec<String> = self
            .prefetch_names
            .keys()
            .filter(|(sid, _)| *sid == id)
            .map(|(_, name)| name.clone())
            .collect();
        for name in open {
            self.prefetch_drop(id, &name, StopCause::SessionClosed);
        }
        let s = self
            .sessions
            .remove(&id)
            .ok_or_else(|| unknown_session(id))?;
        let Some(pool) = self.pools.get_mut(&s.fingerprint) else {
            return Ok(());
        };
        let pins: Vec<PageKey> = s
            .pins
            .iter()
            .flat_map(|(k, &n)| std::iter::repeat_n(*k, n as usize))
            .collect();
        let writing: Vec<PageKey> = s.writing.iter().copied().collect();
        self.counters.dropped_pins += pins.len() as u64;
        self.counters.dropped_reservations += writing.len() as u64;
        if let Err(e) = pool.index.release(&pins) {
            tracing::error!(session = id, "session pins disagree with the index: {e}");
        }
        if let Err(e) = pool.index.abort(id as OwnerId, &writing) {
            tracing::error!(
                session = id,
                "session reservations disagree with the index: {e}"
            );
        }
        Ok(())
    }

    /// Ends every session idle for longer than the TTL. Returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<u64> {
        let ttl = self.ttl;
        let dead: Vec<u64> = self
            .sessions
            .iter()
            .filter(|(_, s)| now.saturating_duration_since(s.last_seen) > ttl)
            .map(|(&id, _)| id)
            .collect();
        for &id in &dead {
            let name = self
                .sessions
                .get(&id)
                .map(|s| s.name.clone())
                .unwrap_or_default();
            tracing::warn!(session = id, client = %name, "session lease expired; dropping its pins and reservations");
            // The session exists: it was just listed.
            let _ = self.close(id);
            self.counters.expired_sessions += 1;
        }
        dead
    }

    /// Leading keys ready in the session's pool.
    pub fn lookup(&mut self, id: u64, keys: &[PageKey], now: Instant) -> Result<usize, ApiError> {
        let (_, pool) = self.session_pool(id, now)?;
        Ok(pool.index.lookup(keys))
    }

    /// Reserves slots for the keys not present.
    pub fn reserve(
        &mut self,
        id: u64,
        parent: Option<PageKey>,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(Vec<Reserve>, usize), ApiError> {
        let (session, pool) = self.session_pool(id, now)?;
        let (out, evicted) = pool.index.reserve(id as OwnerId, parent, keys);
        let mut dedup = 0;
        let mut reserved = 0;
        let mut no_space = 0;
        for (k, r) in keys.iter().zip(&out) {
            match r {
                Reserve::Reserved(_) => {
                    session.writing.insert(*k);
                    reserved += 1;
                }
                Reserve::Present => dedup += 1,
                Reserve::NoSpace => no_space += 1,
            }
        }
        let c = &mut self.counters;
        c.reserve_calls += 1;
        c.dedup_pages += dedup;
        c.reserved_pages += reserved;
        c.no_space_pages += no_space;
        Ok((out, evicted.len()))
    }

    /// Makes reserved pages visible. Returns the L3 writes write-through asks for.
    pub fn commit(
        &mut self,
        id: u64,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<Vec<Job>, ApiError> {
        let write = self.write;
        let (session, pool) = self.session_pool(id, now)?;
        pool.index.commit(id as OwnerId, keys)?;
        for k in keys {
            session.writing.remove(k);
        }
        let jobs = match write {
            Some((WritePolicy::WriteThrough, _)) => {
                let queued = pool.index.queue_for_l3(keys);
                Self::jobs(pool, queued)
            }
            _ => Vec::new(),
        };
        self.counters.commit_calls += 1;
        self.counters.committed_pages += keys.len() as u64;
        Ok(jobs)
    }

    /// Frees reserved pages.
    pub fn abort(&mut self, id: u64, keys: &[PageKey], now: Instant) -> Result<(), ApiError> {
        let (session, pool) = self.session_pool(id, now)?;
        pool.index.abort(id as OwnerId, keys)?;
        for k in keys {
            session.writing.remove(k);
        }
        Ok(())
    }

    /// Pins the longest ready prefix for the session; returns the slots, and the L3 writes
    /// write-through-selective asks for (pages whose hit count reached the threshold).
    pub fn acquire(
        &mut self,
        id: u64,
        keys: &[PageKey],
        now: Instant,
    ) -> Result<(Vec<u32>, Vec<Job>), ApiError> {
        let write = self.write;
        let (session, pool) = self.session_pool(id, now)?;
        let slots = pool.index.acquire(keys);
        let hit = &keys[..slots.len()];
        for k in hit {
            *session.pins.entry(*k).or_insert(0) += 1;
        }
        let jobs = match write {
            Some((WritePolicy::WriteThroughSelective, threshold)) => {
                let hot: Vec<PageKey> = hit
                    .iter()
                    .filter(|k| {
                        pool.index.l3_info(k).is_some_and(|(hits, l3)| {
                            hits >= threshold && l3 == kvtier_core::host_index::L3Mark::None
                        })
                    })
                    .copied()
                    .collect();
                let queued = pool.index.queue_for_l3(&hot);
                Self::jobs(pool, queued)
            }
            _ => Vec::new(),
        };
        self.counters.acquire_calls += 1;
        self.counters.acquired_pages += slots.len() as u64;
        Ok((slots, jobs))
    }

    /// Drops the session's pins on `keys`. All-or-nothing.
    pub fn release(&mut self, id: u64, keys: &[PageKey], now: Instant) -> Result<(), ApiError> {
        let (session, pool) = self.session_pool(id, now)?;
        let mut want: HashMap<PageKey, u32> = HashMap::new();
        for (i, k) in keys.iter().enumerate() {
            let n = want.entry(*k).or_insert(0);
            *n += 1;
            if session.pins.get(k).copied().unwrap_or(0) < *n {
                return Err(ApiError::invalid(
                    format!("keys[{i}]"),
                    format!("{} is not pinned by this session", k.to_hex()),
                ));
            }
        }
        pool.index.release(keys)?;
        for (k, n) in want {
            if let Some(p) = session.pins.get_mut(&k) {
                *p -= n;
                if *p == 0 {
                    session.pins.remove(&k);
                }
            }
        }
        Ok(())
    }

    /// Index counters of every pool, summed.
    pub fn totals(&self) -> HostIndexStats {
        let mut t = HostIndexStats::default();
        for p in self.pools.values() {
            let s = p.index.stats();
            t.capacity += s.capacity;
            t.ready += s.ready;
            t.writing += s.writing;
            t.pinned += s.pinned;
            t.pins += s.pins;
            t.evictions += s.evictions;
        }
        t
    }

    /// Bytes of shared memory mapped for pools, and bytes holding ready or writing pages.
    pub fn pool_bytes(&self) -> (u64, u64) {
        self.pools.values().fold((0, 0), |(total, used), p| {
            let s = p.index.stats();
            let stride = p.shm.stride() as u64;
            (
                total + p.shm.len() as u64,
                used + u64::from(s.ready + s.writing) * stride,
            )
        })
    }
}

/// Prefetches: the pool side. The fetching itself is in [`crate::prefetch`].
impl HostState {
    /// Checks that `session` may open prefetch `request_id`; returns its layout and how many
    /// leading `keys` are ready in L2.
    pub fn prefetch_check(
        &mut self,
        session: u64,
        request_id: &str,
        keys: &[PageKey],
        max_per_session: usize,
        now: Instant,
    ) -> Result<(Layout, usize), ApiError> {
        let (_, pool) = self.session_pool(session, now)?;
        let l2 = pool.index.lookup(keys);
        let layout = pool.layout.clone();
        if self
            .prefetch_names
            .contains_key(&(session, request_id.to_string()))
        {
            return Err(ApiError::invalid(
                "request_id",
                format!("{request_id:?} is already open in this session; take or release it first"),
            ));
        }
        let open = self
            .prefetch_names
            .keys()
            .filter(|(s, _)| *s == session)
            .count();
        if open >= max_per_session {
            return Err(ApiError::ResourceExhausted(format!(
                "the session has {open} open prefetches (prefetch.max_per_session); take or \
                 release some"
            )));
        }
        Ok((layout, l2))
    }

    /// Reserves slots for the hit pages after the L2 prefix, within the prefetch budget, or
    /// decides not to (nothing allocated then).
    pub fn prefetch_open(&mut self, o: PrefetchOpen) -> Result<Opened, ApiError> {
        let budget = self.prefetch_budget;
        let id = self.next_prefetch;
        if self
            .prefetch_names
            .contains_key(&(o.session, o.request_id.clone()))
        {
            return Err(ApiError::invalid(
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
        let (out, evicted) = pool.index.reserve(owner, parent, want);
        let run = out
            .iter()
            .take_while(|r| matches!(r, Reserve::Reserved(_)))
            .count();
        // Pages after a gap (being written by someone else, or no room) cannot be a prefix.
        let after: Vec<PageKey> = want
            .iter()
            .zip(&out)
            .skip(run)
            .filter(|(_, r)| matches!(r, Reserve::Reserved(_)))
            .map(|(k, _)| *k)
            .collect();
        if let Err(e) = pool.index.abort(owner, &after) {
            tracing::error!("prefetch reservations disagree with the index: {e}");
        }
        if run < min {
            if let Err(e) = pool.index.abort(owner, &want[..run]) {
                tracing::error!("prefetch reservations disagree with the index: {e}");
            }
            return Ok(Opened::Revoked(match out.get(run) {
                Some(Reserve::Present) => "busy",
                _ => "no_space",
            }));
        }
        let hit: Vec<(PageKey, u32)> = want
            .iter()
            .zip(&out)
            .take(run)
            .filter_map(|(k, r)| match r {
                Reserve::Reserved(s) => Some((*k, *s)),
                _ => None,
            })
            .collect();
        pool.prefetch_held += run as u32;
        let shm = pool.shm.clone();
        let page_bytes = pool.layout.page_bytes() as u64;
        let fp = pool.layout.fingerprint();
        self.counters.prefetch_evictions += evicted.len() as u64;
        self.next_prefetch += 1;
        let mut keys = o.keys;
        keys.truncate(l2 + run);
        let mut entry = PrefetchEntry {
            session: o.session,
            request_id: o.request_id.clone(),
            fp,
            policy: o.policy,
            keys,
            l2,
            hit: hit.clone(),
            landed: 0,
            page_bytes,
            started: o.started,
            deadline: o.deadline,
            state: PrefetchState::Running,
            reason: String::new(),
            cancel: o.cancel,
            stop: None,
            tx: watch::channel(v1::PrefetchProgress::default()).0,
        };
        let first = entry.progress();
        entry.tx = watch::channel(first.clone()).0;
        let rx = entry.tx.subscribe();
        self.prefetches.insert(id, entry);
        self.prefetch_names.insert((o.session, o.request_id), id);
        Ok(Opened::Open {
            id,
            hit,
            l2,
            shm,
            rx,
            first,
        })
    }

    /// A fetched page is in its slot: make it ready, pinned, and persisted. `false` when the
    /// prefetch is gone or the page is not its next one (the caller then stops).
    pub fn prefetch_land(&mut self, id: u64) -> bool {
        let Some(e) = self.prefetches.get_mut(&id) else {
            return false;
        };
        let Some(&(key, _)) = e.hit.get(e.landed) else {
            return false;
        };
        let Some(pool) = self.pools.get_mut(&e.fp) else {
            return false;
        };
        match pool
            .index
            .commit_pinned(PrefetchEntry::owner(id), &[key], true)
        {
            Ok(_) => {
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
        if let Some(e) = self.prefetches.get(&id) {
            e.publish();
        }
    }

    /// Ends a prefetch's fetching: frees the slots of pages that did not land and records how
    /// it ended. A prefetch dropped meanwhile (released, session closed) also gives up its
    /// landed pages and is forgotten.
    pub fn prefetch_finish(
        &mut self,
        id: u64,
        state: PrefetchState,
        reason: &str,
    ) -> Option<Finished> {
        let e = self.prefetches.get_mut(&id)?;
        let pool = self.pools.get_mut(&e.fp)?;
        let rest: Vec<PageKey> = e.hit[e.landed..].iter().map(|(k, _)| *k).collect();
        if let Err(err) = pool.index.abort(PrefetchEntry::owner(id), &rest) {
            tracing::error!(
                prefetch = id,
                "prefetch reservations disagree with the index: {err}"
            );
        }
        pool.prefetch_held -= rest.len() as u32;
        let all = e.landed == e.hit.len();
        let (state, reason) = match e.stop {
            Some(StopCause::Released) => (PrefetchState::Failed, "released".to_string()),
            Some(StopCause::SessionClosed) => (PrefetchState::Failed, "session_closed".to_string()),
            // Everything landed just as a take or the deadline came.
            _ if all => (PrefetchState::Completed, String::new()),
            Some(StopCause::Taken) if state == PrefetchState::Failed && reason == "cancelled" => {
                (PrefetchState::Partial, String::new())
            }
            _ => (state, reason.to_string()),
        };
        e.state = state;
        e.reason = reason.clone();
        e.hit.truncate(e.landed);
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
    fn prefetch_forget(&mut self, session: u64, request_id: &str) {
        let Some(id) = self
            .prefetch_names
            .remove(&(session, request_id.to_string()))
        else {
            return;
        };
        let Some(e) = self.prefetches.remove(&id) else {
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
    pub fn prefetch_drop(&mut self, session: u64, request_id: &str, cause: StopCause) -> bool {
        let Some(&id) = self.prefetch_names.get(&(session, request_id.to_string())) else {
            return false;
        };
        let Some(e) = self.prefetches.get_mut(&id) else {
            return false;
        };
        if e.state == PrefetchState::Running {
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
        session: u64,
        request_id: &str,
        take: bool,
        now: Instant,
    ) -> Result<(watch::Receiver<v1::PrefetchProgress>, StopPolicy), ApiError> {
        self.touch(session, now)?;
        let e = self
            .prefetch_names
            .get(&(session, request_id.to_string()))
            .and_then(|id| self.prefetches.get_mut(id))
            .ok_or_else(|| unknown_prefetch(request_id))?;
        if take && e.policy == StopPolicy::BestEffort && e.state == PrefetchState::Running {
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
        session: u64,
        request_id: &str,
        now: Instant,
    ) -> Result<(v1::PrefetchProgress, Vec<u32>), ApiError> {
        let name = (session, request_id.to_string());
        let id = *self
            .prefetch_names
            .get(&name)
            .ok_or_else(|| unknown_prefetch(request_id))?;
        let e = self
            .prefetches
            .get(&id)
            .ok_or_else(|| unknown_prefetch(request_id))?;
        if e.state == PrefetchState::Running {
            return Err(ApiError::FailedPrecondition(format!(
                "prefetch {request_id:?} is still running"
            )));
        }
        let progress = e.progress();
        let (l2_keys, landed): (Vec<PageKey>, Vec<(PageKey, u32)>) =
            (e.keys[..e.l2].to_vec(), e.hit[..e.landed].to_vec());
        let (sess, pool) = self.session_pool(session, now)?;
        let mut slots = pool.index.acquire(&l2_keys);
        for k in &l2_keys[..slots.len()] {
            *sess.pins.entry(*k).or_insert(0) += 1;
        }
        let usable = slots.len() == l2_keys.len();
        if usable {
            for (k, s) in &landed {
                *sess.pins.entry(*k).or_insert(0) += 1;
                slots.push(*s);
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
        self.prefetch_names.remove(&name);
        self.prefetches.remove(&id);
        self.counters.acquired_pages += slots.len() as u64;
        Ok((progress, slots))
    }

    /// The progress of an open prefetch.
    pub fn prefetch_status(
        &mut self,
        session: u64,
        request_id: &str,
        now: Instant,
    ) -> Result<v1::PrefetchProgress, ApiError> {
        self.touch(session, now)?;
        self.prefetch_names
            .get(&(session, request_id.to_string()))
            .and_then(|id| self.prefetches.get(id))
            .map(PrefetchEntry::progress)
            .ok_or_else(|| unknown_prefetch(request_id))
    }

    /// Prefetches running, slots they hold, and the budget over every pool.
    pub fn prefetch_totals(&self) -> (usize, u64, u64) {
        let running = self
            .prefetches
            .values()
            .filter(|e| e.state == PrefetchState::Running)
            .count();
        let held = self
            .pools
            .values()
            .map(|p| u64::from(p.prefetch_held))
            .sum();
        let limit = self
            .pools
            .values()
            .map(|p| (f64::from(p.index.stats().capacity) * self.prefetch_budget) as u64)
            .sum();
        (running, held, limit)
    }
}

fn unknown_prefetch(request_id: &str) -> ApiError {
    ApiError::NotFound(format!(
        "no open prefetch {request_id:?} in this session (revoked, taken, released, or never \
         started)"
    ))
}
