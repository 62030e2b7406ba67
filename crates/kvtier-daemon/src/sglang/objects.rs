//! The node's memory of SGLang objects: kvtierd's own L2 pages, so that every SGLang
//! instance on the node (each with its own host pool) is served from memory rather than from
//! L3, with L2's index, eviction policy, quotas, events and crash takeover.
//!
//! SGLang's objects come in one or two sizes. Each size (and, under tenancy, each tenant) has
//! a session of kvtierd's own ([`HostState::register_own`]) over a pool of that page size
//! holding `sglang_rpc.memory_bytes` of slots, made when the first object of that size
//! arrives. A put reserves a slot (replacing an idle copy of the id: a later put wins), copies
//! the object in, and commits it, marked held by L3 when the service wrote it there; a get
//! pins the page, copies it out and releases it. Nothing is visible before it is committed,
//! and a page being read is never overwritten.
//!
//! Buffers for the copies in and out are recycled: SGLang's objects all have one or two sizes,
//! so in steady state no put or get faults in fresh pages, which otherwise costs more than the
//! copy itself (measured: BatchPut at 0.14 of memcpy speed with fresh buffers).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use kvtier_core::{DType, KvKind, Layout, LayoutSpec, PageKey, SessionId};
use kvtier_shm::ShmPool;
use parking_lot::Mutex;
use prometheus::{IntCounter, IntGauge};

use crate::state::{OWN_LAYOUT_PREFIX, OwnSlot, Shared, StateError};

/// What the object pages report to Prometheus.
#[derive(Debug, Clone)]
pub struct MemoryGauges {
    /// Bytes held.
    pub bytes: IntGauge,
    /// Objects held.
    pub objects: IntGauge,
    /// Objects pushed out to make room.
    pub evictions: IntCounter,
}

/// Object sizes kept in memory per tenant at once, each in a pool of its own: SGLang's objects
/// come in one size (page-first layouts, MLA) or two (K and V apart), and a client naming
/// lengths at will must not make kvtierd map a pool for each. A further size takes the place
/// of the least recently used one.
pub const MAX_SIZES: usize = 2;

/// Most bytes of spare buffers kept for reuse.
pub const SPARE_BYTES: u64 = 64 << 20;

/// Spare buffers by exact length.
#[derive(Debug, Default)]
struct Spares {
    lists: Mutex<HashMap<usize, Vec<Vec<u8>>>>,
    bytes: AtomicU64,
}

/// One size's (and tenant's) session and its pool's memory.
#[derive(Debug, Clone)]
struct Own {
    id: SessionId,
    shm: Arc<ShmPool>,
    /// Its objects' length.
    len: usize,
    /// When it was last used (put or served), for giving a third size its place.
    used: Arc<Mutex<Instant>>,
}

impl Own {
    fn touch(&self) {
        *self.used.lock() = Instant::now();
    }
}

/// SGLang's objects as kvtierd's own L2 pages. See the [module docs](self).
#[derive(Debug)]
pub struct ObjectPages {
    state: Arc<Shared>,
    /// Bytes of each pool (`sglang_rpc.memory_bytes`); 0: objects are not kept.
    pool_bytes: u64,
    /// By (object length, tenant).
    own: Mutex<HashMap<(usize, String), Own>>,
    gauges: Option<MemoryGauges>,
    spares: Spares,
}

/// The layout of an object of `len` bytes: one "token" of `len` bytes, in a model id only
/// kvtierd may register.
fn layout(len: usize) -> Option<Layout> {
    Layout::new(LayoutSpec {
        model_id: format!("{OWN_LAYOUT_PREFIX}sglang-objects"),
        model_version: String::new(),
        dtype: DType::U8,
        num_layers: 1,
        kind: KvKind::State {
            elems: u32::try_from(len).ok()?,
        },
        page_size: 1,
        tp_rank: 0,
        tp_size: 1,
    })
    .ok()
}

/// Logged at most every 10 s: objects that could not be kept in memory.
static NOT_KEPT_LOG: kvtier_server::conn::Throttle =
    kvtier_server::conn::Throttle::new(kvtier_server::conn::LOG_EVERY);

impl ObjectPages {
    /// Objects in pools of `pool_bytes` each (0: none kept) in `state`'s L2.
    pub fn new(state: Arc<Shared>, pool_bytes: u64, gauges: Option<MemoryGauges>) -> Self {
        Self {
            state,
            pool_bytes,
            own: Mutex::default(),
            gauges,
            spares: Spares::default(),
        }
    }

    /// Opens the pools of objects a dead kvtierd left and this one took over, so their
    /// objects are served again (they are the default tenant's: a named tenant's own pools
    /// do not survive a crash).
    pub fn adopt(&self) {
        let model = layout(1)
            .map(|l| l.spec().model_id.clone())
            .unwrap_or_default();
        let layouts = self.state.lock().own_layouts();
        for l in layouts.iter().filter(|l| l.spec().model_id == model) {
            if self.own(l.page_bytes(), "").is_some() {
                tracing::info!(
                    len = l.page_bytes(),
                    "serving the sglang objects a dead kvtierd kept"
                );
            }
        }
    }

    /// Whether objects are kept at all.
    pub fn enabled(&self) -> bool {
        self.pool_bytes > 0
    }

    /// The session and pool of objects of `len` bytes of `tenant`, if there is one.
    fn existing(&self, len: usize, tenant: &str) -> Option<Own> {
        self.own.lock().get(&(len, tenant.to_string())).cloned()
    }

    /// The session and pool of objects of `len` bytes of `tenant`, registered if need be;
    /// `None` when such objects cannot be kept (larger than a pool, a third size of the
    /// tenant's, no pool place left).
    fn own(&self, len: usize, tenant: &str) -> Option<Own> {
        if !self.enabled() || len == 0 {
            return None;
        }
        let layout = layout(len)?;
        let slots =
            u32::try_from(self.pool_bytes / layout.slot_stride() as u64).unwrap_or(u32::MAX);
        if slots == 0 {
            return None;
        }
        // Under the map's lock (then the state's: always in that order), so two first puts of
        // a size make one session, not one each.
        let mut own = self.own.lock();
        let k = (len, tenant.to_string());
        if let Some(o) = own.get(&k) {
            return Some(o.clone());
        }
        // A third size takes the place of the tenant's least recently used one: its session
        // ends, so its pool goes when it is next needed, or idle for l2.idle_pool_ttl. No
        // size, once put, keeps memory for good.
        if own.keys().filter(|(_, t)| t == tenant).count() >= MAX_SIZES {
            let oldest = own
                .iter()
                .filter(|((_, t), _)| t == tenant)
                .min_by_key(|(_, o)| *o.used.lock())
                .map(|(k, o)| (k.clone(), o.id));
            if let Some((k, id)) = oldest {
                own.remove(&k);
                let _ = self.state.lock().close(id);
                tracing::info!(
                    len = k.0,
                    tenant,
                    "sglang objects of a size no longer used give their memory to a new size"
                );
            }
        }
        let made = {
            let mut st = self.state.lock();
            st.register_own(
                format!("kvtierd/sglang-objects/{len}"),
                tenant,
                &layout,
                slots,
                Instant::now(),
            )
            .and_then(|id| Ok((id, st.mapped_pool(id)?.0)))
        };
        match made {
            Ok((id, shm)) => {
                let o = Own {
                    id,
                    shm,
                    len,
                    used: Arc::new(Mutex::new(Instant::now())),
                };
                own.insert(k, o.clone());
                Some(o)
            }
            Err(e) => {
                if let Some(more) = NOT_KEPT_LOG.allow() {
                    tracing::warn!(
                        len,
                        tenant,
                        suppressed = more,
                        "sglang objects of this size are not kept in memory: {e}"
                    );
                }
                None
            }
        }
    }

    /// The sessions of `tenant`'s objects of every size.
    fn own_of(&self, tenant: &str) -> Vec<Own> {
        self.own
            .lock()
            .iter()
            .filter(|((_, t), _)| t == tenant)
            .map(|(_, o)| o.clone())
            .collect()
    }

    /// A session kvtierd closed or lost (an operator's clear of sessions): forgotten, made
    /// again on next use.
    fn lost(&self, o: &Own, e: &StateError) {
        tracing::warn!("sglang object memory: its session is gone ({e}); making a new one");
        self.own.lock().retain(|_, v| v.id != o.id);
    }

    /// Copies the object `key` of `len` bytes of `tenant` into `dst` (exactly `len` bytes);
    /// false when memory does not hold it.
    pub fn get(&self, tenant: &str, key: PageKey, dst: &mut [u8]) -> bool {
        // A pool taken over from a dead kvtierd is opened as the default tenant's; a named
        // tenant's keys there are its own all the same.
        let Some(o) = self
            .existing(dst.len(), tenant)
            .or_else(|| self.existing(dst.len(), ""))
        else {
            return false;
        };
        let pinned = self.state.lock().acquire(o.id, &[key], Instant::now());
        let slot = match pinned {
            Ok((slots, _)) => match slots.first() {
                Some(&s) => s,
                None => return false,
            },
            Err(e) => {
                self.lost(&o, &e);
                return false;
            }
        };
        o.touch();
        let copied = o.shm.read(slot, 0, dst);
        if let Err(e) = self.state.lock().release(o.id, &[key], Instant::now()) {
            tracing::error!("sglang object memory: releasing a page it pinned: {e}");
        }
        match copied {
            Ok(()) => true,
            Err(e) => {
                tracing::error!("sglang object memory: reading a page: {e}");
                false
            }
        }
    }

    /// Whether memory holds `key` of `tenant`, of any size (its age is left alone).
    pub fn contains(&self, tenant: &str, key: PageKey) -> bool {
        // The sessions first: the map's lock is never taken under the state's. A pool taken
        // over from a dead kvtierd is opened as the default tenant's (see `get`).
        let mut own = self.own_of(tenant);
        if !tenant.is_empty() {
            own.extend(self.own_of(""));
        }
        let mut st = self.state.lock();
        own.iter().any(|o| {
            st.lookup(o.id, &[key], Instant::now())
                .is_ok_and(|n| n == 1)
        })
    }

    /// A place for the object `key` of `len` bytes of `tenant`, for a put: copies of `key`
    /// there and of other sizes are removed first (a later put wins). `Ok(None)` when it is
    /// not kept (too large, no room, memory off: no copy of it is left in memory);
    /// `Err(Busy)` when a copy of it is being read or written (it stays: the caller must not
    /// report a put that another copy may still answer for).
    pub fn reserve(&self, tenant: &str, key: PageKey, len: usize) -> Result<Option<Slot>, Busy> {
        let now = Instant::now();
        let others = self.own_of(tenant).into_iter().filter(|o| o.len != len);
        for o in others {
            // Bound first: the state's guard must be gone before `lost` takes the map's lock.
            let forgot = self.state.lock().forget_own(o.id, key, now);
            match forgot {
                Ok(true) => {}
                Ok(false) => return Err(Busy),
                Err(e) => self.lost(&o, &e),
            }
        }
        self.place(tenant, key, len, true)
    }

    /// A place for the object `key` of `len` bytes of `tenant` only if memory holds no copy
    /// of it (any size): what a get read from L3 is kept for the next reader, never over a
    /// copy a put stored meanwhile.
    pub fn reserve_if_absent(&self, tenant: &str, key: PageKey, len: usize) -> Option<Slot> {
        if self.contains(tenant, key) {
            return None;
        }
        self.place(tenant, key, len, false).ok().flatten()
    }

    fn place(
        &self,
        tenant: &str,
        key: PageKey,
        len: usize,
        replace: bool,
    ) -> Result<Option<Slot>, Busy> {
        let Some(o) = self.own(len, tenant) else {
            return Ok(None);
        };
        let placed = self
            .state
            .lock()
            .reserve_own(o.id, key, replace, Instant::now());
        o.touch();
        match placed {
            Ok(OwnSlot::Placed(slot)) => Ok(Some(Slot {
                state: self.state.clone(),
                own: o,
                key,
                slot,
                open: true,
            })),
            Ok(OwnSlot::Busy) => Err(Busy),
            Ok(OwnSlot::NoRoom) => Ok(None),
            Err(e) => {
                self.lost(&o, &e);
                Ok(None)
            }
        }
    }

    /// Reports what the pools hold to the gauges.
    pub fn report(&self) {
        let Some(g) = &self.gauges else { return };
        let u = self.state.lock().own_usage();
        g.bytes.set(u.bytes as i64);
        g.objects.set(u.pages as i64);
        kvtier_server::metrics::catch_up(&g.evictions, u.evictions);
    }

    /// A buffer of exactly `len` bytes: a recycled one (holding stale bytes the caller must
    /// overwrite in full) or a fresh, zeroed one.
    pub fn take_buffer(&self, len: usize) -> Vec<u8> {
        let reused = {
            let mut lists = self.spares.lists.lock();
            lists.get_mut(&len).and_then(Vec::pop)
        };
        match reused {
            Some(v) => {
                self.spares.bytes.fetch_sub(len as u64, Ordering::Relaxed);
                v
            }
            None => vec![0u8; len],
        }
    }

    /// Takes `data` back for reuse if nothing else references it and the spare list has room.
    pub fn recycle(&self, data: Bytes) {
        if !data.is_unique() {
            return;
        }
        self.recycle_vec(Vec::from(data));
    }

    /// [`Self::recycle`] for a buffer nothing else can reference.
    pub fn recycle_vec(&self, v: Vec<u8>) {
        let len = v.len() as u64;
        if len == 0 || self.spares.bytes.fetch_add(len, Ordering::Relaxed) + len > SPARE_BYTES {
            self.spares.bytes.fetch_sub(len, Ordering::Relaxed);
            return;
        }
        let mut lists = self.spares.lists.lock();
        lists.entry(v.len()).or_default().push(v);
    }
}

/// A copy of the object is being read or written ([`ObjectPages::reserve`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy;

/// A reserved page for one object: filled and committed with [`Slot::commit`], or given
/// back when dropped.
#[derive(Debug)]
pub struct Slot {
    state: Arc<Shared>,
    own: Own,
    key: PageKey,
    slot: u32,
    open: bool,
}

impl Slot {
    /// Copies `data` (the object's length) in and makes it visible, marked held by L3 when
    /// its owner wrote it there (`in_l3`). False when that failed (the slot is given back).
    pub fn commit(mut self, data: &[u8], in_l3: bool) -> bool {
        if let Err(e) = self.own.shm.write(self.slot, 0, data) {
            tracing::error!("sglang object memory: filling a page: {e}");
            return false;
        }
        match self
            .state
            .lock()
            .commit_own(self.own.id, self.key, in_l3, Instant::now())
        {
            Ok(()) => {
                self.open = false;
                true
            }
            Err(e) => {
                tracing::error!("sglang object memory: committing a page: {e}");
                false
            }
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.open {
            // Its session may be gone already (then so is the reservation).
            let _ = self
                .state
                .lock()
                .abort(self.own.id, &[self.key], Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::Arc;

    use kvtier_core::PageKey;

    use super::ObjectPages;
    use crate::state::Shared;
    use crate::state::testing::state;

    fn read(m: &ObjectPages, key: PageKey) -> Option<Vec<u8>> {
        let mut b = vec![0u8; 64];
        m.get("", key, &mut b).then_some(b)
    }

    #[test]
    fn what_a_get_read_from_l3_never_replaces_a_copy_a_put_stored_meanwhile() {
        // Review finding: a get that read v1 from L3 kept it over the v2 a put committed
        // while the read ran, and every later get served v1.
        let m = ObjectPages::new(Arc::new(Shared::new(state().0)), 1 << 20, None);
        let key = PageKey([7; 32]);
        // The put of v2 lands while a get is reading v1 from L3 ...
        m.reserve("", key, 64)
            .unwrap()
            .unwrap()
            .commit(&[2; 64], true);
        // ... and the get, done, keeps what it read only where memory has no copy.
        assert!(m.reserve_if_absent("", key, 64).is_none());
        assert_eq!(read(&m, key), Some(vec![2; 64]));
        // A put replaces the copy (a later put wins); a get's copy fills a gap.
        m.reserve("", key, 64)
            .unwrap()
            .unwrap()
            .commit(&[3; 64], true);
        assert_eq!(read(&m, key), Some(vec![3; 64]));
        let other = PageKey([8; 32]);
        m.reserve_if_absent("", other, 64)
            .unwrap()
            .commit(&[4; 64], true);
        assert_eq!(read(&m, other), Some(vec![4; 64]));
        // A slot given up (the put's copy failed) leaves nothing behind.
        let gone = PageKey([9; 32]);
        drop(m.reserve("", gone, 64).unwrap().unwrap());
        assert_eq!(read(&m, gone), None);
        assert!(m.reserve_if_absent("", gone, 64).is_some());
    }
}
