//! kvtierd's L2 pools, a component of [`HostState`](super::HostState): one pool per layout
//! class (or per named tenant and layout, `l2.tenant_pools`), each its shared memory and its
//! index. It owns how a pool is made (sized, backed, named, sealed), found and summed, and
//! the pool settings of `[l2]`. Which pool a session of a tenant uses is the tenant table's
//! answer; when a pool may go is the state's (it needs the sessions and prefetches).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_config::daemon::{DaemonConfig, L2Backing};
use kvtier_core::host_index::{HostIndex, HostIndexStats, L3Mode};
use kvtier_core::{
    Admission, AdmissionKind, Epoch, Layout, LayoutFingerprint, PageKey, PolicyKind, TenantTag,
};
use kvtier_shm::{Backing, PoolSpec, ShmPool};

use super::StateError;
use super::survive::{self, Seals};

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
    /// Which of its pages may go to L3 (`l3.admission`).
    pub admission: Admission,
    /// One of kvtierd's own pools (the SGLang object store's): its owner writes L3 itself,
    /// so L2's writer, flusher, drain and admission filter leave it alone, and it evicts as
    /// with no L3 (a page its owner did not mark held in L3 is counted lost when it goes).
    pub writes_own_l3: bool,
}

impl L2Pool {
    /// Tells the admission filter of `keys`, just stored here, and marks those it turns
    /// away as declined (they leave L2 unwritten). Returns the admitted keys and how many
    /// were declined. Only while an L3 is attached.
    pub(super) fn admit_stored<'k>(&mut self, keys: &'k [PageKey]) -> (Cow<'k, [PageKey]>, u64) {
        if self.admission.kind() == AdmissionKind::All {
            return (Cow::Borrowed(keys), 0);
        }
        let mut admitted = Vec::with_capacity(keys.len());
        let mut declined = 0;
        for k in keys {
            if self.admission.admit(k) {
                admitted.push(*k);
            } else if self.index.decline_l3(k) {
                declined += 1;
            }
        }
        (Cow::Owned(admitted), declined)
    }

    /// Tells the admission filter of `keys`, just served here (an acquire's hits; a page a
    /// writer finds present, or an engine hits on its device, is no sighting of L2's).
    /// Returns those it declined before and admits now: they are written to L3 like any page
    /// not there yet.
    pub(super) fn admit_served(&mut self, keys: &[PageKey]) -> Vec<PageKey> {
        if self.admission.kind() == AdmissionKind::All {
            return Vec::new();
        }
        keys.iter()
            .filter(|k| self.admission.admit(k) && self.index.readmit_l3(k))
            .copied()
            .collect()
    }
}

/// What a new pool's index starts with besides its size.
pub(crate) struct NewPool<'a> {
    /// Its key ([`L2Pool::key`]).
    pub key: LayoutFingerprint,
    /// Its layout.
    pub layout: &'a Layout,
    /// A named tenant's own pool: never sealed (its table would name the layout, not the
    /// tenant; its pages come back from L3).
    pub own: bool,
    /// The run's epoch, in the pool's name.
    pub epoch: Epoch,
    /// The L2 quota of every tracked tenant.
    pub quotas: Vec<(TenantTag, Option<u32>)>,
    /// What L3 is to it now (for one of kvtierd's own pools: ignored, it has none).
    pub l3_mode: L3Mode,
    /// `Some(slots)`: one of kvtierd's own pools ([`L2Pool::writes_own_l3`]), of that size.
    pub own_slots: Option<u32>,
}

/// Every L2 pool, and the `[l2]` settings they are made by.
#[derive(Debug)]
pub(crate) struct Pools {
    map: HashMap<LayoutFingerprint, L2Pool>,
    policy: PolicyKind,
    /// Where pools live: a memfd each, or files in kvtierd's own directory ([`pool_dir`]).
    backing: Backing,
    pool_bytes: u64,
    pool_pages: u64,
    max_pools: u32,
    /// Most own pools of one named tenant (0: an even share of `max_pools`).
    max_pools_per_tenant: u32,
    /// How long an unused pool lives (zero: until its place is needed).
    idle_ttl: Duration,
    /// Largest slot a layout may have.
    max_page_bytes: u64,
    mlock: bool,
    huge_pages: bool,
    reserve: bool,
    dirty_fraction: f64,
    /// Keep slot tables, so the pools survive a crash.
    take_over: bool,
    /// Each new pool's admission filter (`l3.admission`) and its window.
    admission: AdmissionKind,
    admission_window: u64,
    /// Pages the admission filter declined that pools now gone evicted, and their bytes.
    retired_declined: (u64, u64),
    /// Which kvtierd this is, across restarts (from its socket path): pool files carry it,
    /// so a restarted daemon takes over its own predecessor's pools and no one else's.
    instance: String,
}

impl Pools {
    /// No pools yet; made by `cfg` (already validated).
    pub(crate) fn new(cfg: &DaemonConfig) -> Result<Self, StateError> {
        let backing = match cfg.l2.backing {
            L2Backing::Memfd => Backing::Memfd,
            L2Backing::ShmFile => Backing::ShmFile(open_pool_dir(cfg)?),
        };
        Ok(Self {
            map: HashMap::new(),
            policy: cfg.l2.eviction_policy,
            backing,
            pool_bytes: cfg.l2.pool_bytes.0,
            pool_pages: cfg.l2.pool_pages,
            max_pools: cfg.l2.max_pools,
            max_pools_per_tenant: cfg.l2.max_pools_per_tenant,
            idle_ttl: cfg.l2.idle_pool_ttl.0,
            max_page_bytes: cfg.l2.max_page_bytes.0,
            mlock: cfg.l2.mlock,
            huge_pages: cfg.l2.huge_pages,
            reserve: cfg.l2.reserve,
            dirty_fraction: cfg.l2.dirty_fraction,
            take_over: cfg.l2.take_over_after_crash,
            admission: cfg.l3.admission,
            admission_window: cfg.l3.admission_window,
            retired_declined: (0, 0),
            instance: survive::instance_id(&cfg.socket_path()),
        })
    }

    /// The pool `key`.
    pub(crate) fn get(&self, key: &LayoutFingerprint) -> Option<&L2Pool> {
        self.map.get(key)
    }

    /// The pool `key`, to change.
    pub(crate) fn get_mut(&mut self, key: &LayoutFingerprint) -> Option<&mut L2Pool> {
        self.map.get_mut(key)
    }

    /// Whether pool `key` exists.
    pub(crate) fn contains(&self, key: &LayoutFingerprint) -> bool {
        self.map.contains_key(key)
    }

    /// Every pool.
    pub(crate) fn values(&self) -> impl Iterator<Item = &L2Pool> {
        self.map.values()
    }

    /// Every pool, to change.
    pub(crate) fn values_mut(&mut self) -> impl Iterator<Item = &mut L2Pool> {
        self.map.values_mut()
    }

    /// Takes pool `key` out (its memory goes with its last reference).
    pub(crate) fn remove(&mut self, key: &LayoutFingerprint) -> Option<L2Pool> {
        let pool = self.map.remove(key)?;
        let (pages, bytes) = Self::declined_of(&pool);
        self.retired_declined.0 += pages;
        self.retired_declined.1 += bytes;
        Some(pool)
    }

    fn declined_of(pool: &L2Pool) -> (u64, u64) {
        let n = pool.index.stats().declined_evictions;
        (n, n * pool.layout.page_bytes() as u64)
    }

    /// Pages the admission filter declined that left L2 unwritten since start, and their
    /// bytes: what was not written to L3 by choice.
    pub(crate) fn declined(&self) -> (u64, u64) {
        self.map
            .values()
            .map(Self::declined_of)
            .fold(self.retired_declined, |(p, b), (p2, b2)| (p + p2, b + b2))
    }

    /// Whether `l2.max_pools` pools exist already.
    pub(crate) fn at_limit(&self) -> bool {
        self.map.len() >= self.max_pools as usize
    }

    /// The most own pools a named tenant may have, with `named` tenants named: its
    /// `l2.max_pools_per_tenant`, or an even share of `l2.max_pools` with the shared pools.
    pub(crate) fn tenant_share(&self, named: usize) -> usize {
        match self.max_pools_per_tenant {
            0 => (self.max_pools as usize / (named + 1)).max(1),
            n => n as usize,
        }
    }

    /// How long an unused pool lives (zero: until its place is needed).
    pub(crate) fn idle_ttl(&self) -> Duration {
        self.idle_ttl
    }

    /// Which kvtierd this is across restarts (pool files carry it).
    pub(crate) fn instance(&self) -> &str {
        &self.instance
    }

    /// kvtierd's own pool directory, when pools are files in it (`l2.backing = "shm_file"`).
    pub(crate) fn dir(&self) -> Option<&kvtier_shm::OwnDir> {
        match &self.backing {
            Backing::ShmFile(dir) => Some(dir),
            Backing::Memfd => None,
        }
    }

    /// Whether pools keep slot tables (so a later kvtierd can take them over).
    pub(crate) fn seals_enabled(&self) -> bool {
        self.take_over && self.backing.is_file()
    }

    /// Refuses a layout whose page is larger than `l2.max_page_bytes`.
    pub(crate) fn check_page_fits(&self, layout: &Layout) -> Result<(), StateError> {
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
        Ok(())
    }

    /// The error of a new layout past `l2.max_pools`.
    pub(crate) fn full(&self, layout: &Layout) -> StateError {
        StateError::Full(format!(
            "l2.max_pools ({}) layouts are already served; this layout ({}) is not",
            self.max_pools,
            layout.spec().model_id
        ))
    }

    /// Makes pool `new.key` (which must not exist): its memory sized by `l2.pool_bytes` or
    /// `l2.pool_pages`, its index with every tenant's quota, and (file-backed, not a
    /// tenant's own) the slot table that lets it survive a crash. The bool says whether a
    /// stale file at its name (a dead kvtierd's) was removed first.
    pub(crate) fn create(&mut self, new: NewPool<'_>) -> Result<(&mut L2Pool, bool), StateError> {
        let NewPool {
            key: fp,
            layout,
            own,
            epoch,
            quotas,
            l3_mode,
            own_slots,
        } = new;
        self.check_page_fits(layout)?;
        let stride = layout.slot_stride() as u64;
        let slots = match own_slots {
            Some(n) => u64::from(n),
            None if self.pool_pages > 0 => self.pool_pages,
            None => self.pool_bytes / stride,
        };
        let l3_mode = if own_slots.is_some() {
            L3Mode::Absent
        } else {
            l3_mode
        };
        if slots == 0 {
            return Err(StateError::Refused(format!(
                "l2.pool_bytes ({}) is smaller than one page of this layout ({stride} bytes)",
                self.pool_bytes
            )));
        }
        let slots = u32::try_from(slots).unwrap_or(u32::MAX);
        // The run's epoch in the name: a restarted kvtierd that got the same pid (pid 1 in a
        // container) never makes a pool under its dead predecessor's name.
        let name = format!(
            "kvtier-{}-{}-{}-{}",
            self.instance,
            std::process::id(),
            epoch,
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
                "no room for the pool of {fp} ({e}): lower l2.pool_bytes / l2.pool_pages or \
                 give l2.shm_dir more space"
            )),
            e => StateError::Internal(format!("creating the pool for {fp}: {e}")),
        })?;
        if replaced {
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
        let admission = Admission::new(self.admission, self.admission_window);
        let mut index = HostIndex::new(slots, self.policy);
        // kvtierd's own pages are no engine's KV: routers hear nothing of them.
        index.record_changes(own_slots.is_none());
        for (tag, quota) in quotas {
            index.set_tenant_quota(tag, quota);
        }
        index.set_l3_mode(l3_mode);
        index.set_dirty_limit(((f64::from(slots) * self.dirty_fraction) as u32).max(1));
        let pool = self.map.entry(fp).insert_entry(L2Pool {
            key: fp,
            layout: layout.clone(),
            shm: Arc::new(shm),
            index,
            prefetch_held: 0,
            seals,
            last_used: Instant::now(),
            admission,
            writes_own_l3: own_slots.is_some(),
        });
        Ok((pool.into_mut(), replaced))
    }

    /// Index counters of every pool, summed.
    pub(crate) fn totals(&self) -> HostIndexStats {
        let mut t = HostIndexStats::default();
        for p in self.map.values() {
            let s = p.index.stats();
            t.capacity += s.capacity;
            t.ready += s.ready;
            t.writing += s.writing;
            t.pinned += s.pinned;
            t.pins += s.pins;
            t.evictions += s.evictions;
            t.unwritten_evictions += s.unwritten_evictions;
            t.declined_evictions += s.declined_evictions;
            t.dirty += s.dirty;
            t.leased += s.leased;
        }
        t
    }

    /// Bytes of shared memory mapped for pools, and bytes holding ready or writing pages.
    pub(crate) fn bytes(&self) -> (u64, u64) {
        self.map.values().fold((0, 0), |(total, used), p| {
            let s = p.index.stats();
            let stride = p.shm.stride() as u64;
            (
                total + p.shm.len() as u64,
                used + u64::from(s.ready + s.writing) * stride,
            )
        })
    }
}
