//! The `kvtier.v1.Agent` service: the gRPC edge. Each call is checked and turned into domain
//! terms here (tokens, namespaces, page keys), handed to the mode the pool was registered in
//! ([`TreeMode`] or [`CacheMode`], fixed at `RegisterPool`; a call of the other mode is
//! refused by name), and its domain answer turned back into the wire's. Registration, the
//! counters (AgentStats, the heartbeat report, gauges) and the reaction to a new kvtierd
//! session live here too: they span both modes.

use kvtier_server::tasks::Tasks;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kvtier_config::agent::AgentConfig;
use kvtier_core::{DevicePool, Layout, Namespace, PageKey, RadixTree, TokenIds};
use kvtier_device::Fence;
use kvtier_proto::ApiError;
use kvtier_proto::v1::{self, agent_server};
use kvtier_shm::ShmPool;
use tonic::{Request, Response, Status};

use crate::backup::BackupWorker;
use crate::call_fence;
use crate::engine_cache::{CacheMode, Pages};
use crate::engine_memory::Opener;
use crate::l2::L2;
use crate::link::{Link, Linked};
use crate::memory_door::Deposits;
use crate::metrics::Metrics;
use crate::owner::{Caller, Owner};
use crate::shared::{Engine, Mode, Settings, Shared};
use crate::tree::{Progress, TreeMode};

/// Most Saves one SaveBatch carries (an engine step's requests; vLLM runs at most a few
/// thousand at once).
const MAX_SAVE_BATCH: usize = 4096;

/// A request's tokens from whichever field carries them: `tokens`, or `packed_tokens`
/// (little-endian u32s, hashed as they are). Both set, or a packed length that is not a
/// multiple of 4, is refused.
fn request_tokens<'a>(tokens: &'a [u32], packed: &'a [u8]) -> Result<TokenIds<'a>, ApiError> {
    if packed.is_empty() {
        return Ok(TokenIds::U32(tokens));
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
    Ok(TokenIds::Le(packed))
}

fn namespace(ns: Option<v1::Namespace>) -> Result<Namespace, ApiError> {
    Namespace::try_from(ns.unwrap_or_default()).map_err(|e| e.within("namespace"))
}

fn prefetch_policy(p: i32) -> Result<v1::PrefetchPolicy, ApiError> {
    v1::PrefetchPolicy::try_from(p)
        .map_err(|_| ApiError::invalid("policy", format!("{p} is not a PrefetchPolicy value")))
}

fn to_status<T, D: Into<T>>(r: Result<D, ApiError>) -> Result<Response<T>, Status> {
    r.map(|d| Response::new(d.into())).map_err(Status::from)
}

/// The `kvtier.v1.Agent` service.
#[derive(Clone)]
pub(crate) struct AgentService {
    s: Arc<Shared>,
    tree: Arc<TreeMode>,
    cache: Arc<CacheMode>,
    /// The calls in flight that a Cancel may name.
    calls: Arc<call_fence::Calls>,
    /// Engine memory deposited at the memory door, waiting for its RegisterPool.
    deposits: Arc<Deposits>,
}

impl AgentService {
    /// A service configured by `cfg`, over `link`; run its backups with
    /// [`Self::run_backups`].
    pub(crate) fn new(
        cfg: &AgentConfig,
        link: Arc<Link>,
        metrics: Metrics,
        metrics_address: String,
        deposits: Arc<Deposits>,
        tasks: Tasks,
    ) -> (Self, BackupWorker) {
        let s = Arc::new(Shared::new(
            Settings::new(cfg, metrics_address),
            link,
            metrics,
            tasks,
        ));
        let l2 = L2::new(s.clone());
        let (tree, worker) = TreeMode::new(s.clone(), l2.clone());
        let cache = CacheMode::new(s.clone(), l2);
        (
            Self {
                s,
                tree: Arc::new(tree),
                cache: Arc::new(cache),
                calls: Arc::default(),
                deposits,
            },
            worker,
        )
    }

    /// The early-backup workers; run until the agent's shutdown.
    pub(crate) fn run_backups(
        &self,
        worker: BackupWorker,
    ) -> impl Future<Output = ()> + Send + 'static {
        self.tree.backups().run(worker)
    }

    /// A new kvtierd session: what the tree believed L2 held may be gone (a restarted
    /// kvtierd), so every mark is cleared and each page is backed up again (or found in L2)
    /// before its eviction. Runs before the session is used.
    /// Attaches kvtierd's pool to the registered device (the cuda device registers it with
    /// the driver) on a blocking thread; copies that come meanwhile wait for it. `None`
    /// without a registered engine.
    fn attach(&self, pool: Arc<ShmPool>) -> Option<tokio::task::JoinHandle<()>> {
        let device = self.s.lock().engine.as_ref().map(|e| e.device.clone())?;
        let metrics = self.s.metrics.clone();
        Some(tokio::task::spawn_blocking(move || {
            match device.attach_host(&pool) {
                Ok(a) if a.registered => {
                    metrics.host_register_seconds.observe(a.took.as_secs_f64());
                    tracing::info!(
                        bytes = pool.len(),
                        seconds = a.took.as_secs_f64(),
                        "host pool registered with the GPU driver"
                    );
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!("host pool not attached; copies will fail until it is: {e}")
                }
            }
        }))
    }

    pub(crate) fn relinked(&self, linked: &Linked) {
        let generation = linked.generation;
        // Copies on the new session's pool wait for this rather than run unregistered.
        let _ = self.attach(linked.pool.clone());
        let s = &self.s;
        let mut st = s.lock();
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
    pub(crate) fn report(&self) -> v1::ClientReport {
        let s = &self.s;
        let m = &s.metrics;
        let tier = |t: &str| m.match_pages.with_label_values(&[t]).get();
        let st = s.lock();
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
    pub(crate) fn refresh_gauges(&self) {
        let s = &self.s;
        let st = s.lock();
        let m = &s.metrics;
        m.device_pages.set(st.tree.device_pages() as i64);
        m.locked_pages.set(st.tree.protected_pages() as i64);
        m.open_handles.set(st.handles.len() as i64);
        m.daemon_connected
            .set(i64::from(s.link.current().is_some()));
    }

    fn stats(&self) -> v1::AgentStatsResponse {
        let s = &self.s;
        let st = s.lock();
        let c = &s.counters;
        let (lost_pages, by) = c.lost();
        v1::AgentStatsResponse {
            pool_registered: st.engine.is_some(),
            daemon_connected: s.link.current().is_some(),
            write_policy: s.policy().name().to_string(),
            device_pages: st.tree.device_pages() as u32,
            evictable_pages: st.tree.evictable_pages() as u32,
            locked_pages: st.tree.protected_pages() as u32,
            host_only_pages: st.tree.host_only_pages() as u32,
            open_handles: st.handles.len() as u32,
            backed_up_pages: c.backed_up.load(Ordering::Relaxed),
            lost_pages,
            backups_in_flight: c.in_flight.load(Ordering::Relaxed),
            metrics_address: s.settings.metrics_address.clone(),
            memory_socket: s.settings.memory_socket.clone(),
            lost_by_reason: by
                .into_iter()
                .map(|(l, pages)| v1::LostPages {
                    reason: l.label().to_string(),
                    pages,
                })
                .collect(),
            backup_waits: c.waits.load(Ordering::Relaxed),
            backup_wait_seconds: c.wait_seconds(),
            backups_deferred: c.deferred.load(Ordering::Relaxed),
        }
    }

    async fn register_pool(
        &self,
        caller: Caller,
        req: v1::RegisterPoolRequest,
    ) -> Result<v1::RegisterPoolResponse, ApiError> {
        let s = &self.s;
        // Refused early (before opening the caller's memory) when another client owns the
        // pool; checked again below, under the lock, where it counts.
        if let Some(e) = &s.lock().engine {
            e.owner.yields_to(&caller, s.settings.pool_lease)?;
        }
        let spec_wire = req
            .layout
            .ok_or_else(|| ApiError::invalid("layout", "required"))?;
        let layout = Layout::try_from(spec_wire).map_err(|e| e.within("layout"))?;
        let pool = DevicePool::new(layout.clone(), req.num_token_slots)
            .map_err(|e| ApiError::invalid("num_token_slots", e.to_string()))?;
        let device = Opener {
            deposits: &self.deposits,
            caller_uid: caller.peer.map(|p| p.uid),
            copy_threads: s.settings.copy_threads,
            copy_method: s.settings.copy_method,
            l2_file: s.link.current().and_then(|l| l.pool.file_id().ok()),
            metrics: &s.metrics,
        }
        .open(&pool, req.device)?;
        let mode = if req.engine_cache {
            Mode::EngineCache
        } else {
            Mode::Tree
        };
        if mode == Mode::EngineCache && !s.policy().copies_while_held() {
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
            let mut st = s.lock();
            if let Some(e) = &st.engine {
                e.owner.yields_to(&caller, s.settings.pool_lease)?;
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
            // Every page is the engine's again: backups of the old registration's pages stop
            // before their next copy part, and commit nothing.
            if let Some(old) = &st.engine {
                old.fence.close();
            }
            st.engine = Some(Engine {
                device,
                pool,
                mode,
                owner,
                fence: kvtier_device::Fence::until(None),
            });
            st.tree = RadixTree::new(s.settings.eviction);
            st.in_tree = vec![false; num_pages];
            st.handles.clear();
        }
        s.link.want(layout.spec().clone());
        tracing::info!(model = %layout.spec().model_id, fingerprint = %layout.fingerprint(), num_pages, ?mode, pid = ?caller.peer.and_then(|p| p.pid), "engine pool registered");
        // The engine starts saving as soon as this returns: give the kvtierd session the
        // link's deadline to come up first, so the first pages computed are not refused for
        // want of it (a daemon that does not answer in time costs that wait once; saves
        // after it still wait up to cache.evict_wait for the link).
        let linked = s.link.current_or_wait(s.link.timeout()).await;
        if let Some(l) = &linked {
            // Ready means ready: the host pool is registered before the engine hears back,
            // so its first copy does not pay for it.
            if let Some(attach) = self.attach(l.pool.clone()) {
                let _ = attach.await;
            }
        }
        Ok(v1::RegisterPoolResponse {
            layout: Some(v1::LayoutInfo::from(&layout)),
            num_pages: num_pages as u32,
            daemon_connected: linked.is_some(),
            owner: token.to_hex(),
        })
    }

    /// The page keys of a tree-mode request's prompt.
    fn tree_keys(
        &self,
        caller: &Caller,
        tokens: &[u32],
        packed: &[u8],
        ns: Option<v1::Namespace>,
    ) -> Result<(Vec<PageKey>, usize, usize), ApiError> {
        let page_size = self.tree.page_size(caller)?;
        let tokens = request_tokens(tokens, packed)?;
        let keys = self.s.keys(tokens, &namespace(ns)?, page_size)?;
        Ok((keys, tokens.len(), page_size))
    }

    async fn do_match(
        &self,
        caller: &Caller,
        req: v1::MatchRequest,
    ) -> Result<v1::MatchResponse, ApiError> {
        let t = Instant::now();
        let (keys, _, _) =
            self.tree_keys(caller, &req.tokens, &req.packed_tokens, req.namespace)?;
        Ok(self.tree.match_prefix(caller, keys, t).await?.into())
    }

    async fn insert(
        &self,
        caller: &Caller,
        req: v1::InsertRequest,
    ) -> Result<v1::InsertResponse, ApiError> {
        let (keys, tokens, page_size) =
            self.tree_keys(caller, &req.tokens, &req.packed_tokens, req.namespace)?;
        if req.device_pages.len() != keys.len() {
            return Err(ApiError::invalid(
                "device_pages",
                format!(
                    "{} pages for {} full pages of tokens ({tokens} tokens, page size \
                     {page_size}); give one device page per full page",
                    req.device_pages.len(),
                    keys.len(),
                ),
            ));
        }
        Ok(self
            .tree
            .insert(caller, &keys, &req.device_pages)
            .await?
            .into())
    }

    async fn prefetch(
        &self,
        caller: &Caller,
        req: v1::AgentPrefetchRequest,
    ) -> Result<Progress, ApiError> {
        let policy = prefetch_policy(req.policy)?;
        self.tree
            .prefetch(caller, req.handle, policy, req.hints.unwrap_or_default())
            .await
    }
}

/// Runs a call that copies pages the engine lends on a task of its own, under `fence`
/// (see [`call_fence`]): when the call's future is dropped (its client left), the fence
/// closes and the task still runs to its end, so the failure path of a fenced copy unpins
/// and aborts what it held in kvtierd. A call that names itself is in `calls` (a Cancel can
/// close its fence) until its task ends.
async fn fenced_call<T, F, Fut>(
    tasks: &Tasks,
    calls: Result<call_fence::Registered, ApiError>,
    fence: Fence,
    call: F,
) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce(Fence) -> Fut,
    Fut: Future<Output = Result<T, ApiError>> + Send + 'static,
{
    let registered = calls?;
    let _closes = fence.close_on_drop();
    let run = call(fence.clone());
    tasks
        .spawn(async move {
            let _registered = registered;
            run.await
        })
        .await
        .unwrap_or_else(|e| Err(ApiError::Internal(format!("call task failed: {e}"))))
}

/// A Save's pages, from its request and the tokens decoded from it.
fn save_pages<'a>(
    req: &'a v1::SavePagesRequest,
    tokens: TokenIds<'a>,
) -> Result<Pages<'a>, ApiError> {
    pages(
        tokens,
        &req.parent_key,
        req.namespace.clone(),
        req.start_page,
        &req.device_pages,
    )
}

fn pages<'a>(
    tokens: TokenIds<'a>,
    parent_key: &[u8],
    ns: Option<v1::Namespace>,
    start: u32,
    device_pages: &'a [u32],
) -> Result<Pages<'a>, ApiError> {
    let parent = if parent_key.is_empty() {
        None
    } else {
        Some(PageKey::from_slice("parent_key", parent_key)?)
    };
    Ok(Pages {
        tokens,
        parent,
        namespace: namespace(ns)?,
        start,
        device_pages,
    })
}

#[tonic::async_trait]
impl agent_server::Agent for AgentService {
    async fn register_pool(
        &self,
        request: Request<v1::RegisterPoolRequest>,
    ) -> Result<Response<v1::RegisterPoolResponse>, Status> {
        let caller = Caller::of(&request)?;
        to_status(AgentService::register_pool(self, caller, request.into_inner()).await)
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
        let fence = call_fence::of(&request);
        // Not cancellable: the pages it fills join the agent's tree as it commits, so a
        // Cancel could not hand them back.
        let calls = call_fence::not_cancellable(&request, &self.calls);
        let req = request.into_inner();
        let tree = self.tree.clone();
        to_status(
            fenced_call(&self.s.tasks, calls, fence, move |fence| async move {
                tree.load_back(&caller, req.handle, req.free_pages, &fence)
                    .await
            })
            .await,
        )
    }

    type PrefetchStream = Progress;

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
        let handle = request.into_inner().handle;
        to_status(
            self.tree
                .release(&caller, handle)
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
            self.tree
                .release(&caller, h)
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
        let n = request.into_inner().pages as usize;
        to_status(self.tree.evict(&caller, n).await)
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
        let req = request.into_inner();
        let r = async {
            let tokens = request_tokens(&[], &req.packed_tokens)?;
            let p = pages(tokens, &req.parent_key, req.namespace, req.start_page, &[])?;
            self.cache.lookup(&p, req.want_keys).await
        };
        to_status(r.await)
    }

    async fn load(
        &self,
        request: Request<v1::LoadPagesRequest>,
    ) -> Result<Response<v1::LoadPagesResponse>, Status> {
        let caller = Caller::of(&request)?;
        let fence = call_fence::of(&request);
        let calls = self.calls.register(&request, &caller, &fence);
        let req = request.into_inner();
        let cache = self.cache.clone();
        let r = fenced_call(&self.s.tasks, calls, fence, move |fence| async move {
            let policy = prefetch_policy(req.policy)?;
            let tokens = request_tokens(&[], &req.packed_tokens)?;
            let p = pages(
                tokens,
                &req.parent_key,
                req.namespace,
                req.start_page,
                &req.device_pages,
            )?;
            let l = cache.load(&caller, &p, policy, req.hints, &fence).await?;
            Ok(v1::LoadPagesResponse {
                loaded: l.pages,
                last_key: l
                    .last_key
                    .map(|k| k.as_bytes().to_vec())
                    .unwrap_or_default(),
            })
        });
        to_status::<v1::LoadPagesResponse, _>(r.await)
    }

    async fn save(
        &self,
        request: Request<v1::SavePagesRequest>,
    ) -> Result<Response<v1::SavePagesResponse>, Status> {
        let caller = Caller::of(&request)?;
        let fence = call_fence::of(&request);
        let calls = self.calls.register(&request, &caller, &fence);
        let req = request.into_inner();
        let cache = self.cache.clone();
        let r = fenced_call(&self.s.tasks, calls, fence, move |fence| async move {
            let tokens = request_tokens(&[], &req.packed_tokens)?;
            let p = save_pages(&req, tokens)?;
            cache.save(&caller, &p, req.selected, &fence).await
        });
        to_status(r.await)
    }

    async fn save_batch(
        &self,
        request: Request<v1::SaveBatchRequest>,
    ) -> Result<Response<v1::SaveBatchResponse>, Status> {
        let caller = Caller::of(&request)?;
        let fence = call_fence::of(&request);
        let calls = self.calls.register(&request, &caller, &fence);
        let reqs = request.into_inner().requests;
        let cache = self.cache.clone();
        let r = fenced_call(&self.s.tasks, calls, fence, move |fence| async move {
            if reqs.len() > MAX_SAVE_BATCH {
                return Err(ApiError::invalid(
                    "requests",
                    format!(
                        "{} Saves in one call; at most {MAX_SAVE_BATCH} (send the rest in \
                         another SaveBatch)",
                        reqs.len()
                    ),
                ));
            }
            let tokens = reqs
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    request_tokens(&[], &r.packed_tokens)
                        .map_err(|e| e.within(&format!("requests[{i}]")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let pages = reqs
                .iter()
                .zip(&tokens)
                .enumerate()
                .map(|(i, (r, t))| {
                    save_pages(r, *t)
                        .map(|p| (p, r.selected))
                        .map_err(|e| e.within(&format!("requests[{i}]")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let saved = cache.save_batch(&caller, &pages, &fence).await?;
            Ok(v1::SaveBatchResponse {
                responses: saved.into_iter().map(Into::into).collect(),
            })
        });
        to_status::<v1::SaveBatchResponse, _>(r.await)
    }

    async fn cancel(
        &self,
        request: Request<v1::CancelRequest>,
    ) -> Result<Response<v1::CancelResponse>, Status> {
        let caller = Caller::of(&request)?;
        let ids = request.into_inner().call_ids;
        let calls = self.calls.clone();
        let s = self.s.clone();
        let r = async move {
            // Only the registered pool's owner: a token of an earlier registration (a
            // client that registered again meanwhile) names calls that may have been
            // retried under the new one, which this Cancel would not stop.
            s.lock().any_registered()?.owner.admits(&caller)?;
            let fences = calls.cancel(&caller, &ids)?;
            let cancelled = fences.len() as u32;
            // Every fence closed first, then the parts moving under them waited for, on a
            // blocking thread (a part is a memcpy or a GPU stream's transfers, never an
            // await).
            for f in &fences {
                f.close();
            }
            let settled = tokio::task::spawn_blocking(move || {
                let until = std::time::Instant::now() + call_fence::SETTLE;
                fences.iter().all(|f| {
                    f.close_and_settle(until.saturating_duration_since(std::time::Instant::now()))
                })
            })
            .await
            .map_err(|e| ApiError::Internal(format!("cancel task failed: {e}")))?;
            if !settled {
                return Err(ApiError::Unavailable(format!(
                    "a cancelled call's copy did not stop within {:?}; its pages are not free \
                     until the call answers",
                    call_fence::SETTLE
                )));
            }
            Ok(v1::CancelResponse { cancelled })
        };
        to_status(r.await)
    }
}
