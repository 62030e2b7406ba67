//! The daemon's L2 state: the pools (`state/pools.rs`: one per layout class, shared memory
//! and index) and the client sessions that own pins and reservations in them. Synchronous; the service holds it behind a mutex
//! for the few microseconds each batch takes, and never across an await.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::DaemonConfig;
use kvtier_config::tenants::TenantQuota;
use kvtier_core::host_index::{HostIndexStats, OwnerId, TenantUse};
use kvtier_core::{Layout, LayoutFingerprint, SessionId, TenantScope, TenantTag};
use kvtier_shm::ShmPool;

use crate::events::EventBus;
pub use events::Subscription;
use l3_view::L3View;
use operator::OperatorFlags;
use pools::{NewPool, Pools};
use sessions::Sessions;
pub(crate) use tenants::Sees;
use tenants::TenantTable;

mod error;
mod events;
mod l3_view;
mod l3_writes;
mod metrics;
mod operator;
mod own_pages;
mod pages;
mod pools;
mod prefetch;
mod reclaim;
mod sessions;
mod survive;
mod tenants;

pub use error::StateError;
pub use l3_writes::Job;
pub use metrics::L2Metrics;
pub use operator::{ClearedL2, DrainReport, FlushWait};
pub use own_pages::{OwnSlot, OwnUsage};
pub use pools::{L2Pool, open_pool_dir, pool_dir, pool_key};
pub use prefetch::{
    Finished, Opened, Phase, PrefetchEntry, PrefetchOpen, Prefetches, Progress, StopCause,
};
pub use survive::{SealJob, Seals, TakeoverCounts, take_over_dead_pools};

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
    /// kvtierd's own session (the SGLang object store's, [`HostState::register_own`]): it
    /// never expires.
    pub own: bool,
}

/// A session's pins: slot → how many.
pub type SlotPins = HashMap<u32, u32, kvtier_core::key_map::BuildKeyHasher>;

/// Model ids of kvtierd's own layouts (the SGLang object store's pages): no client may
/// register one, and a dead kvtierd's pool of one is taken over as kvtierd's own.
pub const OWN_LAYOUT_PREFIX: &str = "kvtierd/";

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
    /// Pages the admission filter let go to L3 (stored, or declined and seen again).
    pub admitted_pages: u64,
    /// Pages the admission filter declined when they were stored.
    pub declined_pages: u64,
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
    /// The pools (`state/pools.rs`).
    pools: Pools,
    /// What L2 holds, published for routers (`events.rs`).
    events: EventBus,
    /// The live sessions (`state/sessions.rs`).
    sessions: Sessions,
    /// Share of a pool's dirty limit one session (and one tenant) may hold reserved.
    reserve_share: f64,
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
        let mut events = EventBus::new(node_name());
        // A new run holds nothing of what an earlier one published: its first event says so
        // (pages it takes over from a crashed run are published as stored after it).
        events.cleared(None, None);
        Ok(Self {
            pools: Pools::new(cfg)?,
            events,
            sessions: Sessions::new(crate::ids::epoch_now(), cfg.sessions.ttl.0),
            reserve_share: cfg.l2.reserve_share,
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

    /// Before a new own pool of `tenant`'s: at its share, its least recently used idle pool
    /// gives its place, or the registration is refused (the other tenants' places stay
    /// theirs).
    fn make_room_for_tenant(&mut self, tenant: &str) -> Result<(), StateError> {
        let share = self.pools.tenant_share(self.tenants.named());
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

    /// What a caller limited to `tenant` (`None`: the operator) may see of `pool`: the tenant
    /// table's answer, as the events snapshot and Stats take it.
    pub(crate) fn sees(&self, tenant: Option<&str>, pool: &L2Pool) -> Sees {
        self.tenants.sees(
            tenant.map(|t| TenantScope::new(t).tag()),
            &pool.key,
            &pool.layout.fingerprint(),
        )
    }

    /// The tag of the one tenant whose pages `pool` can hold: a named tenant's own pool's
    /// (`l2.tenant_pools`), or, while named tenants have their own pools, the layout's pool,
    /// which then holds the default tenant's alone. `None` when every tenant's pages share
    /// the pool (no tenants named, or `l2.tenant_pools = false`).
    pub(crate) fn own_pool_tenant(&self, pool: &L2Pool) -> Option<TenantTag> {
        self.tenants
            .only_tenant_of(&pool.key, &pool.layout.fingerprint())
    }

    /// The pool `tenant`'s sessions of `layout` use, made if need be: with `own_slots`
    /// (`Some`), one of kvtierd's own, of that size, its L3 its owner's business
    /// ([`L2Pool::writes_own_l3`]).
    fn pool_for(
        &mut self,
        layout: &Layout,
        tenant: &str,
        own_slots: Option<u32>,
    ) -> Result<&mut L2Pool, StateError> {
        // A named tenant's own pool (its sessions alone get its descriptor); else the
        // layout's, which every tenant's sessions share.
        let (fp, own) = self.tenants.pool_of(&layout.fingerprint(), tenant);
        if !self.pools.contains(&fp) {
            if own {
                self.make_room_for_tenant(tenant)?;
            }
            self.pools.check_page_fits(layout)?;
            if self.pools.at_limit() {
                // The least recently used pool nobody uses gives its place.
                self.reclaim_pools(Instant::now(), true);
            }
            if self.pools.at_limit() {
                return Err(self.pools.full(layout));
            }
            let quotas = self.tenants.iter().map(|t| (t.tag, t.quota)).collect();
            let l3_mode = self.l3_mode();
            let (_, replaced) = self.pools.create(NewPool {
                key: fp,
                layout,
                own,
                epoch: self.sessions.epoch(),
                quotas,
                l3_mode,
                own_slots,
            })?;
            if replaced {
                self.counters.takeover.pools_removed += 1;
            }
        }
        match self.pools.get_mut(&fp) {
            Some(p) => Ok(p),
            None => unreachable!("pool made above"),
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
        if layout.spec().model_id.starts_with(OWN_LAYOUT_PREFIX) {
            return Err(StateError::invalid(
                "layout.model_id",
                format!("names beginning {OWN_LAYOUT_PREFIX:?} are kvtierd's own"),
            ));
        }
        self.admitting("new sessions")?;
        self.add_session(name, tenant, layout, None, now)
    }

    /// Registers a session of kvtierd's own (the SGLang object store's) for `tenant`'s pages
    /// of `layout`: it never expires, and a pool made for it has `slots` slots and leaves
    /// L3 to its owner ([`L2Pool::writes_own_l3`]). Taken while draining too: it serves
    /// what is stored already.
    pub fn register_own(
        &mut self,
        name: String,
        tenant: &str,
        layout: &Layout,
        slots: u32,
        now: Instant,
    ) -> Result<SessionId, StateError> {
        let id = self
            .add_session(name, tenant, layout, Some(slots), now)?
            .session_id;
        let pool = self.sessions.get(id)?.pool;
        if !self.pools.get(&pool).is_some_and(|p| p.writes_own_l3) {
            // The layout's pool was a client's (its layout is named like kvtierd's own).
            let _ = self.close(id);
            return Err(StateError::Refused(format!(
                "the pool of {} is a client's, not kvtierd's own",
                layout.spec().model_id
            )));
        }
        Ok(id)
    }

    fn add_session(
        &mut self,
        name: String,
        tenant: &str,
        layout: &Layout,
        own_slots: Option<u32>,
        now: Instant,
    ) -> Result<Registered, StateError> {
        let id = self.sessions.new_id()?;
        let pool = self.pool_for(layout, tenant, own_slots)?;
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
                own: own_slots.is_some(),
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
        self.pools.totals()
    }

    /// Pages the admission filter declined that left L2 unwritten since start, and their
    /// bytes.
    pub fn declined(&self) -> (u64, u64) {
        self.pools.declined()
    }

    /// Bytes of shared memory mapped for pools, and bytes holding ready or writing pages.
    pub fn pool_bytes(&self) -> (u64, u64) {
        self.pools.bytes()
    }
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
        state_with(|_| {})
    }

    /// [`state`], with `edit` applied to its configuration first.
    pub(crate) fn state_with(edit: impl FnOnce(&mut DaemonConfig)) -> (HostState, SessionId) {
        let mut cfg = DaemonConfig::default();
        cfg.l2.backing = L2Backing::Memfd;
        cfg.l2.pool_pages = 16;
        cfg.l2.take_over_after_crash = false;
        cfg.l3.backend = L3Backend::Memory;
        edit(&mut cfg);
        let mut st = HostState::new(&cfg).unwrap();
        st.set_write(Some(WritePolicy::WriteThrough));
        let id = st
            .register("t".into(), "", &tiny_layout(), Instant::now())
            .unwrap()
            .session_id;
        (st, id)
    }

    /// A tracked tenant without quotas.
    pub(crate) fn tenant(name: &str) -> kvtier_config::tenants::TenantQuota {
        kvtier_config::tenants::TenantQuota {
            name: name.into(),
            l2_pages: None,
            l3_bytes: None,
            uids: Vec::new(),
            gids: Vec::new(),
        }
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
