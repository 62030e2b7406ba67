//! The daemon's L2 state: one pool per layout class (shared memory + index) and the client
//! sessions that own pins and reservations. Synchronous; the service holds it behind a mutex
//! for the few microseconds each batch takes, and never across an await.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::{DaemonConfig, L2Backing};
use kvtier_config::tenants::TenantQuota;
use kvtier_core::host_index::{HostIndex, HostIndexStats, OwnerId, TenantUse};
use kvtier_core::{Layout, LayoutFingerprint, PolicyKind, SessionId, TenantScope, TenantTag};
use kvtier_shm::{Backing, PoolSpec, ShmPool};

use crate::events::EventBus;
pub use events::Subscription;
use l3_view::L3View;
use operator::OperatorFlags;
use sessions::Sessions;
use tenants::TenantTable;

mod error;
mod events;
mod l3_view;
mod l3_writes;
mod metrics;
mod operator;
mod pages;
mod prefetch;
mod reclaim;
mod sessions;
mod survive;
mod tenants;

pub use error::StateError;
pub use l3_writes::Job;
pub use metrics::L2Metrics;
pub use operator::{ClearedL2, DrainReport, FlushWait};
pub use prefetch::{
    Finished, Opened, Phase, PrefetchEntry, PrefetchOpen, Prefetches, Progress, StopCause,
};
pub use survive::{SealJob, Seals, TakeoverCounts, take_over_dead_pools};

/// kvtierd's own directory of pool files and slot tables: `kvtierd-<euid>` in `l2.shm_dir`
/// (a tmpfs), mode 0700, so no other uid can plant, open or list a file in it. Clients get
/// the pools as descriptors (the pool door), never by name.
pub fn pool_dir(cfg: &DaemonConfig) -> PathBuf {
    let uid = rustix::process::geteuid().as_raw();
    cfg.l2.shm_dir.join(format!("kvtierd-{uid}"))
}

/// Opens (creating it if need be) [`pool_dir`] as kvtierd's own directory.
pub fn open_pool_dir(cfg: &DaemonConfig) -> Result<kvtier_shm::OwnDir, StateError> {
    let path = pool_dir(cfg);
    let (dir, narrowed) = kvtier_shm::OwnDir::open_or_create(&path)
        .map_err(|e| StateError::Refused(e.to_string()))?;
    if narrowed {
        tracing::warn!(path = %path.display(), "kvtierd's pool directory was open to others; narrowed to 0700");
    }
    Ok(dir)
}

/// One pool class: the shared memory of one layout and its index.
#[derive(Debug)]
pub struct L2Pool {
    /// Its key among the pools: its layout's fingerprint, or (a tenant's own pool,
    /// `l2.tenant_pools`) one derived from it and the tenant ([`pool_key`]).
    pub key: LayoutFingerprint,
    /// The layout every page in this pool has.
    pub layout: Layout,
    /// The shared memory (shared with the L3 writer, which copies pinned slots out).
    pub shm: Arc<ShmPool>,
    /// Which key is in which slot.
    pub index: HostIndex,
    /// Slots held by prefetches: reserved for pages on their way, or landed and not taken.
    pub prefetch_held: u32,
    /// The slot table that lets a later kvtierd take this pool over after a crash.
    pub seals: Option<Seals>,
    /// When a session last used it (created, registered to, called on).
    pub last_used: Instant,
}

/// A registered client.
#[derive(Debug)]
pub struct Session {
    /// Client-chosen name.
    pub name: String,
    /// Its layout's fingerprint (what L3 names its pages by).
    pub fingerprint: LayoutFingerprint,
    /// The pool it uses ([`L2Pool::key`]).
    pub pool: LayoutFingerprint,
    /// Last request or heartbeat.
    pub last_seen: Instant,
    /// Pins it holds, by slot (a pinned page keeps its slot until its last pin goes), with
    /// multiplicity: slot numbers hash and compare cheaper than page keys, and a release
    /// finds its keys' slots in the index anyway.
    pub pins: SlotPins,
    /// Pages it has reserved and not yet committed or aborted: a count, since the index
    /// knows which (its reservations are owned by [`Session::owner`], and every commit or
    /// abort is checked against it there, a key named twice refused).
    pub writing: usize,
    /// The client's last report (agents send one with each heartbeat).
    pub report: Option<ClientReport>,
    /// The tenant it was bound to at registration (`""`: the default tenant).
    pub tenant: String,
    /// Its tenant's key mapping (used while tenancy is on).
    scope: TenantScope,
    /// Who owns its reservations in the index.
    owner: OwnerId,
}

/// A session's pins: slot → how many.
pub type SlotPins = HashMap<u32, u32, kvtier_core::key_map::BuildKeyHasher>;

/// The host state as every service and task shares it: the one mutex over [`HostState`]. A
/// `parking_lot` mutex, which does not poison: a panic while holding it is a bug, but every
/// state update is all-or-nothing per call, so serving on beats refusing every later request.
#[derive(Debug)]
pub struct Shared(parking_lot::Mutex<HostState>);

impl Shared {
    /// Shares `state`.
    pub fn new(state: HostState) -> Self {
        Self(parking_lot::Mutex::new(state))
    }

    /// The state, locked. What the holder changed in L2 is published as events when the
    /// guard goes, before the lock is let go (`HostState::publish_changes`).
    pub fn lock(&self) -> StateGuard<'_> {
        StateGuard(self.0.lock())
    }
}

/// The locked state ([`Shared::lock`]); publishes the holder's changes to L2 when dropped.
pub struct StateGuard<'a>(parking_lot::MutexGuard<'a, HostState>);

impl std::ops::Deref for StateGuard<'_> {
    type Target = HostState;
    fn deref(&self) -> &HostState {
        &self.0
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut HostState {
        &mut self.0
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        self.0.publish_changes();
    }
}

/// This node's name in events: its hostname.
fn node_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default()
}

/// What an agent tells the daemon about its worker with each heartbeat: counters since
/// it started, and gauges at the time of the heartbeat. Kept as sent and shown in Stats.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ClientReport {
    /// Match calls.
    pub matches: u64,
    /// Pages matched on the device.
    pub device_hit_pages: u64,
    /// Pages matched in L2.
    pub l2_hit_pages: u64,
    /// Pages matched in L3.
    pub l3_hit_pages: u64,
    /// Pages matched nowhere.
    pub miss_pages: u64,
    /// Pages loaded back onto the device.
    pub load_back_pages: u64,
    /// Pages backed up to L2.
    pub backup_pages: u64,
    /// Pages evicted from the device without a copy in L2.
    pub lost_pages: u64,
    /// Pages evicted from the device.
    pub evicted_pages: u64,
    /// Pages on the device now.
    pub device_pages: u32,
    /// Pages locked on the device now.
    pub locked_pages: u32,
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
    /// Pages evicted from L2 that L3 did not hold, because there is no L3.
    pub lost_no_l3: u64,
    /// Pages evicted from L2 that L3 did not hold, because L3 was down (breaker open).
    pub lost_l3_down: u64,
    /// Pages an operator cleared from L2 (`kvtierctl clear l2`).
    pub cleared_pages: u64,
    /// Of those, pages L3 did not hold.
    pub lost_cleared: u64,
    /// Pages L3 did not hold that went with a pool a client shrank or grew.
    pub lost_pool_damaged: u64,
    /// Pools retired because a client shrank or grew their file.
    pub pools_damaged: u64,
    /// Committed pages whose slot records were sealed (they would survive a crash).
    pub sealed_pages: u64,
    /// Of those, pages sealed with the CRC32C of the verified L3 read that wrote them (no
    /// second pass over their bytes).
    pub sealed_from_reads: u64,
    /// Pools removed because no session used them (idle, or their place was needed).
    pub pools_reclaimed: u64,
    /// What the start-up takeover of dead kvtierd pools did.
    pub takeover: TakeoverCounts,
}

/// What a client gets back from [`HostState::register`].
#[derive(Debug, Clone)]
pub struct Registered {
    /// The new session.
    pub session_id: SessionId,
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
    pools: HashMap<LayoutFingerprint, L2Pool>,
    /// What L2 holds, published for routers (`events.rs`).
    events: EventBus,
    /// The live sessions (`state/sessions.rs`).
    sessions: Sessions,
    policy: PolicyKind,
    /// Where pools live: a memfd each, or files in kvtierd's own directory ([`pool_dir`]).
    backing: Backing,
    pool_bytes: u64,
    pool_pages: u64,
    max_pools: u32,
    /// Most own pools of one named tenant (0: an even share of `max_pools`).
    max_pools_per_tenant: u32,
    /// How long an unused pool lives (zero: until its place is needed).
    idle_pool_ttl: Duration,
    /// Largest slot a layout may have.
    max_page_bytes: u64,
    mlock: bool,
    huge_pages: bool,
    reserve: bool,
    dirty_fraction: f64,
    /// Share of a pool's dirty limit one session (and one tenant) may hold reserved.
    reserve_share: f64,
    /// Keep slot tables, so the pools survive a crash.
    take_over: bool,
    /// Which kvtierd this is, across restarts (from its socket path): pool files carry it,
    /// so a restarted daemon takes over its own predecessor's pools and no one else's.
    instance: String,
    /// What L2 knows of L3 (`state/l3_view.rs`).
    l3: L3View,
    /// A drain or flushes the operator started (`state/operator.rs`).
    operator: OperatorFlags,
    /// Open prefetches (their slots are in the pools).
    prefetches: Prefetches,
    /// The tenants tracked in every pool (`state/tenants.rs`; empty: tenancy is off).
    tenants: TenantTable,
    /// Counters since start.
    pub counters: Counters,
}

impl HostState {
    /// Empty state configured by `cfg` (already validated). Refused when kvtierd's own pool
    /// directory ([`pool_dir`]) cannot be made or is not kvtierd's alone.
    pub fn new(cfg: &DaemonConfig) -> Result<Self, StateError> {
        let backing = match cfg.l2.backing {
            L2Backing::Memfd => Backing::Memfd,
            L2Backing::ShmFile => Backing::ShmFile(open_pool_dir(cfg)?),
        };
        let mut events = EventBus::new(node_name());
        // A new run holds nothing of what an earlier one published: its first event says so
        // (pages it takes over from a crashed run are published as stored after it).
        events.cleared(None, None);
        Ok(Self {
            pools: HashMap::new(),
            events,
            sessions: Sessions::new(crate::ids::epoch_now(), cfg.sessions.ttl.0),
            policy: cfg.l2.eviction_policy,
            backing,
            pool_bytes: cfg.l2.pool_bytes.0,
            pool_pages: cfg.l2.pool_pages,
            max_pools: cfg.l2.max_pools,
            max_pools_per_tenant: cfg.l2.max_pools_per_tenant,
            idle_pool_ttl: cfg.l2.idle_pool_ttl.0,
            max_page_bytes: cfg.l2.max_page_bytes.0,
            mlock: cfg.l2.mlock,
            huge_pages: cfg.l2.huge_pages,
            reserve: cfg.l2.reserve,
            dirty_fraction: cfg.l2.dirty_fraction,
            reserve_share: cfg.l2.reserve_share,
            take_over: cfg.l2.take_over_after_crash,
            instance: survive::instance_id(&cfg.socket_path()),
            l3: {
                let mut l3 = L3View::default();
                l3.attach(cfg.l3.backend.stores().then(|| cfg.l3.write_policy()));
                l3
            },
            operator: OperatorFlags::default(),
            prefetches: Prefetches::new(cfg.prefetch.budget_fraction),
            tenants: TenantTable::new(cfg.l2.tenant_pools),
            counters: Counters::default(),
        })
    }

    /// Tracks `tenants` (`[tenants]`, resolved) in every pool, now and to come: their pages
    /// are counted and held to their L2 quotas.
    pub fn set_tenants(&mut self, tenants: &[TenantQuota]) {
        self.tenants.set(tenants);
        for p in self.pools.values_mut() {
            for t in self.tenants.iter() {
                p.index.set_tenant_quota(t.tag, t.quota);
            }
        }
    }

    /// Tag and name of every tracked tenant (the default tenant is `""`).
    pub fn tenant_names(&self) -> Vec<(TenantTag, String)> {
        self.tenants
            .iter()
            .map(|t| (t.tag, t.name.clone()))
            .collect()
    }

    /// Per tracked tenant, in `[tenants]` order (the default tenant first): its name and
    /// its L2 use summed over the pools (the quota is per pool).
    pub fn tenant_usage(&self) -> Vec<(String, TenantTag, TenantUse)> {
        self.tenants
            .iter()
            .map(|t| {
                let mut sum = TenantUse {
                    quota: t.quota,
                    ..TenantUse::default()
                };
                for u in self
                    .pools
                    .values()
                    .filter_map(|p| p.index.tenant_usage(t.tag))
                {
                    sum.pages += u.pages;
                    sum.quota_evictions += u.quota_evictions;
                    sum.quota_refusals += u.quota_refusals;
                }
                (t.name.clone(), t.tag, sum)
            })
            .collect()
    }

    /// The layout class of a session.
    pub fn session_fingerprint(&self, id: SessionId) -> Result<LayoutFingerprint, StateError> {
        self.sessions.get(id).map(|s| s.fingerprint)
    }

    /// Marks a session alive and keeps the report its heartbeat carried.
    pub fn heartbeat(
        &mut self,
        id: SessionId,
        report: Option<ClientReport>,
        now: Instant,
    ) -> Result<(), StateError> {
        let s = self.sessions.get_mut(id)?;
        s.last_seen = now;
        if report.is_some() {
            s.report = report;
        }
        Ok(())
    }

    /// Session lease.
    pub fn ttl(&self) -> Duration {
        self.sessions.ttl()
    }

    /// Pools by layout.
    pub fn pools(&self) -> impl Iterator<Item = &L2Pool> {
        self.pools.values()
    }

    /// The pool `id` maps and the tenant it was bound to: what the pool door hands over,
    /// and to whom.
    pub fn mapped_pool(&self, id: SessionId) -> Result<(Arc<ShmPool>, &str), StateError> {
        let s = self.sessions.get(id)?;
        let p = self
            .pools
            .get(&s.pool)
            .ok_or_else(|| StateError::Internal(format!("session {id}'s pool is gone")))?;
        Ok((p.shm.clone(), &s.tenant))
    }

    /// Live sessions.
    pub fn sessions(&self) -> impl Iterator<Item = (&SessionId, &Session)> {
        self.sessions.iter()
    }

    /// The most own pools a named tenant may have ([`Self::max_pools_per_tenant`], or an
    /// even share of `l2.max_pools` with the shared pools).
    fn tenant_pool_share(&self) -> usize {
        match self.max_pools_per_tenant {
            0 => (self.max_pools as usize / (self.tenants.named() + 1)).max(1),
            n => n as usize,
        }
    }

    /// Before a new own pool of `tenant`'s: at its share, its least recently used idle pool
    /// gives its place, or the registration is refused (the other tenants' places stay
    /// theirs).
    fn make_room_for_tenant(&mut self, tenant: &str) -> Result<(), StateError> {
        let share = self.tenant_pool_share();
        let owns = |st: &Self| {
            st.pools
                .values()
                .filter(|p| p.key == pool_key(&p.layout.fingerprint(), tenant))
                .count()
        };
        if owns(self) >= share {
            self.reclaim_pools_where(Instant::now(), true, |p| {
                p.key == pool_key(&p.layout.fingerprint(), tenant)
            });
        }
        if owns(self) >= share {
            return Err(StateError::Full(format!(
                "tenant {tenant:?} has {share} layouts' pools already, its share of \
                 l2.max_pools (l2.max_pools_per_tenant), and none is idle"
            )));
        }
        Ok(())
    }

    /// The tag of the one tenant whose pages `pool` can hold: a named tenant's own pool's
    /// (`l2.tenant_pools`), or, while named tenants have their own pools, the layout's pool,
    /// which then holds the default tenant's alone. `None` when every tenant's pages share
    /// the pool (no tenants named, or `l2.tenant_pools = false`).
    pub(crate) fn own_pool_tenant(&self, pool: &L2Pool) -> Option<TenantTag> {
        self.tenants
            .only_tenant_of(&pool.key, &pool.layout.fingerprint())
    }

    fn pool_for(&mut self, layout: &Layout, tenant: &str) -> Result<&mut L2Pool, StateError> {
        // A named tenant's own pool (its sessions alone get its descriptor); else the
        // layout's, which every tenant's sessions share.
        let (fp, own) = self.tenants.pool_of(&layout.fingerprint(), tenant);
        if !self.pools.contains_key(&fp) {
            if own {
                self.make_room_for_tenant(tenant)?;
            }
            if layout.slot_stride() as u64 > self.max_page_bytes {
                return Err(StateError::invalid(
                    "layout",
                    format!(
                        "a page of {} bytes is larger than l2.max_page_bytes ({})",
                        layout.slot_stride(),
                        self.max_page_bytes
                    ),
                ));
            }
            if self.pools.len() >= self.max_pools as usize {
                // The least recently used pool nobody uses gives its place.
                self.reclaim_pools(Instant::now(), true);
            }
            if self.pools.len() >= self.max_pools as usize {
                return Err(StateError::Full(format!(
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
                return Err(StateError::Refused(format!(
                    "l2.pool_bytes ({}) is smaller than one page of this layout ({stride} bytes)",
                    self.pool_bytes
                )));
            }
            let slots = u32::try_from(slots).unwrap_or(u32::MAX);
            // The run's epoch in the name: a restarted kvtierd that got the same pid (pid 1
            // in a container) never makes a pool under its dead predecessor's name.
            let name = format!(
                "kvtier-{}-{}-{}-{}",
                self.instance,
                std::process::id(),
                self.sessions.epoch(),
                fp.to_hex()
            );
            let (shm, replaced) = ShmPool::create(&PoolSpec {
                name: name.clone(),
                backing: self.backing.clone(),
                slots,
                stride: layout.slot_stride(),
                mlock: self.mlock,
                huge_pages: self.huge_pages,
                reserve: self.reserve,
            })
            .map_err(|e| match e {
                kvtier_shm::ShmError::NoSpace { .. } => StateError::Full(format!(
                    "no room for the pool of {fp} ({e}): lower l2.pool_bytes / l2.pool_pages \
                     or give l2.shm_dir more space"
                )),
                e => StateError::Internal(format!("creating the pool for {fp}: {e}")),
            })?;
            if replaced {
                self.counters.takeover.pools_removed += 1;
                tracing::warn!(%name, "removed a stale file at a new pool's name (a dead kvtierd's)");
            }
            tracing::info!(
                fingerprint = %fp,
                model = %layout.spec().model_id,
                slots,
                stride,
                path = %shm.path().display(),
                "created pool class"
            );
            // A tenant's pool is not taken over after a crash: its table would name the layout,
            // not the tenant (its pages come back from L3).
            let seals = match &self.backing {
                Backing::ShmFile(dir) if self.seals_enabled() && !own => {
                    match Seals::create(dir, &name, layout, slots) {
                        Ok(s) => Some(s),
                        Err(e) => {
                            tracing::warn!(fingerprint = %fp, "no slot table, so this pool will not survive a crash: {e}");
                            None
                        }
                    }
                }
                _ => None,
            };
            let mut index = HostIndex::new(slots, self.policy);
            index.record_changes(true);
            for t in self.tenants.iter() {
                index.set_tenant_quota(t.tag, t.quota);
            }
            index.set_l3_mode(self.l3_mode());
            index.set_dirty_limit(((f64::from(slots) * self.dirty_fraction) as u32).max(1));
            self.pools.insert(
                fp,
                L2Pool {
                    key: fp,
                    layout: layout.clone(),
                    shm: Arc::new(shm),
                    index,
                    prefetch_held: 0,
                    seals,
                    last_used: Instant::now(),
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
        tenant: &str,
        layout: &Layout,
        now: Instant,
    ) -> Result<Registered, StateError> {
        self.admitting("new sessions")?;
        let id = self.sessions.new_id()?;
        let pool = self.pool_for(layout, tenant)?;
        let pool_key = pool.key;
        let reg = Registered {
            session_id: id,
            pool_path: pool.shm.path().to_path_buf(),
            slots: pool.shm.slots(),
            stride: pool.shm.stride(),
        };
        let owner = self.sessions.next_owner();
        self.sessions.insert(
            id,
            Session {
                name,
                fingerprint: layout.fingerprint(),
                pool: pool_key,
                last_seen: now,
                pins: SlotPins::default(),
                writing: 0,
                report: None,
                tenant: tenant.to_string(),
                scope: TenantScope::new(tenant),
                owner,
            },
        );
        Ok(reg)
    }

    /// The key mapping of a session's tenant.
    pub fn session_scope(&self, id: SessionId) -> Result<TenantScope, StateError> {
        self.sessions.get(id).map(|s| s.scope.clone())
    }

    /// Marks a session alive; every request does this.
    pub fn touch(&mut self, id: SessionId, now: Instant) -> Result<(), StateError> {
        self.sessions.get_mut(id)?.last_seen = now;
        Ok(())
    }

    /// The session and its pool, marked alive.
    fn session_pool(
        &mut self,
        id: SessionId,
        now: Instant,
    ) -> Result<(&mut Session, &mut L2Pool), StateError> {
        let s = self.sessions.get_mut(id)?;
        s.last_seen = now;
        let pool = self
            .pools
            .get_mut(&s.pool)
            .ok_or_else(|| StateError::Internal(format!("session {id} has no pool")))?;
        pool.last_used = now;
        Ok((s, pool))
    }

    /// Ends a session: drops its pins and frees what it was writing.
    pub fn close(&mut self, id: SessionId) -> Result<(), StateError> {
        if !self.sessions.contains(id) {
            return Err(self.sessions.unknown(id));
        }
        for name in self.prefetches.of_session(id) {
            self.prefetch_drop(id, &name, StopCause::SessionClosed);
        }
        let s = self.sessions.remove(id)?;
        let Some(pool) = self.pools.get_mut(&s.pool) else {
            return Ok(());
        };
        let pins: Vec<u32> = s
            .pins
            .iter()
            .flat_map(|(&slot, &n)| std::iter::repeat_n(slot, n as usize))
            .collect();
        self.counters.dropped_pins += pins.len() as u64;
        if let Err(i) = pool.index.release_slots(&pins) {
            tracing::error!(session = %id, slot = pins[i], "session pins disagree with the index");
        }
        // The index scans its slots for them: only when there are some.
        if s.writing > 0 {
            let freed = pool.index.abort_owner(s.owner);
            self.counters.dropped_reservations += freed as u64;
            if freed != s.writing {
                tracing::error!(
                    session = %id,
                    "session reservations disagree with the index: {} counted, {freed} found",
                    s.writing
                );
            }
        }
        pool.index.end_leases(s.owner);
        Ok(())
    }

    /// Ends every session idle for longer than the TTL. Returns their ids.
    pub fn expire(&mut self, now: Instant) -> Vec<SessionId> {
        let dead = self.sessions.expired(now);
        for &id in &dead {
            let name = self
                .sessions
                .get(id)
                .map(|s| s.name.clone())
                .unwrap_or_default();
            tracing::warn!(session = %id, client = %name, "session lease expired; dropping its pins and reservations");
            // The session exists: it was just listed.
            let _ = self.close(id);
            self.counters.expired_sessions += 1;
        }
        self.retire_damaged_pools();
        self.reclaim_pools(now, false);
        dead
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
            t.unwritten_evictions += s.unwritten_evictions;
            t.dirty += s.dirty;
            t.leased += s.leased;
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

/// The key of tenant `tenant`'s own pool of the layout with fingerprint `fp`: 16 bytes of
/// SHA-256 over both, so it names the pool file and never equals a layout's fingerprint.
pub fn pool_key(fp: &LayoutFingerprint, tenant: &str) -> LayoutFingerprint {
    use sha2::Digest as _;
    let mut h = sha2::Sha256::new();
    h.update(b"kvtier/tenant-pool/v1");
    h.update(fp.0);
    h.update(tenant.as_bytes());
    let mut k = [0u8; 16];
    k.copy_from_slice(&h.finalize()[..16]);
    LayoutFingerprint(k)
}

/// What the state's unit tests share.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod testing {
    use std::time::Instant;

    use kvtier_config::daemon::{DaemonConfig, L2Backing};
    use kvtier_config::l3::L3Backend;
    use kvtier_core::{Layout, PageKey, SessionId, WritePolicy};

    use super::HostState;

    /// A state with a 16-page memfd pool, write-through to an in-memory L3, and one session.
    pub(crate) fn state() -> (HostState, SessionId) {
        let mut cfg = DaemonConfig::default();
        cfg.l2.backing = L2Backing::Memfd;
        cfg.l2.pool_pages = 16;
        cfg.l2.take_over_after_crash = false;
        cfg.l3.backend = L3Backend::Memory;
        let mut st = HostState::new(&cfg).unwrap();
        st.set_write(Some(WritePolicy::WriteThrough));
        let id = st
            .register("t".into(), "", &tiny_layout(), Instant::now())
            .unwrap()
            .session_id;
        (st, id)
    }

    /// `n` distinct keys.
    pub(crate) fn keys(n: u8) -> Vec<PageKey> {
        (1..=n).map(|i| PageKey([i; 32])).collect()
    }

    /// The smallest layout the state's unit tests use: one layer, one head of 8, 4 tokens a page.
    pub(crate) fn tiny_layout() -> Layout {
        use kvtier_core::{DType, KvKind, LayoutSpec};
        Layout::new(LayoutSpec {
            model_id: "m".into(),
            model_version: String::new(),
            dtype: DType::Bf16,
            num_layers: 1,
            kind: KvKind::Mha {
                kv_heads: 1,
                head_dim: 8,
            },
            page_size: 4,
            tp_rank: 0,
            tp_size: 1,
        })
        .unwrap()
    }
}
