//! What the agent's modes and its service share: the registered pool, the state behind one
//! mutex, the kvtierd link, settings, metrics and counters, and the checks every call makes
//! on the pages an engine names.
//!
//! The state sits behind one mutex, held for the few microseconds a tree operation takes and
//! never across an await: copies and daemon calls happen outside it, with the pages they read
//! locked in the tree (so eviction cannot hand them back to the engine mid-copy).

use kvtier_server::tasks::Tasks;
use parking_lot::{Mutex, MutexGuard};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvtier_config::agent::AgentConfig;
use kvtier_core::radix::NodeId;
use kvtier_core::{
    DevicePool, Namespace, PageHasher, PageKey, PolicyKind, RadixTree, TokenIds, WritePolicy,
};
use kvtier_device::Device;
use kvtier_proto::{ApiError, Lost};

use crate::handle_ids::HandleIds;
use crate::link::Link;
use crate::metrics::Metrics;
use crate::outcome::{Counters, LoadFailure, Loss};
use crate::owner::{Caller, Owner};

/// How the registered pool is served, fixed at `RegisterPool`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    /// The agent keeps the prefix tree over the engine's pages (Match, LoadBack, Insert,
    /// Release, Prefetch, Evict): `tree.rs`.
    Tree,
    /// The engine keeps its own prefix cache (Lookup, Load, Save): `engine_cache.rs`.
    EngineCache,
}

impl Mode {
    fn refusal(self) -> ApiError {
        ApiError::FailedPrecondition(match self {
            Mode::Tree => "the pool was registered with engine_cache (the engine keeps its own \
                           prefix cache): use Lookup, Load and Save"
                .into(),
            Mode::EngineCache => "the pool was registered without engine_cache (the agent keeps \
                                  the prefix tree): use Match, LoadBack, Insert and Release"
                .into(),
        })
    }
}

/// The engine's pool as registered.
#[derive(Debug)]
pub(crate) struct Engine {
    pub(crate) device: Arc<dyn Device>,
    pub(crate) pool: DevicePool,
    pub(crate) mode: Mode,
    /// The client that registered it; only it is served.
    pub(crate) owner: Owner,
    /// Open while this registration lasts: background backups of its pages copy and commit
    /// under it, so once the engine registers again (and takes every page back) none of
    /// them reads a page the engine reuses and stores it under an old key.
    pub(crate) fence: kvtier_device::Fence,
}

/// An open request of the tree mode: the tree node whose prefix it locks, its keys and
/// device prefix, and the prefetch opened for it.
#[derive(Debug)]
pub(crate) struct Handle {
    pub(crate) node: NodeId,
    pub(crate) keys: Vec<PageKey>,
    pub(crate) device: Vec<u32>,
    pub(crate) prefetch: Option<String>,
}

/// Everything behind the mutex.
pub(crate) struct State {
    pub(crate) engine: Option<Engine>,
    pub(crate) tree: RadixTree<PageKey, u32>,
    /// Which device pages the tree holds (to refuse an engine handing out one twice).
    pub(crate) in_tree: Vec<bool>,
    pub(crate) handles: HashMap<u64, Handle>,
    pub(crate) handle_ids: HandleIds,
    /// The kvtierd session generation backup marks belong to (see [`Link`]).
    pub(crate) link_generation: u64,
    /// Engine-cache mode: how often each page has been looked up, for
    /// write_through_selective (bounded; see `engine_cache.rs`).
    pub(crate) lookups: HashMap<PageKey, u64>,
}

impl State {
    fn new(eviction: PolicyKind) -> Self {
        Self {
            engine: None,
            tree: RadixTree::new(eviction),
            in_tree: Vec::new(),
            handles: HashMap::new(),
            handle_ids: HandleIds::new(),
            link_generation: 0,
            lookups: HashMap::new(),
        }
    }

    /// The registered pool, whoever registered it (for calls that read no pool memory).
    pub(crate) fn any_registered(&self) -> Result<&Engine, ApiError> {
        self.engine.as_ref().ok_or_else(|| {
            ApiError::Lost(
                Lost::Pool,
                "pool: no KV pool is registered; call RegisterPool first".into(),
            )
        })
    }

    /// The registered pool, if it serves `mode` and `caller` owns it (`None`: a call that
    /// reads no pool memory, which any admitted client may make).
    pub(crate) fn pool(&self, mode: Mode, caller: Option<&Caller>) -> Result<&Engine, ApiError> {
        let e = self.any_registered()?;
        if let Some(c) = caller {
            e.owner.admits(c)?;
        }
        if e.mode != mode {
            return Err(mode.refusal());
        }
        Ok(e)
    }

    /// The registered pool in tree mode, if `caller` owns it.
    pub(crate) fn tree_pool(&self, caller: &Caller) -> Result<&Engine, ApiError> {
        self.pool(Mode::Tree, Some(caller))
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

/// The agent's settings, from its configuration.
pub(crate) struct Settings {
    /// Device → L2 write policy, with its threshold.
    pub(crate) policy: WritePolicy,
    pub(crate) max_tokens: usize,
    /// How long an owner whose process is not visible keeps the pool without a call.
    pub(crate) pool_lease: Duration,
    pub(crate) copy_threads: usize,
    pub(crate) copy_method: kvtier_core::CopyMethod,
    pub(crate) eviction: PolicyKind,
    /// Longest a write waits for room in L2 without progress (and an Evict for backups).
    pub(crate) evict_wait: Duration,
    /// Longest a tree-mode backup waits for kvtierd to come back (`cache.daemon_wait`).
    pub(crate) daemon_wait: Duration,
    /// Pages early backups may have queued or running (`cache.backup_queue`).
    pub(crate) backup_queue_pages: u32,
    /// Early backups running at once; an Evict's backups too.
    pub(crate) backup_concurrency: usize,
    pub(crate) metrics_address: String,
    /// The memory door's path, as AgentStats shows it.
    pub(crate) memory_socket: String,
}

impl Settings {
    pub(crate) fn new(cfg: &AgentConfig, metrics_address: String) -> Self {
        Self {
            policy: cfg.write_policy(),
            max_tokens: cfg.server.max_tokens as usize,
            pool_lease: cfg.server.pool_lease.0,
            copy_threads: cfg.device.copy_threads as usize,
            copy_method: cfg.device.copy_method,
            eviction: cfg.cache.eviction_policy,
            evict_wait: cfg.cache.evict_wait.0,
            daemon_wait: cfg.cache.daemon_wait.0,
            backup_queue_pages: cfg.cache.backup_queue,
            backup_concurrency: cfg.cache.backup_concurrency as usize,
            metrics_address,
            memory_socket: cfg.memory_socket().display().to_string(),
        }
    }
}

/// What the service, its modes and their background tasks share.
pub(crate) struct Shared {
    pub(crate) state: Mutex<State>,
    pub(crate) link: Arc<Link>,
    pub(crate) metrics: Metrics,
    pub(crate) settings: Settings,
    pub(crate) counters: Counters,
    /// Where the agent's tasks run (the drain waits on them).
    pub(crate) tasks: Tasks,
}

impl Shared {
    pub(crate) fn new(settings: Settings, link: Arc<Link>, metrics: Metrics, tasks: Tasks) -> Self {
        Self {
            state: Mutex::new(State::new(settings.eviction)),
            link,
            metrics,
            settings,
            counters: Counters::default(),
            tasks,
        }
    }

    /// The state; a panic elsewhere while it was held does not stop the agent (every
    /// mutation under the lock leaves the tree consistent between its own steps).
    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock()
    }

    pub(crate) fn policy(&self) -> WritePolicy {
        self.settings.policy
    }

    /// The page keys of `tokens` in `ns`, refused past `server.max_tokens`.
    pub(crate) fn keys(
        &self,
        tokens: TokenIds<'_>,
        ns: &Namespace,
        page_size: usize,
    ) -> Result<Vec<PageKey>, ApiError> {
        self.keys_after(None, tokens, ns, page_size)
    }

    /// Keys of the full pages of `tokens`, which follow the page keyed `parent` (`None`:
    /// they start the prompt), checked against the request size limit.
    pub(crate) fn keys_after(
        &self,
        parent: Option<&PageKey>,
        tokens: TokenIds<'_>,
        ns: &Namespace,
        page_size: usize,
    ) -> Result<Vec<PageKey>, ApiError> {
        let max = self.settings.max_tokens;
        if tokens.len() > max {
            return Err(ApiError::invalid(
                "tokens",
                format!(
                    "{} tokens exceed the limit of {max} (server.max_tokens)",
                    tokens.len()
                ),
            ));
        }
        let hasher = PageHasher::new(page_size, ns)?;
        let mut keys = Vec::new();
        hasher.extend_ids(parent, tokens, &mut keys);
        Ok(keys)
    }

    /// Counts a call that waited `t` for backups (or the link), by where.
    pub(crate) fn count_wait(&self, at: &str, t: Duration) {
        self.counters.add_wait(t);
        self.metrics.backup_waits.with_label_values(&[at]).inc();
        self.metrics
            .backup_wait_seconds
            .with_label_values(&[at])
            .observe(t.as_secs_f64());
    }

    /// Counts a background backup's wait for kvtierd to come back (`at="daemon"`): not a
    /// call's wait (those count where the engine waits on the backup, at Insert or Evict).
    pub(crate) fn count_daemon_wait(&self, t: Duration) {
        self.metrics
            .backup_waits
            .with_label_values(&["daemon"])
            .inc();
        self.metrics
            .backup_wait_seconds
            .with_label_values(&["daemon"])
            .observe(t.as_secs_f64());
    }

    /// Counts `pages` of backups (early, at eviction, or Save) that ended as `outcome`.
    pub(crate) fn count_backup(&self, outcome: &str, pages: usize) {
        if pages == 0 {
            return;
        }
        self.metrics
            .backup_pages
            .with_label_values(&[self.policy().name(), outcome])
            .inc_by(pages as u64);
        if matches!(outcome, "stored" | "present") {
            self.counters
                .backed_up
                .fetch_add(pages as u64, Ordering::Relaxed);
        }
    }

    /// Counts `pages` that left the device without a copy in L2.
    pub(crate) fn count_lost(&self, why: Loss, pages: u64) {
        if pages == 0 {
            return;
        }
        self.counters.add_lost(why, pages);
        self.metrics
            .lost_pages
            .with_label_values(&[why.label()])
            .inc_by(pages);
    }

    /// Counts `pages` a Load was asked for and did not load.
    pub(crate) fn count_load_failed(&self, why: LoadFailure, pages: usize) {
        if pages > 0 {
            self.metrics
                .load_failed_pages
                .with_label_values(&[why.label()])
                .inc_by(pages as u64);
        }
    }

    /// Counts `pages` loaded from L2 into the device in one call that started at `t`.
    pub(crate) fn count_loaded(&self, pages: usize, page_bytes: usize, t: std::time::Instant) {
        let m = &self.metrics;
        m.load_back_pages.inc_by(pages as u64);
        m.load_back_bytes.inc_by((pages * page_bytes) as u64);
        m.load_back_seconds.observe(t.elapsed().as_secs_f64());
    }
}
