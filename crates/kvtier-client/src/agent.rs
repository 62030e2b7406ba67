//! [`AgentClient`]: the engine's side of `kvtier.v1.Agent`, in domain terms.
//!
//! An engine registers its device KV pool once, then per request: matches its prompt (the
//! agent locks the cached device prefix under a handle), optionally prefetches L3 pages into
//! L2, loads L2 pages back into free device pages it lends, inserts what it computed, and
//! releases the handle. When it runs short of device pages it asks the agent to evict.

mod messages;

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvtier_core::{LayoutSpec, Namespace};
use kvtier_proto::v1;
use kvtier_proto::v1::agent_client::AgentClient as RawAgentClient;
use tonic::transport::Channel;

use crate::{ClientError, connect};
pub use messages::{
    Evicted, Handle, Insert, Inserted, Loaded, Match, PagesLookup, PoolInfo, PoolMemory,
    PromptTokens, SaveRequest, Saved,
};
use messages::{insert_request, inserted, match_request};

/// The metadata header that carries the pool's owner token (see `RegisterPoolResponse`).
pub const OWNER_HEADER: &str = "kvtier-pool-owner";

/// The metadata header with the wall-clock time (Unix nanoseconds) at which the client gives
/// up on a call. gRPC's own `grpc-timeout` is relative to when the server reads the request,
/// so a call that waited in a stopped or busy agent's socket looks fresh; this one does not.
/// The agent stops the call's page copies before the earlier of the two.
pub const DEADLINE_HEADER: &str = "kvtier-deadline-unix-ns";

/// The metadata header with a call's id, chosen by the client (1 to 64 printable ASCII
/// characters, unique among its calls in flight): [`AgentClient::cancel`] names it to stop
/// the call's page copies before its deadline.
pub const CALL_ID_HEADER: &str = "kvtier-call-id";

/// A client of a kvtier-agent. After a registration it presents the owner token the agent
/// returned on every call (clones made afterwards too).
#[derive(Debug, Clone)]
pub struct AgentClient {
    inner: RawAgentClient<Channel>,
    headers: Headers,
}

/// What every call of a client presents.
#[derive(Debug, Clone, Default)]
struct Headers {
    owner: Option<tonic::metadata::AsciiMetadataValue>,
    timeout: Option<Duration>,
    call_id: Option<tonic::metadata::AsciiMetadataValue>,
}

impl Headers {
    /// `msg` with the owner token, the deadline and the call id, where set.
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(v) = &self.owner {
            r.metadata_mut().insert(OWNER_HEADER, v.clone());
        }
        if let Some(v) = &self.call_id {
            r.metadata_mut().insert(CALL_ID_HEADER, v.clone());
        }
        if let Some(t) = self.timeout {
            r.set_timeout(t);
            let at = SystemTime::now() + t;
            let ns = at.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos();
            if let Ok(v) = ns.to_string().parse() {
                r.metadata_mut().insert(DEADLINE_HEADER, v);
            }
        }
        r
    }
}

impl AgentClient {
    /// Connects to the agent at a socket path or `http://` address.
    pub async fn connect(target: &str) -> Result<Self, ClientError> {
        Ok(Self {
            inner: RawAgentClient::new(connect(target).await?).max_decoding_message_size(64 << 20),
            headers: Headers::default(),
        })
    }

    /// Gives every later call a deadline `timeout` after it is sent (none: calls wait for
    /// their answer). The agent copies no page of a call after its deadline: pages lent for
    /// a call that timed out are the engine's again.
    pub fn set_call_timeout(&mut self, timeout: Option<Duration>) {
        self.headers.timeout = timeout;
    }

    /// Names every later call `id` (see [`CALL_ID_HEADER`]; None: unnamed), so that
    /// [`Self::cancel`] on another clone can stop it. Give each call its own (a clone per
    /// call): an id once cancelled fences every call made under it for a minute after.
    /// LoadBack refuses an id (it cannot be cancelled).
    pub fn set_call_id(&mut self, id: Option<&str>) -> Result<(), ClientError> {
        self.headers.call_id = match id {
            None => None,
            Some(id) => {
                let ok = (1..=64).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_graphic());
                Some(id.parse().ok().filter(|_| ok).ok_or_else(|| {
                    ClientError::Protocol(format!(
                        "call id {id:?}: 1 to 64 printable ASCII characters, no spaces"
                    ))
                })?)
            }
        };
        Ok(())
    }

    /// Cancels this client's calls named `ids` that are still running: their copies stop,
    /// and the answer comes once no part of them is moving, so the pages they were lent are
    /// the engine's again. How many were running.
    pub async fn cancel(&mut self, ids: &[&str]) -> Result<u32, ClientError> {
        let r = self
            .inner
            .cancel(self.headers.request(v1::CancelRequest {
                call_ids: ids.iter().map(|s| s.to_string()).collect(),
            }))
            .await?
            .into_inner();
        Ok(r.cancelled)
    }

    /// The raw generated client, for requests the typed methods do not cover (wrap their
    /// messages in [`Self::request`] to present the owner token).
    pub fn raw(&mut self) -> &mut RawAgentClient<Channel> {
        &mut self.inner
    }

    /// `msg` as a request that presents this client's owner token, if it registered.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        self.headers.request(msg)
    }

    /// Registers the engine's KV pool: `token_slots` token slots per buffer, laid out as
    /// `spec`. The agent starts over with an empty tree (every device page is free).
    pub async fn register_pool(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
    ) -> Result<PoolInfo, ClientError> {
        self.register(spec, token_slots, pool, false).await
    }

    /// Registers a pool whose prefix cache the engine keeps itself (vLLM): the agent keeps
    /// no tree, and the engine uses [`Self::lookup_pages`], [`Self::load_pages`] and
    /// [`Self::save_pages`].
    pub async fn register_engine_cache(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
    ) -> Result<PoolInfo, ClientError> {
        self.register(spec, token_slots, pool, true).await
    }

    async fn register(
        &mut self,
        spec: &LayoutSpec,
        token_slots: u64,
        pool: PoolMemory,
        engine_cache: bool,
    ) -> Result<PoolInfo, ClientError> {
        let fds = pool.descriptors();
        let ticket = if fds.is_empty() {
            Vec::new()
        } else {
            self.deposit(fds).await?.to_vec()
        };
        let req = self.request(v1::RegisterPoolRequest {
            layout: Some(spec.into()),
            num_token_slots: token_slots,
            device: Some(pool.wire(ticket)),
            engine_cache,
        });
        let r = self.inner.register_pool(req).await?.into_inner();
        self.headers.owner = Some(r.owner.parse().map_err(|_| {
            ClientError::Protocol(format!(
                "the agent's owner token {:?} is not a metadata value",
                r.owner
            ))
        })?);
        Ok(PoolInfo {
            pages: r.num_pages,
            daemon_connected: r.daemon_connected,
        })
    }

    /// Deposits `fds` at the agent's memory door (its path from AgentStats): the ticket that
    /// names them in `RegisterPool`.
    pub async fn deposit(
        &mut self,
        fds: Vec<Arc<OwnedFd>>,
    ) -> Result<[u8; kvtier_shm::memory_door::TICKET_LEN], ClientError> {
        let socket = self.stats().await?.memory_socket;
        if socket.is_empty() {
            return Err(ClientError::Protocol(
                "the agent names no memory door (an older agent?)".into(),
            ));
        }
        tokio::task::spawn_blocking(move || {
            let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
            kvtier_shm::memory_door::deposit(
                std::path::Path::new(&socket),
                &borrowed,
                Duration::from_secs(10),
            )
        })
        .await
        .map_err(|e| ClientError::Protocol(format!("the deposit's thread failed: {e}")))?
        .map_err(ClientError::from)
    }

    /// Matches a prompt's full pages against every tier and locks the device prefix.
    pub async fn match_prefix(
        &mut self,
        tokens: &[u32],
        namespace: Option<&Namespace>,
    ) -> Result<Match, ClientError> {
        let r = self
            .inner
            .r#match(self.headers.request(match_request(tokens, namespace)))
            .await?
            .into_inner();
        Ok(r.into())
    }

    /// Matches several prompts in one call.
    pub async fn match_batch(
        &mut self,
        prompts: Vec<(Vec<u32>, Option<Namespace>)>,
    ) -> Result<Vec<Match>, ClientError> {
        let n = prompts.len();
        let requests = prompts
            .into_iter()
            .map(|(t, ns)| match_request(&t, ns.as_ref()))
            .collect();
        let r = self
            .inner
            .match_batch(self.headers.request(v1::MatchBatchRequest { requests }))
            .await?
            .into_inner();
        if r.responses.len() != n {
            return Err(ClientError::Protocol(format!(
                "{n} prompts matched, {} answers",
                r.responses.len()
            )));
        }
        Ok(r.responses.into_iter().map(Match::from).collect())
    }

    /// Loads the handle's L2 pages (after its device prefix) into `free_pages`, in order.
    pub async fn load_back(
        &mut self,
        handle: Handle,
        free_pages: Vec<u32>,
    ) -> Result<Loaded, ClientError> {
        let r = self
            .inner
            .load_back(self.headers.request(v1::LoadBackRequest {
                handle: handle.0,
                free_pages,
            }))
            .await?
            .into_inner();
        Ok(Loaded {
            loaded: r.loaded,
            device_pages: r.device_pages,
            unused_pages: r.unused_pages,
        })
    }

    /// Prefetches the handle's L3 pages into L2 under `policy` (unspecified: the daemon's
    /// configuration); returns the progress stream, whose last message is final.
    pub async fn prefetch(
        &mut self,
        handle: Handle,
        policy: v1::PrefetchPolicy,
        hints: Option<v1::PrefetchHints>,
    ) -> Result<tonic::Streaming<v1::PrefetchProgress>, ClientError> {
        Ok(self
            .inner
            .prefetch(self.headers.request(v1::AgentPrefetchRequest {
                handle: handle.0,
                policy: policy as i32,
                hints,
            }))
            .await?
            .into_inner())
    }

    /// Inserts computed pages: one device page per full page of `tokens`.
    pub async fn insert(
        &mut self,
        tokens: Vec<u32>,
        namespace: Option<&Namespace>,
        device_pages: Vec<u32>,
    ) -> Result<Inserted, ClientError> {
        let r = self
            .inner
            .insert(self.headers.request(insert_request(Insert {
                tokens,
                namespace: namespace.cloned(),
                device_pages,
            })))
            .await?
            .into_inner();
        Ok(inserted(r))
    }

    /// Inserts several prompts in one call.
    pub async fn insert_batch(
        &mut self,
        inserts: Vec<Insert>,
    ) -> Result<Vec<Inserted>, ClientError> {
        let n = inserts.len();
        let requests = inserts.into_iter().map(insert_request).collect();
        let r = self
            .inner
            .insert_batch(self.headers.request(v1::InsertBatchRequest { requests }))
            .await?
            .into_inner();
        if r.responses.len() != n {
            return Err(ClientError::Protocol(format!(
                "{n} inserts sent, {} answers",
                r.responses.len()
            )));
        }
        Ok(r.responses.into_iter().map(inserted).collect())
    }

    /// Unlocks a match's pages.
    pub async fn release(&mut self, handle: Handle) -> Result<(), ClientError> {
        self.inner
            .release(
                self.headers
                    .request(v1::AgentReleaseRequest { handle: handle.0 }),
            )
            .await?;
        Ok(())
    }

    /// Unlocks several matches' pages.
    pub async fn release_batch(&mut self, handles: &[Handle]) -> Result<(), ClientError> {
        self.inner
            .release_batch(self.headers.request(v1::ReleaseBatchRequest {
                handles: handles.iter().map(|h| h.0).collect(),
            }))
            .await?;
        Ok(())
    }

    /// Frees up to `pages` device pages, least recently used first, each backed up to L2
    /// first when the write policy keeps it.
    pub async fn evict(&mut self, pages: u32) -> Result<Evicted, ClientError> {
        let r = self
            .inner
            .evict(self.headers.request(v1::EvictRequest { pages }))
            .await?
            .into_inner();
        Ok(Evicted {
            pages: r.pages,
            backed_up: r.backed_up,
            lost: r.lost,
        })
    }

    /// Engine-cache mode: pages of the prompt after its first `start_page` that L2 holds,
    /// then L3 (and the prompt's full pages).
    pub async fn lookup_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
    ) -> Result<PagesLookup, ClientError> {
        self.lookup_with_keys(tokens, namespace, start_page, false)
            .await
    }

    /// [`Self::lookup_pages`], also returning the keys of the pages `tokens` cover when
    /// `want_keys`.
    pub async fn lookup_with_keys<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        want_keys: bool,
    ) -> Result<PagesLookup, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        self.inner
            .lookup(self.headers.request(v1::PagesLookupRequest {
                packed_tokens,
                namespace: namespace.map(Into::into),
                start_page,
                parent_key,
                want_keys,
            }))
            .await?
            .into_inner()
            .try_into()
    }

    /// Engine-cache mode: loads pages `start_page..` of the prompt into `device_pages`, in
    /// order; returns how many leading ones were loaded (the rest the engine computes).
    pub async fn load_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
        policy: v1::PrefetchPolicy,
    ) -> Result<u32, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        Ok(self
            .inner
            .load(self.headers.request(v1::LoadPagesRequest {
                packed_tokens,
                namespace: namespace.map(Into::into),
                start_page,
                device_pages,
                policy: policy as i32,
                hints: None,
                parent_key,
            }))
            .await?
            .into_inner()
            .loaded)
    }

    /// Engine-cache mode: saves the computed pages `start_page..` of the prompt, held in
    /// `device_pages`, into L2 per the write policy; the pages are free to reuse on return.
    pub async fn save_pages<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
    ) -> Result<Saved, ClientError> {
        self.save_selected(tokens, namespace, start_page, device_pages, None)
            .await
    }

    /// [`Self::save_pages`] with the write policy's selection as a Lookup answered it
    /// (`save_pages`, possibly another rank's agent's): pages before `selected` are saved,
    /// the rest skipped.
    pub async fn save_selected<'a>(
        &mut self,
        tokens: impl Into<PromptTokens<'a>>,
        namespace: Option<&Namespace>,
        start_page: u32,
        device_pages: Vec<u32>,
        selected: Option<u32>,
    ) -> Result<Saved, ClientError> {
        let (packed_tokens, parent_key) = tokens.into().wire();
        Ok(self
            .inner
            .save(self.headers.request(v1::SavePagesRequest {
                packed_tokens,
                namespace: namespace.map(Into::into),
                start_page,
                device_pages,
                selected,
                parent_key,
            }))
            .await?
            .into_inner()
            .into())
    }

    /// Engine-cache mode: several Saves in one call (an engine step's new pages for all its
    /// requests). Every request is checked before any page moves; a malformed one refuses
    /// the call, naming `requests[i]`. Answers in request order.
    pub async fn save_batch(
        &mut self,
        saves: &[SaveRequest<'_>],
    ) -> Result<Vec<Saved>, ClientError> {
        let requests = saves
            .iter()
            .map(|s| {
                let (packed_tokens, parent_key) = s.tokens.wire();
                v1::SavePagesRequest {
                    packed_tokens,
                    namespace: s.namespace.map(Into::into),
                    start_page: s.start_page,
                    device_pages: s.device_pages.clone(),
                    selected: s.selected,
                    parent_key,
                }
            })
            .collect();
        let r = self
            .inner
            .save_batch(self.headers.request(v1::SaveBatchRequest { requests }))
            .await?
            .into_inner();
        if r.responses.len() != saves.len() {
            return Err(ClientError::Protocol(format!(
                "{} answers to {} Saves",
                r.responses.len(),
                saves.len()
            )));
        }
        Ok(r.responses.into_iter().map(Into::into).collect())
    }

    /// The agent's counters.
    pub async fn stats(&mut self) -> Result<v1::AgentStatsResponse, ClientError> {
        Ok(self
            .inner
            .agent_stats(v1::AgentStatsRequest {})
            .await?
            .into_inner())
    }
}
