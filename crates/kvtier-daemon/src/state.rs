//! The daemon's L2 state: one pool per layout class (shared memory + index) and the client
//! sessions that own pins and reservations. Synchronous; the service holds it behind a mutex
//! for the few microseconds each batch takes, and never across an await.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::{DaemonConfig, WritePolicy};
use kvtier_core::host_index::{HostIndex, HostIndexStats, OwnerId, Reserve};
use kvtier_core::{Layout, LayoutFingerprint, PageKey, PolicyKind};
use kvtier_proto::ApiError;
use kvtier_shm::{Backing, PoolSpec, ShmPool};

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
    /// The L3 write policy and threshold, when there is an L3.
    write: Option<(WritePolicy, u64)>,
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
            write: (cfg.l3.backend != "none").then(|| (cfg.l3.policy(), cfg.l3.write_threshold)),
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
            })
            .map_err(|e| ApiError::Internal(format!("creating the pool for {fp}: {e}")))?;
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
