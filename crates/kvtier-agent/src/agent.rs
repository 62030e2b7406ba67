//! The agent's state and its `kvtier.v1.Agent` service: the engine's prefix cache (a radix tree
//! of page keys over the engine's device pages), load-back from L2, prefetch from L3 through
//! kvtierd, and device → host backups per the write policy.
//!
//! The state sits behind one mutex, held for the few microseconds a tree operation takes and
//! never across an await: copies and daemon calls happen outside it, with the pages they read
//! locked in the tree (so eviction cannot hand them back to the engine mid-copy).
//!
//! Size: the `Agent` service's handlers and the state they share under one lock, which is why
//! they live together; backups (`backup.rs`), the kvtierd link (`link.rs`) and metrics are
//! already apart, and pool registration is the next concept to move out if this grows.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use kvtier_client::{ClientError, PrefetchOptions};
use kvtier_config::agent::AgentConfig;
use kvtier_core::radix::NodeId;
use kvtier_core::{DevicePool, Layout, Namespace, PageHasher, PageKey, RadixTree, WritePolicy};
use kvtier_device::cpu::CpuDevice;
use kvtier_device::cuda::{CudaDevice, IPC_HANDLE_BYTES};
use kvtier_device::{Device, DeviceError, PageCopy};
use kvtier_proto::ApiError;
use kvtier_proto::v1::{self, agent_server};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, mpsc};
use tonic::{Request, Response, Status};

use crate::backup::{BackupWorker, Counters};
use crate::handle_ids::HandleIds;
use crate::link::{Link, Linked, is_link_error};
use crate::metrics::Metrics;
use crate::owner::{Caller, Owner};

/// A request's tokens from whichever field carries them: `tokens`, or `packed_tokens`
/// (little-endian u32s). Both set, or a packed length that is not a multiple of 4, is refused.
pub(crate) fn request_tokens<'a>(
    tokens: &'a [u32],
    packed: &[u8],
) -> Result<std::borrow::Cow<'a, [u32]>, ApiError> {
    if packed.is_empty() {
        return Ok(std::borrow::Cow::Borrowed(tokens));
    }
    if !tokens.is_empty() {
        return Err(ApiError::invalid(
            "packed_tokens",
            "set with tokens; send the prompt in one of the two",
        ));
    }
    if !packed.len().is_multiple_of(4) {
        return Err(ApiError::invalid(
            "packed_tokens",
            format!(
                "{} bytes is not a whole number of 4-byte tokens",
                packed.len()
            ),
        ));
    }
    Ok(std::borrow::Cow::Owned(
        packed
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    ))
}

/// The engine's pool as registered.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) device: Arc<dyn Device>,
    pub(crate) pool: DevicePool,
    /// The engine keeps its own prefix cache over the pool (`engine_cache.rs`).
    pub(crate) engine_cache: bool,
    /// The client that registered it; only it is served.
    pub(crate) owner: Owner,
}

/// An open request: the tree node whose prefix it locks, its keys and device prefix.
#[derive(Debug)]
struct Handle {
    node: NodeId,
    keys: Vec<PageKey>,
    device: Vec<u32>,
    prefetch: Option<String>,
}

/// Everything behind the mutex.
pub(crate) struct State {
    pub(crate) engine: Option<Engine>,
    pub(crate) tree: RadixTree<PageKey, u32>,
    /// Which device pages the tree holds (to refuse an engine handing out one twice).
    pub(crate) in_tree: Vec<bool>,
    handles: HashMap<u64, Handle>,
    handle_ids: HandleIds,
    /// The kvtierd session generation backup marks belong to (see [`Link`]).
    pub(crate) link_generation: u64,
    /// Engine-cache mode: how often each page has been looked up, for
    /// write_through_selective (bounded; see `engine_cache.rs`).
    pub(crate) lookups: HashMap<PageKey, u64>,
}

impl State {
    /// The registered pool, whoever registered it (for calls that read no pool memory).
    fn any_registered(&self) -> Result<&Engine, ApiError> {
        self.engine.as_ref().ok_or_else(|| {
            ApiError::NotFound("pool: no KV pool is registered; call RegisterPool first".into())
        })
    }

    /// The registered pool, if `caller` owns it.
    fn registered(&self, caller: &Caller) -> Result<&Engine, ApiError> {
        let e = self.any_registered()?;
        e.owner.admits(caller)?;
        Ok(e)
    }

    /// The registered pool, in the mode where the agent keeps the prefix tree, if `caller`
    /// owns it.
    pub(crate) fn engine(&self, caller: &Caller) -> Result<&Engine, ApiError> {
        let e = self.registered(caller)?;
        if e.engine_cache {
            return Err(ApiError::FailedPrecondition(
                "the pool was registered with engine_cache (the engine keeps its own prefix \
                 cache): use Lookup, Load and Save"
                    .into(),
            ));
        }
        Ok(e)
    }

    /// The registered pool, in engine-cache mode, if `caller` owns it; `None`: for a call
    /// that reads no pool memory (`Lookup`, which an engine's scheduler process makes).
    pub(crate) fn cache_engine(&self, caller: Option<&Caller>) -> Result<&Engine, ApiError> {
        let e = match caller {
            Some(c) => self.registered(c)?,
            None => self.any_registered()?,
        };
        if !e.engine_cache {
            return Err(ApiError::FailedPrecondition(
                "the pool was registered without engine_cache (the agent keeps the prefix \
                 tree): use Match, LoadBack, Insert and Release"
                    .into(),
            ));
        }
        Ok(e)
    }
}

/// What the service and its background tasks share.
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) link: Arc<Link>,
    pub(crate) metrics: Metrics,
    /// Device → L2 write policy, with its threshold.
    pub(crate) policy: WritePolicy,
    max_tokens: usize,
    /// How long an owner whose process is not visible keeps the pool without a call.
    pool_lease: Duration,
    copy_threads: usize,
    eviction: kvtier_core::PolicyKind,
    /// The early-backup queue; each entry holds its pages' share of `backup_room`.
    pub(crate) backups: mpsc::UnboundedSender<(NodeId, OwnedSemaphorePermit)>,
    /// Pages early backups may have queued or running (`cache.backup_queue`).
    pub(crate) backup_room: Arc<Semaphore>,
    pub(crate) backup_room_pages: u32,
    /// Early backups running at once; an Evict's backups too.
    pub(crate) backup_concurrency: usize,
    /// Woken whenever a backup ends (an Evict waiting for one).
    pub(crate) backup_done: Notify,
    /// Longest an Evict waits for room in L2.
    pub(crate) evict_wait: Duration,
    pub(crate) counters: Counters,
    metrics_address: String,
    /// Names this agent's own prefetches for Load (`l<n>`).
    pub(crate) load_ids: std::sync::atomic::AtomicU64,
}

/// The `kvtier.v1.Agent` service.
#[derive(Clone)]
pub struct AgentService {
    pub(crate) shared: Arc<Shared>,
}

pub(crate) fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Checks pages an engine names: each inside its pool of `n` pages, none twice, none that
/// `taken` says is not the engine's to lend.
pub(crate) fn check_page_list(
    n: usize,
    field: &str,
    pages: &[u32],
    taken: impl Fn(u32) -> bool,
) -> Result<(), ApiError> {
    let mut seen = HashSet::with_capacity(pages.len());
    for (i, &p) in pages.iter().enumerate() {
        if p as usize >= n {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                format!("page {p} is outside the engine's pool of {n} pages"),
            ));
        }
        if !seen.insert(p) {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                format!("page {p} appears twice"),
            ));
        }
        if taken(p) {
            return Err(ApiError::invalid(
                format!("{field}[{i}]"),
                format!("page {p} holds a cached page; it is not free"),
            ));
        }
    }
    Ok(())
}

fn device_error(field: &str, e: DeviceError) -> ApiError {
    match e {
        DeviceError::Invalid { field: f, reason } => {
            ApiError::invalid(format!("{field}.{f}"), reason)
        }
        DeviceError::Unavailable(m) => ApiError::FailedPrecondition(m),
        DeviceError::Copy(m) => ApiError::Internal(m),
    }
}

impl AgentService {
    /// A service configured by `cfg`, over `link`; run its backups with [`run_backups`].
    pub fn new(
        cfg: &AgentConfig,
        link: Arc<Link>,
        metrics: Metrics,
        metrics_address: String,
    ) -> (Self, BackupWorker) {
        let (tx, rx) = mpsc::unbounded_channel();
        let concurrency = cfg.cache.backup_concurrency as usize;
        let eviction = cfg.cache.eviction_policy;
        let shared = Shared {
            state: Mutex::new(State {
                engine: None,
                tree: RadixTree::new(eviction),
                in_tree: Vec::new(),
                handles: HashMap::new(),
                handle_ids: HandleIds::new(),
                link_generation: 0,
                lookups: HashMap::new(),
            }),
            link,
            metrics,
            policy: cfg.write_policy(),
            max_tokens: cfg.server.max_tokens as usize,
            pool_lease: cfg.server.pool_lease.0,
            copy_threads: cfg.device.copy_threads as usize,
            eviction,
            backups: tx,
            backup_room: Arc::new(Semaphore::new(cfg.cache.backup_queue as usize)),
            backup_room_pages: cfg.cache.backup_queue,
            backup_concurrency: concurrency,
            backup_done: Notify::new(),
            evict_wait: cfg.cache.evict_wait.0,
            counters: Counters::default(),
            metrics_address,
            load_ids: std::sync::atomic::AtomicU64::new(0),
        };
        (
            Self {
                shared: Arc::new(shared),
            },
            BackupWorker { rx, concurrency },
        )
    }

    /// A new kvtierd session: what the tree believed L2 held may be gone (a restarted
    /// kvtierd), so every mark is cleared and each page is backed up again (or found in L2)
    /// before its eviction. Runs before the session is used.
    pub fn relinked(&self, generation: u64) {
        let s = &self.shared;
        let mut st = lock(&s.state);
        let (_, marked) = st.tree.forget_backups();
        // Prefetches opened under the old session are gone with it: a load-back pins its
        // pages directly instead of asking the new session for a prefetch it never opened.
        for h in st.handles.values_mut() {
            h.prefetch = None;
        }
        st.link_generation = generation;
        s.metrics.daemon_sessions.inc();
        s.metrics.rechecked_pages.inc_by(marked as u64);
    }

    /// This worker's figures for kvtierd's per-session view.
    pub fn report(&self) -> v1::ClientReport {
        let s = &self.shared;
        let m = &s.metrics;
        let tier = |t: &str| m.match_pages.with_label_values(&[t]).get();
        let st = lock(&s.state);
        v1::ClientReport {
            matches: m.matches.get(),
            device_hit_pages: tier("device"),
            l2_hit_pages: tier("l2"),
            l3_hit_pages: tier("l3"),
            miss_pages: tier("miss"),
            load_back_pages: m.load_back_pages.get(),
            backup_pages: s.counters.backed_up.load(Ordering::Relaxed),
            lost_pages: s.counters.lost().0,
            evicted_pages: m.evicted_pages.get(),
            device_pages: st.tree.device_pages() as u32,
            locked_pages: st.tree.protected_pages() as u32,
        }
    }

    /// Refreshes the gauges (called before each scrape).
    pub fn refresh_gauges(&self) {
        let s = &self.shared;
        let st = lock(&s.state);
        let m = &s.metrics;
        m.device_pages.set(st.tree.device_pages() as i64);
        m.locked_pages.set(st.tree.protected_pages() as i64);
        m.open_handles.set(st.handles.len() as i64);
        m.daemon_connected
            .set(i64::from(s.link.current().is_some()));
    }

    pub(crate) fn keys(
        &self,
        tokens: &[u32],
        ns: Option<v1::Namespace>,
        page_size: usize,
    ) -> Result<Vec<PageKey>, ApiError> {
        if tokens.len() > self.shared.max_tokens {
            return Err(ApiError::invalid(
                "tokens",
                format!(
                    "{} tokens exceed the limit of {} (server.max_tokens)",
                    tokens.len(),
                    self.shared.max_tokens
                ),
            ));
        }
        let ns = Namespace::try_from(ns.unwrap_or_default()).map_err(|e| e.within("namespace"))?;
        Ok(PageHasher::new(page_size, &ns)?.keys(tokens))
    }

    fn page_size(&self, caller: &Caller) -> Result<usize, ApiError> {
        Ok(lock(&self.shared.state)
            .engine(caller)?
            .pool
            .layout()
            .page_size())
    }

    /// Checks engine-lent pages: in range, distinct, and (when `free`) not held by the tree.
    fn check_pages(
        st: &State,
        caller: &Caller,
        field: &str,
        pages: &[u32],
        free: bool,
    ) -> Result<(), ApiError> {
        let n = st.engine(caller)?.pool.num_pages();
        check_page_list(n, field, pages, |p| free && st.in_tree[p as usize])
    }

    async fn register_pool(
        &self,
        caller: Caller,
        req: v1::RegisterPoolRequest,
    ) -> Result<v1::RegisterPoolResponse, ApiError> {
        // Refused early (before opening the caller's memory) when another client owns the
        // pool; checked again below, under the lock, where it counts.
        if let Some(e) = &lock(&self.shared.state).engine {
            e.owner.yields_to(&caller, self.shared.pool_lease)?;
        }
        let spec_wire = req
            .layout
            .ok_or_else(|| ApiError::invalid("layout", "required"))?;
        let layout = Layout::try_from(spec_wire).map_err(|e| e.within("layout"))?;
        let pool = DevicePool::new(layout.clone(), req.num_token_slots)
            .map_err(|e| ApiError::invalid("num_token_slots", e.to_string()))?;
        let device: Arc<dyn Device> = match req.device {
            Some(v1::register_pool_request::Device::Cpu(c)) => {
                if c.path.is_empty() {
                    return Err(ApiError::invalid("cpu.path", "required"));
                }
                Arc::new(
                    CpuDevice::open(
                        pool.clone(),
                        std::path::Path::new(&c.path),
                        self.shared.copy_threads,
                    )
                    .map_err(|e| device_error("cpu", e))?,
                )
            }
            Some(v1::register_pool_request::Device::Cuda(c)) => {
                let mut handles = Vec::with_capacity(c.ipc_handles.len());
                for (i, h) in c.ipc_handles.iter().enumerate() {
                    let h: [u8; IPC_HANDLE_BYTES] = h.as_slice().try_into().map_err(|_| {
                        ApiError::invalid(
                            format!("cuda.ipc_handles[{i}]"),
                            format!(
                                "{} bytes; a CUDA IPC handle has {IPC_HANDLE_BYTES}",
                                h.len()
                            ),
                        )
                    })?;
                    handles.push(h);
                }
                Arc::new(
                    CudaDevice::open(pool.clone(), c.device_ordinal, &handles)
                        .map_err(|e| device_error("cuda", e))?,
                )
            }
            None => return Err(ApiError::invalid("device", "required: cpu or cuda")),
        };
        if req.engine_cache && !self.shared.policy.saves_before_eviction() {
            return Err(ApiError::FailedPrecondition(
                "engine_cache with write_policy write_back: the engine never says when it \
                 evicts a page, so a page saved only then would never be saved; set \
                 write_policy to write_through or write_through_selective"
                    .into(),
            ));
        }
        let num_pages = pool.num_pages();
        let owner = Owner::new(&caller)?;
        let token = owner.token();
        {
            let mut st = lock(&self.shared.state);
            if let Some(e) = &st.engine {
                e.owner.yields_to(&caller, self.shared.pool_lease)?;
            }
            // How often prompts were asked for outlives an engine restart (the same model's
            // next run is asked for the same prompts); another layout starts over.
            if st
                .engine
                .as_ref()
                .is_none_or(|e| e.pool.layout().fingerprint() != layout.fingerprint())
            {
                st.lookups.clear();
            }
            st.engine = Some(Engine {
                device,
                pool,
                engine_cache: req.engine_cache,
                owner,
            });
            st.tree = RadixTree::new(self.shared.eviction);
            st.in_tree = vec![false; num_pages];
            st.handles.clear();
        }
        self.shared.link.want(layout.spec().clone());
        tracing::info!(model = %layout.spec().model_id, fingerprint = %layout.fingerprint(), num_pages, engine_cache = req.engine_cache, pid = ?caller.peer.and_then(|p| p.pid), "engine pool registered");
        // The engine starts saving as soon as this returns: give the kvtierd session the
        // link's deadline to come up first, so the first pages computed are not refused for
        // want of it (a daemon that does not answer in time costs that wait once; saves
        // after it still wait up to cache.evict_wait for the link).
        let linked = self
            .shared
            .link
            .current_or_wait(self.shared.link.timeout())
            .await;
        Ok(v1::RegisterPoolResponse {
            layout: Some(v1::LayoutInfo::from(&layout)),
            num_pages: num_pages as u32,
            daemon_connected: linked.is_some(),
            owner: token.to_hex(),
        })
    }

    /// Runs a daemon call with the link's deadline; a failure that means the link is gone
    /// marks it broken.
    pub(crate) async fn call<T>(
        &self,
        linked: &Arc<Linked>,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Option<T> {
        self.call_as(linked, fut, false).await
    }

    /// [`Self::call`] for a call about one prefetch: `NotFound` then means the prefetch is
    /// gone (revoked before it held anything, or released), not that the session is.
    pub(crate) async fn call_prefetch<T>(
        &self,
        linked: &Arc<Linked>,
        fut: impl Future<Output = Result<T, ClientError>>,
    ) -> Option<T> {
        self.call_as(linked, fut, true).await
    }

    async fn call_as<T>(
        &self,
        linked: &Arc<Linked>,
        fut: impl Future<Output = Result<T, ClientError>>,
        about_prefetch: bool,
    ) -> Option<T> {
        let r = match tokio::time::timeout(self.shared.link.timeout(), fut).await {
            Ok(r) => r,
            Err(_) => Err(ClientError::Protocol("kvtierd call timed out".into())),
        };
        let e = match r {
            Ok(v) => return Some(v),
            Err(e) => e,
        };
        let gone = about_prefetch
            && matches!(&e, ClientError::Status(s) if s.code() == tonic::Code::NotFound);
        if is_link_error(&e) && !gone {
            self.shared.link.broken(linked, &e);
        } else {
            tracing::debug!("kvtierd call failed: {e}");
        }
        None
    }

    async fn do_match(
        &self,
        caller: &Caller,
        req: v1::MatchRequest,
    ) -> Result<v1::MatchResponse, ApiError> {
        let t = Instant::now();
        let page_size = self.page_size(caller)?;
        let tokens = request_tokens(&req.tokens, &req.packed_tokens)?;
        let keys = self.keys(&tokens, req.namespace, page_size)?;
        let (handle, device, selective) = {
            let mut st = lock(&self.shared.state);
            st.engine(caller)?;
            let m = st.tree.match_prefix(&keys);
            st.tree
                .lock(m.device_node)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            let hot = !m.device_values.is_empty()
                && st
                    .tree
                    .view(m.device_node)
                    .is_ok_and(|v| !v.backed_up && self.shared.policy.on_hit(v.meta.hits));
            let h = st.handle_ids.next();
            st.handles.insert(
                h,
                Handle {
                    node: m.device_node,
                    keys: keys.clone(),
                    device: m.device_values.clone(),
                    prefetch: None,
                },
            );
            (h, m.device_values, hot.then_some(m.device_node))
        };
        if let Some(node) = selective {
            self.enqueue_backup(node).await;
        }
        let dev = device.len();
        let (mut l2, mut l3) = (0, 0);
        if dev < keys.len()
            && let Some(linked) = self.shared.link.current()
        {
            let mut c = linked.client.clone();
            if let Some((a, b)) = self
                .call(&linked, c.lookup_tiers(linked.session, &keys[dev..], true))
                .await
            {
                (l2, l3) = (a, b);
            }
        }
        self.shared.metrics.count_match(keys.len(), dev, l2, l3, t);
        Ok(v1::MatchResponse {
            handle,
            device_pages: device,
            l2_pages: l2 as u32,
            l3_pages: l3 as u32,
            total_pages: keys.len() as u32,
        })
    }

    async fn load_back(
        &self,
        caller: &Caller,
        req: v1::LoadBackRequest,
    ) -> Result<v1::LoadBackResponse, ApiError> {
        let t = Instant::now();
        let (keys, dev, prefetch, device, page_bytes) = {
            let mut st = lock(&self.shared.state);
            Self::check_pages(&st, caller, "free_pages", &req.free_pages, true)?;
            let e = st.engine(caller)?;
            let (device, page_bytes) = (e.device.clone(), e.pool.layout().page_bytes());
            let h = st.handles.get_mut(&req.handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{} is unknown or released", req.handle))
            })?;
            (
                h.keys.clone(),
                h.device.len(),
                h.prefetch.take(),
                device,
                page_bytes,
            )
        };
        let unchanged = |dev_pages: Vec<u32>| v1::LoadBackResponse {
            loaded: 0,
            device_pages: dev_pages,
            unused_pages: req.free_pages.clone(),
        };
        let current = || {
            lock(&self.shared.state)
                .handles
                .get(&req.handle)
                .map(|h| h.device.clone())
                .unwrap_or_default()
        };
        let want = (keys.len() - dev).min(req.free_pages.len());
        let Some(linked) = self.shared.link.current() else {
            return Ok(unchanged(current()));
        };
        if want == 0 {
            if let Some(id) = prefetch {
                let mut c = linked.client.clone();
                self.call_prefetch(&linked, c.release_prefetch(linked.session, &id))
                    .await;
            }
            return Ok(unchanged(current()));
        }
        // Pin the pages in L2: through the prefetch when one is open (it waits per its
        // policy and pins what landed), else directly.
        let mut c = linked.client.clone();
        let mut slots = match &prefetch {
            Some(id) => self
                .call_prefetch(&linked, c.take_prefetch(linked.session, id))
                .await
                .map(|(_, s)| s)
                .unwrap_or_default(),
            None => Vec::new(),
        };
        // kvtierd is a peer: never trust it to answer for more keys than were asked about.
        slots.truncate(keys.len() - dev);
        if slots.is_empty() {
            slots = self
                .call(&linked, c.acquire(linked.session, &keys[dev..dev + want]))
                .await
                .unwrap_or_default();
        }
        let pinned = keys[dev..dev + slots.len()].to_vec();
        let n = slots.len().min(want);
        let copies: Vec<PageCopy> = req.free_pages[..n]
            .iter()
            .zip(&slots)
            .map(|(&p, &s)| PageCopy {
                device_page: p,
                host_slot: s,
            })
            .collect();
        let pool = linked.pool.clone();
        let copied = if n == 0 {
            Ok(())
        } else {
            let device = device.clone();
            match tokio::task::spawn_blocking(move || device.copy_from_host(&pool, &copies)).await {
                Ok(r) => r,
                Err(e) => Err(DeviceError::Copy(format!("copy task failed: {e}"))),
            }
        };
        // A read counts only if its pins were still held when it ended.
        let released = pinned.is_empty()
            || self
                .call(&linked, c.release(linked.session, &pinned))
                .await
                .is_some();
        if let Err(e) = &copied {
            tracing::warn!("load-back copy failed, computing instead: {e}");
        }
        if copied.is_err() || !released || n == 0 {
            return Ok(unchanged(current()));
        }
        let mut st = lock(&self.shared.state);
        let Some(h) = st.handles.get(&req.handle) else {
            // Released meanwhile: nothing to attach the pages to.
            return Ok(unchanged(Vec::new()));
        };
        let old = h.node;
        let mut values = h.device.clone();
        values.extend_from_slice(&req.free_pages[..n]);
        let ins = st
            .tree
            .insert(&keys[..dev + n], &values)
            .map_err(|e| ApiError::Internal(e.to_string()))?;
        // Pages another request loaded meanwhile: ours are duplicates, handed back.
        let dup_end = ins.already_on_device.max(dev).min(dev + n);
        let mut unused: Vec<u32> = req.free_pages[..dup_end - dev].to_vec();
        for &p in &req.free_pages[dup_end - dev..n] {
            st.in_tree[p as usize] = true;
        }
        unused.extend_from_slice(&req.free_pages[n..]);
        // They came from L2: the host tier has them.
        let _ = st.tree.mark_backed_up(ins.node);
        let _ = st.tree.lock(ins.node);
        let _ = st.tree.unlock(old);
        let device_pages = st.tree.peek_device_values(&keys[..dev + n]);
        if let Some(h) = st.handles.get_mut(&req.handle) {
            h.node = ins.node;
            h.device = device_pages.clone();
        }
        drop(st);
        let loaded = (dev + n - dup_end) as u64;
        let m = &self.shared.metrics;
        m.load_back_pages.inc_by(loaded);
        m.load_back_bytes.inc_by(loaded * page_bytes as u64);
        m.inserted_pages.inc_by(loaded);
        m.load_back_seconds.observe(t.elapsed().as_secs_f64());
        Ok(v1::LoadBackResponse {
            loaded: loaded as u32,
            device_pages,
            unused_pages: unused,
        })
    }

    async fn insert(
        &self,
        caller: &Caller,
        req: v1::InsertRequest,
    ) -> Result<v1::InsertResponse, ApiError> {
        let page_size = self.page_size(caller)?;
        let tokens = request_tokens(&req.tokens, &req.packed_tokens)?;
        let keys = self.keys(&tokens, req.namespace, page_size)?;
        if req.device_pages.len() != keys.len() {
            return Err(ApiError::invalid(
                "device_pages",
                format!(
                    "{} pages for {} full pages of tokens ({} tokens, page size {page_size}); \
                     give one device page per full page",
                    req.device_pages.len(),
                    keys.len(),
                    tokens.len()
                ),
            ));
        }
        let (ins, tree_pages) = {
            let mut st = lock(&self.shared.state);
            Self::check_pages(&st, caller, "device_pages", &req.device_pages, false)?;
            let tree_pages = st.tree.peek_device_values(&keys);
            let known = tree_pages.len();
            for (i, &p) in req.device_pages.iter().enumerate().skip(known) {
                if st.in_tree[p as usize] {
                    return Err(ApiError::invalid(
                        format!("device_pages[{i}]"),
                        format!("page {p} already holds another cached page"),
                    ));
                }
            }
            let ins = st
                .tree
                .insert(&keys, &req.device_pages)
                .map_err(|e| ApiError::Internal(e.to_string()))?;
            for &p in &req.device_pages[ins.already_on_device..] {
                st.in_tree[p as usize] = true;
            }
            (ins, tree_pages)
        };
        let dup = ins.already_on_device;
        // The engine's own copies of pages the tree already holds; pages it passed that are
        // the tree's (its matched prefix) are not duplicates.
        let duplicate_pages: Vec<u32> = req.device_pages[..dup]
            .iter()
            .zip(&tree_pages)
            .filter(|(mine, tree)| mine != tree)
            .map(|(&mine, _)| mine)
            .collect();
        let inserted = keys.len() - dup;
        self.shared.metrics.inserted_pages.inc_by(inserted as u64);
        if self.shared.policy.on_store() && inserted > 0 {
            self.enqueue_backup(ins.node).await;
        }
        Ok(v1::InsertResponse {
            duplicate_pages,
            inserted: inserted as u32,
        })
    }

    async fn release(&self, caller: &Caller, handle: u64) -> Result<(), ApiError> {
        let h = {
            let mut st = lock(&self.shared.state);
            st.engine(caller)?;
            let h = st.handles.remove(&handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{handle} is unknown or already released"))
            })?;
            let _ = st.tree.unlock(h.node);
            h
        };
        if let Some(id) = h.prefetch
            && let Some(linked) = self.shared.link.current()
        {
            let mut c = linked.client.clone();
            self.call_prefetch(&linked, c.release_prefetch(linked.session, &id))
                .await;
        }
        Ok(())
    }

    fn stats(&self) -> v1::AgentStatsResponse {
        let s = &self.shared;
        let st = lock(&s.state);
        let c = &s.counters;
        let (lost_pages, lost_by_reason) = c.lost();
        v1::AgentStatsResponse {
            pool_registered: st.engine.is_some(),
            daemon_connected: s.link.current().is_some(),
            write_policy: s.policy.name().to_string(),
            device_pages: st.tree.device_pages() as u32,
            evictable_pages: st.tree.evictable_pages() as u32,
            locked_pages: st.tree.protected_pages() as u32,
            host_only_pages: st.tree.host_only_pages() as u32,
            open_handles: st.handles.len() as u32,
            backed_up_pages: c.backed_up.load(Ordering::Relaxed),
            lost_pages,
            backups_in_flight: c.in_flight.load(Ordering::Relaxed),
            metrics_address: s.metrics_address.clone(),
            lost_by_reason,
            backup_waits: c.waits.load(Ordering::Relaxed),
            backup_wait_seconds: c.wait_seconds(),
            backups_deferred: c.deferred.load(Ordering::Relaxed),
        }
    }

    async fn prefetch(
        &self,
        caller: &Caller,
        req: v1::AgentPrefetchRequest,
    ) -> Result<ProgressStream, ApiError> {
        let policy = v1::PrefetchPolicy::try_from(req.policy).map_err(|_| {
            ApiError::invalid(
                "policy",
                format!("{} is not a PrefetchPolicy value", req.policy),
            )
        })?;
        let (keys, dev) = {
            let st = lock(&self.shared.state);
            st.engine(caller)?;
            let h = st.handles.get(&req.handle).ok_or_else(|| {
                ApiError::invalid("handle", format!("{} is unknown or released", req.handle))
            })?;
            if h.prefetch.is_some() {
                return Err(ApiError::invalid(
                    "handle",
                    "a prefetch is already open for it",
                ));
            }
            (h.keys.clone(), h.device.len())
        };
        let linked = self.shared.link.current().ok_or_else(|| {
            ApiError::Unavailable("kvtierd is not connected; nothing to prefetch from".into())
        })?;
        let id = format!("h{}", req.handle);
        let opts = PrefetchOptions {
            parent: dev.checked_sub(1).map(|i| keys[i]),
            policy,
            hints: req.hints.unwrap_or_default(),
        };
        let mut c = linked.client.clone();
        let stream = match c.prefetch(linked.session, &id, &keys[dev..], opts).await {
            Ok(s) => s,
            Err(e) => {
                if is_link_error(&e) {
                    self.shared.link.broken(&linked, &e);
                }
                return Err(match e {
                    ClientError::Status(s) => ApiError::FailedPrecondition(format!(
                        "kvtierd refused the prefetch: {}",
                        s.message()
                    )),
                    e => ApiError::Unavailable(e.to_string()),
                });
            }
        };
        if let Some(h) = lock(&self.shared.state).handles.get_mut(&req.handle) {
            h.prefetch = Some(id);
        }
        Ok(Box::pin(stream.map(|r| {
            r.map_err(|s| Status::new(s.code(), s.message().to_string()))
        })))
    }
}

/// The stream Prefetch returns.
pub type ProgressStream = Pin<Box<dyn Stream<Item = Result<v1::PrefetchProgress, Status>> + Send>>;

fn to_status<T>(r: Result<T, ApiError>) -> Result<Response<T>, Status> {
    r.map(Response::new).map_err(Status::from)
}

#[tonic::async_trait]
impl agent_server::Agent for AgentService {
    async fn register_pool(
        &self,
        request: Request<v1::RegisterPoolRequest>,
    ) -> Result<Response<v1::RegisterPoolResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(self.register_pool(caller, request.into_inner()).await)
    }

    async fn r#match(
        &self,
        request: Request<v1::MatchRequest>,
    ) -> Result<Response<v1::MatchResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(self.do_match(&caller, request.into_inner()).await)
    }

    async fn match_batch(
        &self,
        request: Request<v1::MatchBatchRequest>,
    ) -> Result<Response<v1::MatchBatchResponse>, Status> {
        let caller = Caller::of(&request)?;
        let mut responses = Vec::new();
        for (i, r) in request.into_inner().requests.into_iter().enumerate() {
            responses.push(
                self.do_match(&caller, r)
                    .await
                    .map_err(|e| Status::from(e.within(&format!("requests[{i}]"))))?,
            );
        }
        Ok(Response::new(v1::MatchBatchResponse { responses }))
    }

    async fn load_back(
        &self,
        request: Request<v1::LoadBackRequest>,
    ) -> Result<Response<v1::LoadBackResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(self.load_back(&caller, request.into_inner()).await)
    }

    type PrefetchStream = ProgressStream;

    async fn prefetch(
        &self,
        request: Request<v1::AgentPrefetchRequest>,
    ) -> Result<Response<Self::PrefetchStream>, Status> {
        let caller = Caller::of(&request)?;
        to_status(AgentService::prefetch(self, &caller, request.into_inner()).await)
    }

    async fn insert(
        &self,
        request: Request<v1::InsertRequest>,
    ) -> Result<Response<v1::InsertResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(AgentService::insert(self, &caller, request.into_inner()).await)
    }

    async fn insert_batch(
        &self,
        request: Request<v1::InsertBatchRequest>,
    ) -> Result<Response<v1::InsertBatchResponse>, Status> {
        let caller = Caller::of(&request)?;
        let mut responses = Vec::new();
        for (i, r) in request.into_inner().requests.into_iter().enumerate() {
            responses.push(
                AgentService::insert(self, &caller, r)
                    .await
                    .map_err(|e| Status::from(e.within(&format!("requests[{i}]"))))?,
            );
        }
        Ok(Response::new(v1::InsertBatchResponse { responses }))
    }

    async fn release(
        &self,
        request: Request<v1::AgentReleaseRequest>,
    ) -> Result<Response<v1::AgentReleaseResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(
            AgentService::release(self, &caller, request.into_inner().handle)
                .await
                .map(|()| v1::AgentReleaseResponse {}),
        )
    }

    async fn release_batch(
        &self,
        request: Request<v1::ReleaseBatchRequest>,
    ) -> Result<Response<v1::AgentReleaseResponse>, Status> {
        let caller = Caller::of(&request)?;
        for (i, h) in request.into_inner().handles.into_iter().enumerate() {
            AgentService::release(self, &caller, h)
                .await
                .map_err(|e| Status::from(e.within(&format!("handles[{i}]"))))?;
        }
        Ok(Response::new(v1::AgentReleaseResponse {}))
    }

    async fn evict(
        &self,
        request: Request<v1::EvictRequest>,
    ) -> Result<Response<v1::EvictResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(AgentService::evict(self, &caller, request.into_inner().pages as usize).await)
    }

    async fn agent_stats(
        &self,
        _request: Request<v1::AgentStatsRequest>,
    ) -> Result<Response<v1::AgentStatsResponse>, Status> {
        Ok(Response::new(self.stats()))
    }

    async fn lookup(
        &self,
        request: Request<v1::PagesLookupRequest>,
    ) -> Result<Response<v1::PagesLookupResponse>, Status> {
        // Lookup reads no pool memory: an engine's scheduler process asks it without the
        // owner token its worker holds.
        to_status(self.lookup_pages(request.into_inner()).await)
    }

    async fn load(
        &self,
        request: Request<v1::LoadPagesRequest>,
    ) -> Result<Response<v1::LoadPagesResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(self.load_pages(&caller, request.into_inner()).await)
    }

    async fn save(
        &self,
        request: Request<v1::SavePagesRequest>,
    ) -> Result<Response<v1::SavePagesResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(self.save_pages(&caller, request.into_inner()).await)
    }
}
